"""`vllm-rlt` command line: `generate` (also the default when no subcommand is given),
`serve` and `bench`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from vllm_rlt.cli_parser import CLIParser, unknown_choice
from vllm_rlt.config import KV_CONNECTORS, SERVE
from vllm_rlt.engine_config import EngineConfig, ParallelConfig
from vllm_rlt.entrypoints.args import add_engine_args, config_default, engine_config_or_exit
from vllm_rlt.entrypoints.generate import run_generate
from vllm_rlt.entrypoints.openai.origins import json_strings
from vllm_rlt.entrypoints.sampling_args import add_sampling_args

CPU_CORES_PER_API_SERVER = 4  # the rest: the engine core, tokenizer threads, the clients
MOST_AUTO_API_SERVERS = 4

if TYPE_CHECKING:  # the server's modules load when serve runs, not to parse flags
    from vllm_rlt.entrypoints.openai.settings import DataParallelLayout, ServerSettings

SUBCOMMANDS = ("generate", "bench", "serve")
BENCHMARKS = {
    "throughput": ("vllm_rlt.bench.throughput", "offline engine tokens/s against a naive baseline"),
    "serve": ("vllm_rlt.bench.serve", "load generator against a running server"),
    "accuracy": ("vllm_rlt.bench.accuracy", "task accuracy at each depth and exit threshold"),
    "sweep": ("vllm_rlt.bench.sweep", "scheduler settings against a workload, best first"),
}
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "zmq", "orjson")
DESCRIPTION = """Inference engine for looped language models.

examples:
  vllm-rlt generate --prompt "347+589="        the built-in model, on the CPU
  vllm-rlt serve                                OpenAI-compatible server on 127.0.0.1:8000
  vllm-rlt bench throughput --help              benchmarks: throughput, serve, accuracy, sweep
"""


def build_parser() -> CLIParser:
    parser = CLIParser(prog="vllm-rlt", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = sub.add_parser(
        "generate",
        help="generate text offline (the default command)",
        description="Generate text offline: one line per prompt, or one JSON object with --json.",
    )
    generate.add_argument(
        "--prompt", action="append", default=None, help="prompt (repeatable; default: stdin lines)"
    )
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    generate.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_sampling_args(generate)
    add_engine_args(generate)
    bench = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHMARKS),
        description="Benchmarks; each prints JSON on stdout and takes --help:\n"
        + "".join(
            f"  vllm-rlt bench {name:<11} {text}\n" for name, (_, text) in BENCHMARKS.items()
        ),
    )
    bench.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark")
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="OpenAI-compatible HTTP server (needs the 'serve' extra).",
    )
    serve.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="model folder, built-in name (ouro-tasks, huginn-tasks, toy) or Hugging Face hub "
        "id (or --model; default: ouro-tasks)",
    )
    add_server_args(serve)
    add_engine_args(serve)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from add_engine_args)."""
    group = parser.add_argument_group("server")
    _add_http_args(group)
    _add_process_args(group)
    group.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="add POST /sleep?level=1, POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping "
        "and POST /reset_prefix_cache (vLLM's sleep mode: give the GPU memory back between "
        "uses)",
    )
    group.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="add an RL trainer's endpoints: POST /pause?mode=abort|wait|keep, /resume, "
        "/init_weights_update_group, /update_weights_from_distributed, "
        "/update_weights_from_disk, GET /is_paused, /get_weight_version (default: off)",
    )
    group.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log one line per HTTP request (it costs throughput under load)",
    )
    group.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="/health fails when work is queued and no pass completed for this long (seconds)",
    )
    _add_connection_args(parser)


def _add_http_args(group: argparse._ArgumentGroup) -> None:
    """Where the server listens, its name for the model, its key and request limits."""
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: the model's)"
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_RLT_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        help="required as 'Authorization: Bearer KEY' (default: env VLLM_RLT_API_KEY, else "
        "VLLM_API_KEY as vLLM reads it, else none)",
    )
    group.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="sequences that may wait for a slot; more get 429 (default: unbounded)",
    )
    group.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="prompts x n one request may ask for; more get 400",
    )
    group.add_argument(
        "--max-logprobs-per-request",
        type=int,
        default=1 << 24,
        help="logprob entries one non-streamed reply may hold (choices x tokens x "
        "(logprobs + 1), prompt_logprobs and echo included); more get 400",
    )
    group.add_argument(
        "--request-timeout", type=float, default=None, help="seconds (default: none)"
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGTERM before they are aborted",
    )
    group.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")


