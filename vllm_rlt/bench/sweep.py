"""`vllm-rlt bench sweep`: which scheduler settings serve a workload best on this device.

For every point of a grid over `max_num_seqs`, `max_num_batched_tokens`,
`max_prefill_batches_before_decode`, `prefill_chunk_size` and `admission_scan_limit` (each
value may be `auto`: the device's default for --usage), the offline engine runs closed
batches: every concurrency value's requests are sent at once, as `LLM.generate` does with
a list of prompts. With
`--launch MODEL` a server is measured instead: `vllm-rlt bench serve --launch MODEL` with
the point's flags, its requests sent at once by the load generator. Each run
reports end-to-end output tokens/s (first request sent to last token), TTFT and TPOT at
p50/p99. Points that resolve to the same settings on the device (an `auto` value equal to
an explicit one) run once: their result lists the others under `also_asked`. The report's
`rows` are one flat record per (point run, concurrency), ready to plot; `best` names the
point with the highest geometric mean of tokens/s over the concurrencies, and
`auto_vs_best` how the defaults compare with it when the grid has the all-`auto` point, as
the default grid does (`auto` for prefill_chunk_size is its fixed default, 512).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import shlex
import statistics
import sys
from typing import Any

from tqdm import tqdm

from vllm_rlt.bench.report import check_minimums, run_and_emit
from vllm_rlt.bench.shapes import SHAPES
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import (
    SERVE,
    USAGE_CONTEXTS,
    CacheConfig,
    SchedulerConfig,
)
from vllm_rlt.sampling_params import SamplingParams

GRID_DEFAULTS: dict[str, list[int | None]] = {
    "max_num_seqs": [None, 256, 1024],
    "max_num_batched_tokens": [None, 2048, 8192, 16384],
    "max_prefill_batches_before_decode": [None, 4, 256],
    "prefill_chunk_size": [None],
    "admission_scan_limit": [None],
}
GRID = tuple(GRID_DEFAULTS)
SERVER_GRID = ("api_server_count",)  # a server's own settings: with --launch only
METRICS = ("tokens_per_s", "ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99")


def _grid_value(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--shape", choices=list(SHAPES), default="toy", help="model shape, random weights"
    )
    workload.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)"
    )
    workload.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, else float32")
    workload.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    workload.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    workload.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64, 256],
        help="requests sent at once; every point runs each value",
    )
    workload.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks in the pool (default: sized from device memory on CUDA, as the "
        "engine sizes it)",
    )
    workload.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    workload.add_argument(
        "--repeats", type=int, default=2, help="timed runs per point; the median is kept"
    )
    workload.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    grid = parser.add_argument_group("grid (each value an integer or 'auto': the device default)")
    for name, values in GRID_DEFAULTS.items():
        shown = " ".join("auto" if value is None else str(value) for value in values)
        grid.add_argument(
            f"--{name.replace('_', '-')}",
            type=_grid_value,
            nargs="+",
            default=None,
            help=f"values to try (default: {shown})",
        )
    grid.add_argument(
        "--api-server-count",
        type=_grid_value,
        nargs="+",
        default=None,
        help="with --launch: the server's API processes to try (default: auto)",
    )
    parser.add_argument(
        "--num-clients",
        type=int,
        default=4,
        help="with --launch: load-generator processes sharing each run's requests",
    )
    parser.add_argument(
        "--launch",
        metavar="MODEL",
        default=None,
        help="measure `vllm-rlt serve MODEL` instead of the offline engine: every point and "
        "concurrency runs `vllm-rlt bench serve --launch MODEL` with the point's flags "
        "(`python -m benchmarks.random_checkpoint` writes a folder of a --shape; default: "
        "the offline engine)",
    )
    parser.add_argument(
        "--usage",
        choices=USAGE_CONTEXTS,
        default="offline",
        help="whose device defaults 'auto' stands for (with --launch: the server's)",
    )
    parser.add_argument(
        "--output", default=None, help="also write the JSON report here (default: stdout only)"
    )


def grid_points(args: argparse.Namespace) -> list[dict[str, int | None]]:
    """Every combination of the grid's values, in the order given; a point whose explicit
    max_num_batched_tokens is below its explicit max_num_seqs is left out (the scheduler
    refuses it: every running request needs a row)."""
    axes = GRID + SERVER_GRID
    points = []
    for values in itertools.product(*(dict.fromkeys(getattr(args, name)) for name in axes)):
        point = dict(zip(axes, values, strict=True))
        seqs, rows = point["max_num_seqs"], point["max_num_batched_tokens"]
        if seqs is None or rows is None or rows >= seqs:
            points.append(point)
    return points


def scheduler_config(point: dict[str, int | None]) -> SchedulerConfig:
    """The point's scheduler settings, its `auto` values left to the engine."""
    return SchedulerConfig(**{name: point[name] for name in GRID if point[name] is not None})


