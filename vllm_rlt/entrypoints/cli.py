"""`vllm-rlt` command line: `generate` (also the default when no subcommand is given)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_rlt.entrypoints.args import add_engine_args, engine_args_from
from vllm_rlt.sampling_params import SamplingParams

SUBCOMMANDS = ("generate", "bench", "serve")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=32)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--min-loops", type=int, default=None)
    group.add_argument("--max-loops", type=int, default=None)
    group.add_argument("--exit-threshold", type=float, default=None)


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        min_tokens=ns.min_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
        min_loops=ns.min_loops,
        max_loops=ns.max_loops,
        exit_threshold=ns.exit_threshold,
    )


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags fail at once with one line on stderr and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="vllm-rlt", description="Inference engine for looped language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="generate text offline")
    generate.add_argument(
        "--prompt", action="append", default=None, help="prompt (repeatable; default: stdin lines)"
    )
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    generate.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_sampling_args(generate)
    add_engine_args(generate)
    sub.add_parser(
        "bench",
        help="benchmarks: `vllm-rlt bench throughput --help`, `vllm-rlt bench serve --help`",
        add_help=False,
    )
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None, help="model folder (or --model)")
    add_server_args(serve)
    add_engine_args(serve)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None)
    group.add_argument(
        "--api-key", default=os.environ.get("VLLM_RLT_API_KEY"), help="or env VLLM_RLT_API_KEY"
    )
    group.add_argument("--max-queue", type=int, default=None, help="bound on waiting requests")
    group.add_argument("--request-timeout", type=float, default=None, help="seconds")
    group.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds")
    group.add_argument("--max-body-bytes", type=int, default=1 << 20)
    group.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="/health fails when work is queued and no pass completed for this long",
    )


def run_serve(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from vllm_rlt.entrypoints.openai.server import ServerSettings, serve

    if ns.model_path is not None:
        if ns.model is not None and ns.model != ns.model_path:
            parser.error("give the model either as an argument or with --model, not both")
        ns.model = ns.model_path
    for name in ("max_queue", "max_body_bytes"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < ns.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {ns.port}")
    try:
        engine_args = engine_args_from(ns)
    except ValueError as exc:
        parser.error(str(exc))
    settings = ServerSettings(
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        max_queue=ns.max_queue,
        request_timeout=ns.request_timeout,
        max_body_bytes=ns.max_body_bytes,
        stall_timeout=ns.stall_timeout,
        llm_kwargs=engine_args.llm_kwargs(),
    )
    serve(settings, ns.host, ns.port, ns.shutdown_timeout)
    return 0


def run_generate(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from vllm_rlt.engine.llm import LLM

    try:
        engine_args = engine_args_from(ns)
        params = sampling_params_from(ns)
    except ValueError as exc:
        parser.error(str(exc))
    prompts = ns.prompt if ns.prompt else [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        parser.error("no prompt: pass --prompt TEXT or pipe prompts on stdin, one per line")
    try:
        llm = LLM(**engine_args.llm_kwargs())
        params.resolved_loops(llm.engine.num_loops)
        outputs = llm.generate(prompts, params, use_tqdm=not ns.no_progress and not ns.json)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        if ns.json:
            record = {
                "prompt": prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "exit_depths": completion.exit_depths,
                "finish_reason": completion.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt}{completion.text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "throughput"]:
        from vllm_rlt.bench.throughput import main as throughput

        return throughput(argv[2:])
    if argv[:2] == ["bench", "accuracy"]:
        from vllm_rlt.bench.accuracy import main as accuracy

        return accuracy(argv[2:])
    if argv[:2] == ["bench", "serve"]:
        from vllm_rlt.bench.serve import main as serve_bench

        return serve_bench(argv[2:])
    if argv[:1] == ["bench"]:
        print(
            "vllm-rlt bench: error: choose a benchmark: throughput, serve or accuracy",
            file=sys.stderr,
        )
        return 2
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["generate", *argv]
    parser = build_parser()
    ns = parser.parse_args(argv)
    sub_parser = parser._subparsers._group_actions[0].choices[ns.command]  # type: ignore[union-attr]
    if ns.command == "serve":
        return run_serve(sub_parser, ns)
    return run_generate(sub_parser, ns)


def serve_main() -> int:
    """`vllm-rlt-serve --model MODEL ...`, the seed's spelling of `vllm-rlt serve`."""
    return main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