def _add_process_args(group: argparse._ArgumentGroup) -> None:
    """API servers and data-parallel cores, here and on other hosts."""
    group.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="API-server processes sharing the port and the engine core: HTTP, JSON and "
        "text work spread over more CPU cores (--max-queue then applies to each) "
        "(default: 1 with --device cpu or cores on other hosts; on a GPU one per "
        f"{CPU_CORES_PER_API_SERVER} CPU cores, at most {MOST_AUTO_API_SERVERS})",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=config_default(ParallelConfig, "data_parallel_size"),
        help="engine cores, each a whole engine on its own GPU (the first N visible), behind "
        "this server; each request goes to the least loaded one",
    )
    group.add_argument(
        "--disaggregate",
        default=None,
        metavar="P:D",
        help="P prefill engine cores run prompts and hand each request's K/V to one of D "
        "decode cores (each on its own GPUs on CUDA, one per --tensor-parallel-size rank; "
        "one API server) (default: off)",
    )
    group.add_argument(
        "--kv-connector",
        choices=KV_CONNECTORS,
        default=config_default(ParallelConfig, "kv_connector"),
        help="how --disaggregate moves K/V: torch maps the prefill core's pool and copies "
        "from it (CUDA IPC between GPUs of one host, shared memory on the CPU); nixl reads "
        "it through NIXL (needs: pip install nixl); auto picks torch (default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="of the --data-parallel-size cores, how many run on this host (the rest connect "
        "from other hosts with --headless; needs --api-key) (default: all)",
    )
    group.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        help="the frontend's address that cores on other hosts connect to",
    )
    group.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=13345,
        help="first port of the channel to cores on other hosts (3 ports per core)",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="run --data-parallel-size-local engine cores here for the frontend at "
        "--data-parallel-address, and no HTTP server",
    )
    group.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help="with --headless: the rank of this host's first core",
    )


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Connection limits and timeouts, and the browser origins allowed."""
    limits = parser.add_argument_group("connections")
    limits.add_argument(
        "--allowed-origins",
        type=json_strings,
        default=(),
        help="browser origins that may call the server, a JSON list as vLLM takes it "
        "(e.g. '[\"https://app.example\"]'; '[\"*\"]': any, vLLM's default); a request "
        "from any other origin gets 403 (default: none)",
    )
    limits.add_argument(
        "--allowed-methods",
        type=json_strings,
        default=("*",),
        help="methods the CORS replies allow the listed origins, a JSON list (default: '[\"*\"]')",
    )
    limits.add_argument(
        "--allowed-headers",
        type=json_strings,
        default=("*",),
        help="request headers the CORS replies allow the listed origins, a JSON list "
        "(default: '[\"*\"]')",
    )
    limits.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS replies let the listed origins send cookies and credentials",
    )
    limits.add_argument(
        "--limit-concurrency",
        type=int,
        default=4096,
        help=(
            "open connections served at once; a new one beyond it replaces the connection "
            "idle longest, or gets 503 where every connection is in a request"
        ),
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a whole request head",
    )
    limits.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds a client has to send a body"
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open",
    )
    limits.add_argument(
        "--max-header-bytes", type=int, default=16384, help="larger request heads get 400"
    )
    limits.add_argument(
        "--exit-on-load-error",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end the process when the model fails to load (else keep answering 503; with "
        "several API servers it always ends)",
    )


def missing_serve_modules() -> list[str]:
    missing = []
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def run_serve(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    missing = missing_serve_modules()
    if missing:
        parser.error(
            f"vllm-rlt serve needs the serve extra ({', '.join(missing)} not installed): "
            'pip install "vllm-rlt[serve]" (from a clone: pip install -e ".[serve]")'
        )
    from vllm_rlt.engine.process.dp_client import engine_environments
    from vllm_rlt.entrypoints.headless import run_headless
    from vllm_rlt.entrypoints.openai.api_servers import APIServerFailed
    from vllm_rlt.entrypoints.openai.launch import serve
    from vllm_rlt.entrypoints.openai.server import log_like_uvicorn

    if ns.model_path is not None:
        if ns.model is not None and ns.model != ns.model_path:
            parser.error("give the model either as an argument or with --model, not both")
        ns.model = ns.model_path
    sized_api_servers = ns.api_server_count is None
    if sized_api_servers:
        local = ns.data_parallel_size_local
        remote = local is not None and local < ns.data_parallel_size
        auto = auto_api_server_count(ns.device, remote or ns.headless)
        ns.api_server_count = 1 if ns.disaggregate is not None else auto
    try:
        layout = _data_parallel_layout(ns)
        parallel = _parallel_flags(ns)
        settings = _server_settings(ns, ParallelConfig(**parallel))
    except ValueError as exc:
        parser.error(str(exc))
    if not ns.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {ns.shutdown_timeout}")
    local = layout.local_cores
    if not 0 < ns.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {ns.port}")
    engine_config = engine_config_or_exit(parser, ns, usage_context=SERVE, **parallel)
    try:  # GPUs enough
        if (local > 1 or ns.headless) and not engine_config.parallel_config.disaggregate:
            engine_environments(engine_config, local)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if ns.headless:
        log_like_uvicorn()
        return run_headless(
            engine_config,
            local,
            ns.data_parallel_start_rank,
            ns.data_parallel_address,
            ns.data_parallel_rpc_port,
            ns.api_key,
        )
    if sized_api_servers:
        log_like_uvicorn()
        logging.getLogger("vllm_rlt.server").info(
            "%d API server(s) for --device %s on %d CPU cores (--api-server-count overrides)",
            settings.api_server_count,
            ns.device,
            os.cpu_count() or 1,
        )
    if settings.served_model_name is None and engine_config.model_config.model != ns.model:
        # a hub ID resolved to its cache folder: serve it under the ID, as vLLM does
        settings = dataclasses.replace(settings, served_model_name=ns.model)
    settings = dataclasses.replace(
        settings, remote_cores=layout.remote_cores(), engine_config=engine_config
    )
    try:
        load_error = serve(settings, ns.host, ns.port, ns.shutdown_timeout)
    except OSError as exc:
        parser.error(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc}")
    except APIServerFailed as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    if load_error is None:
        return 0
    if isinstance(load_error, (ValueError, OSError)):
        parser.error(str(load_error))
    print(f"{parser.prog}: error: the model failed to load: {load_error!r}", file=sys.stderr)
    return 1


def auto_api_server_count(device: str, cores_elsewhere: bool, cpus: int | None = None) -> int:
    """API servers when --api-server-count is left out. One API server turns 1-2 ms of CPU
    into each request (HTTP, JSON, tokens, text), so a burst of 256 requests reaches a GPU
    engine over 200-400 ms while it runs passes of a few rows; on an H200 with 16 CPU cores,
    four API servers served 256 requests at once 1.1-1.2x faster than one
    (docs/scheduler-defaults.md). A CPU engine needs those cores itself, and cores on other
    hosts take one API server."""
    if cores_elsewhere or device == "cpu":
        return 1
    if cpus is None:
        cpus = os.cpu_count() or 1
    return max(1, min(MOST_AUTO_API_SERVERS, cpus // CPU_CORES_PER_API_SERVER))


def _parallel_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The parallel config's fields only the server's flags give (ParamError names a bad
    one)."""
    from vllm_rlt.entrypoints.openai.settings import disaggregate_sizes

    return {
        "data_parallel_size": ns.data_parallel_size,
        "disaggregate": None if ns.disaggregate is None else disaggregate_sizes(ns.disaggregate),
        "kv_connector": ns.kv_connector,
    }