def distinct_points(
    points: list[dict[str, int | None]], device, usage: str
) -> list[list[dict[str, int | None]]]:
    """The points grouped by the settings they resolve to on `device` for `usage` (an `auto`
    api_server_count: the server's default), in grid order: each group runs once."""
    from vllm_rlt.engine.device_defaults import size_scheduler
    from vllm_rlt.entrypoints.cli import auto_api_server_count

    groups: dict[tuple[int | None, ...], list[dict[str, int | None]]] = {}
    for point in points:
        config, _ = size_scheduler(scheduler_config(point), device, usage)
        servers = point["api_server_count"]
        if usage == SERVE and servers is None:
            servers = auto_api_server_count(device.type, False)
        key = (*(getattr(config, name) for name in GRID), servers)
        groups.setdefault(key, []).append(point)
    return list(groups.values())


def measure(engine, args, concurrency: int, rng_seed: int) -> dict[str, Any]:
    """The median run (by tokens/s) of `args.repeats` closed batches, after the warm-up."""
    import random

    from vllm_rlt.bench.throughput_engine import run_engine

    rng = random.Random(rng_seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, exit_threshold=1.0
    )
    runs = []
    for index in range(args.warmup + args.repeats):
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(concurrency)
        ]
        timing = run_engine(engine, prompts, params)
        if index >= args.warmup:
            runs.append(timing)
    runs.sort(key=lambda run: run["end_to_end_tokens_per_s"])
    median = runs[len(runs) // 2]
    return {
        "tokens_per_s": median["end_to_end_tokens_per_s"],
        "tokens_per_s_runs": [run["end_to_end_tokens_per_s"] for run in runs],
        **{name: median[name] for name in METRICS[1:]},
    }


class OfflinePoints:
    """Each point as an engine in this process, on one random model of --shape."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from vllm_rlt.bench.shapes import random_model
        from vllm_rlt.models.load import resolve_device, resolve_dtype

        self.args = args
        self.device = resolve_device(
            args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model = random_model(args.shape, self.dtype, self.device, args.seed)

    def measure(self, point: dict[str, int | None]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the settings the engine resolved, figures by concurrency)."""
        import torch

        from vllm_rlt.engine.builder import build_engine_core
        from vllm_rlt.engine_config import EngineConfig

        engine = build_engine_core(
            self.model,
            None,
            EngineConfig(
                cache_config=CacheConfig(num_blocks=self.args.num_blocks),
                scheduler_config=scheduler_config(point),
                usage_context=self.args.usage,
            ),
        )
        settings = {name: getattr(engine.scheduler.config, name) for name in GRID}
        figures = {
            str(c): measure(engine, self.args, c, self.args.seed + c) for c in self.args.concurrency
        }
        del engine
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return settings, figures


class ServedPoints:
    """Each point as one `vllm-rlt serve --launch MODEL` with the point's flags (an `auto`
    value leaves its flag out: the server's own default), loaded once; every concurrency is
    then the median of --repeats `vllm-rlt bench serve --url` runs against it, each sending
    its requests at once after its warm-up."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm_rlt.models.load import resolve_device

        self.args = args
        self.device = resolve_device(args.device or "cpu")  # the server's default device

    def measure(self, point: dict[str, int | None]) -> tuple[dict[str, Any], dict[str, Any]]:
        from vllm_rlt.bench.serve_launch import launched

        args = self.args
        flags = ["--device", args.device] if args.device else []
        for name, value in point.items():
            if value is not None:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        if args.num_blocks is not None:
            flags += ["--num-blocks", str(args.num_blocks)]
        figures = {}
        info: dict[str, Any] = {}
        with launched(["vllm_rlt.entrypoints.cli", "serve", args.launch], flags, info) as url:
            for concurrency in args.concurrency:
                runs = sorted(
                    (self.run_load(url, concurrency) for _ in range(args.repeats)),
                    key=lambda run: run["tokens_per_s"],
                )
                figures[str(concurrency)] = {
                    **runs[len(runs) // 2],
                    "tokens_per_s_runs": [run["tokens_per_s"] for run in runs],
                }
        return dict(point), figures

    def run_load(self, url: str, concurrency: int) -> dict[str, float]:
        import json
        import subprocess
        import tempfile

        args = self.args
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "bench", "serve"]
            command += ["--url", url, "--num-requests", str(concurrency)]
            command += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
            clients = min(args.num_clients, concurrency)
            command += ["--seed", str(args.seed), "--num-clients", str(clients)]
            command += ["--output", out.name]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise ValueError(f"bench serve failed: {done.stderr.strip()[-500:]}")
            report = json.loads(out.read())
        return {
            "tokens_per_s": report["output_tokens_per_s"],
            **{f"ttft_s_p{q}": report["ttft_s"][f"p{q}"] for q in (50, 99)},
            **{f"tpot_s_p{q}": report["tpot_s"][f"p{q}"] for q in (50, 99)},
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    measurer = ServedPoints(args) if args.launch else OfflinePoints(args)
    usage = SERVE if args.launch else args.usage
    groups = distinct_points(grid_points(args), measurer.device, usage)
    rows: list[dict[str, Any]] = []
    results = []
    with tqdm(total=len(groups), desc="sweep", unit="point", file=sys.stderr) as bar:
        for point, *same in groups:
            bar.set_postfix_str(str(point))
            settings, per_concurrency = measurer.measure(point)
            for concurrency, figures in per_concurrency.items():
                rows.append(
                    {
                        **{f"{name}_asked": value for name, value in point.items()},
                        **settings,
                        "concurrency": int(concurrency),
                        **{name: figures[name] for name in METRICS},
                    }
                )
            results.append(
                {
                    "asked": point,
                    "also_asked": same,
                    "settings": settings,
                    "results": per_concurrency,
                }
            )
            bar.update()
    for result in results:
        speeds = [figures["tokens_per_s"] for figures in result["results"].values()]
        result["geomean_tokens_per_s"] = math.exp(statistics.fmean(math.log(s) for s in speeds))
    best = max(results, key=lambda result: result["geomean_tokens_per_s"])
    report: dict[str, Any] = {
        "benchmark": "sweep",
        "command": shlex.join(["vllm-rlt", "bench", "sweep", *args.argv]),
        "target": f"vllm-rlt serve {args.launch}" if args.launch else "offline engine",
        "usage": usage,
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
        },
        "best": best,
        "results": results,
        "rows": rows,
    }
    if isinstance(measurer, OfflinePoints):
        from vllm_rlt.bench.device_figures import environment

        report["environment"] = environment(measurer.device)
        report["shape"] = args.shape
        report["dtype"] = str(measurer.dtype).removeprefix("torch.")
    else:
        from vllm_rlt.bench.serve import environment as served_environment

        report["environment"] = served_environment(args.device or "cpu")
    auto = [
        result
        for result in results
        for point in (result["asked"], *result["also_asked"])
        if all(value is None for value in point.values())
    ]
    if auto:
        report["auto_vs_best"] = {
            concurrency: auto[0]["results"][concurrency]["tokens_per_s"] / figures["tokens_per_s"]
            for concurrency, figures in best["results"].items()
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="vllm-rlt bench sweep", description=__doc__)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    for name, values in GRID_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values)
    check_minimums(
        parser, args, prompt_len=1, output_len=1, repeats=1, warmup=0, concurrency=1, num_clients=1
    )
    if args.api_server_count is not None and not args.launch:
        parser.error("--api-server-count sizes a server: it needs --launch MODEL")
    args.api_server_count = args.api_server_count or [None]
    if not grid_points(args):
        parser.error("the grid has no point where max_num_batched_tokens >= max_num_seqs")
    if args.launch:  # as `bench serve --launch` does, before a server starts per point
        from vllm_rlt.bench.serve_client import require_aiohttp
        from vllm_rlt.bench.serve_launch import server_flags_parser
        from vllm_rlt.entrypoints.args import engine_config_or_exit

        require_aiohttp(parser)
        engine_config_or_exit(parser, server_flags_parser().parse_args(["--model", args.launch]))
    return run_and_emit(parser, run, args)


if __name__ == "__main__":
    sys.exit(main())