def _server_settings(ns: argparse.Namespace, parallel: ParallelConfig) -> ServerSettings:
    """The server's settings from its flags (ParamError names a bad one), checked against
    the engine's `parallel` config (the whole engine config comes once the model is had)."""
    from vllm_rlt.entrypoints.openai.settings import ServerSettings

    return ServerSettings(
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        max_queue=ns.max_queue,
        request_timeout=ns.request_timeout,
        max_body_bytes=ns.max_body_bytes,
        stall_timeout=ns.stall_timeout,
        max_sequences_per_request=ns.max_sequences_per_request,
        max_logprobs_per_request=ns.max_logprobs_per_request,
        header_timeout=ns.header_timeout,
        body_timeout=ns.body_timeout,
        keep_alive_timeout=ns.timeout_keep_alive,
        max_connections=ns.limit_concurrency,
        max_header_bytes=ns.max_header_bytes,
        exit_on_load_error=ns.exit_on_load_error,
        access_log=ns.access_log,
        enable_sleep_mode=ns.enable_sleep_mode,
        enable_weight_updates=ns.enable_weight_updates,
        api_server_count=ns.api_server_count,
        allowed_origins=ns.allowed_origins,
        allowed_methods=ns.allowed_methods,
        allowed_headers=ns.allowed_headers,
        allow_credentials=ns.allow_credentials,
        engine_config=EngineConfig(parallel_config=parallel),
    )


def _data_parallel_layout(ns: argparse.Namespace) -> DataParallelLayout:
    """Where the data-parallel cores run, from the flags (ParamError names a bad one)."""
    from vllm_rlt.entrypoints.openai.settings import DataParallelLayout

    return DataParallelLayout(
        size=ns.data_parallel_size,
        local=ns.data_parallel_size_local,
        start_rank=ns.data_parallel_start_rank,
        address=ns.data_parallel_address,
        rpc_port=ns.data_parallel_rpc_port,
        headless=ns.headless,
        api_server_count=ns.api_server_count,
        api_key=ns.api_key,
        disaggregate=ns.disaggregate is not None,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        # each imports without the extras; what a run needs it asks for after --help
        module = importlib.import_module(BENCHMARKS[argv[1]][0])
        return module.main(argv[2:])
    parser = build_parser()
    # generate takes no positional argument: a word first can only be a mistyped command
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        parser.error(unknown_choice("command", argv[0], SUBCOMMANDS))
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        bench = parser.subcommand_parser(argparse.Namespace(command="bench"))
        bench.error(unknown_choice("benchmark", argv[1], list(BENCHMARKS)))
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["generate", *argv]
    ns = parser.parse_args(argv)
    sub_parser = parser.subcommand_parser(ns)
    if ns.command == "serve":
        return run_serve(sub_parser, ns)
    return run_generate(sub_parser, ns)


def serve_main() -> int:
    """`vllm-rlt-serve --model MODEL ...`, the seed's spelling of `vllm-rlt serve`."""
    return main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
