"""Split a decode step into device time (graph replay) and host time, and list the kernels.

python -m benchmarks.profile_pass --shape ouro-1.4b --concurrency 1 64
python -m benchmarks.profile_pass --concurrency 1 8 --speculative-tokens 1 --draft-loops 2 \
    --spec-acceptance-rate 0.8
"""

from __future__ import annotations

import time

import torch

from vllm_rlt.bench.shapes import random_model
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.entrypoints.args import add_speculation_args, speculative_config
from vllm_rlt.sampling_params import SamplingParams


def profile(model, concurrency: int, steps: int, spec: SpeculativeConfig | None) -> None:
    engine = build_engine_core(
        model,
        None,
        # 64 prompt tokens plus at most one token per step (16 warm-up steps and the timed
        # ones), in blocks of 16: large concurrencies fit beside the weights
        CacheConfig(num_blocks=concurrency * (-(-(64 + 16 + steps) // 16) + 1) + 8),
        SchedulerConfig(
            max_num_seqs=concurrency,
            max_num_batched_tokens=max(2048, 64 * concurrency),
            max_prefill_batches_before_decode=concurrency,
        ),
        ExitConfig(),
        ExecutionConfig(),
        "auto",
        spec,
    )
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    for i in range(concurrency):
        engine.add_request(str(i), list(range(3, 67)), params)
    for _ in range(16):
        engine.step()
    torch.cuda.synchronize()
    spent = {"schedule": 0.0, "execute": 0.0}
    for name, owner in (("schedule", engine.scheduler), ("execute", engine.runner)):
        original = getattr(owner, name)

        def timed(*a, _original=original, _name=name):
            begin = time.perf_counter()
            result = _original(*a)
            spent[_name] += time.perf_counter() - begin
            return result

        setattr(owner, name, timed)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    parts = ", ".join(f"{k} {v / steps * 1e3:.3f} ms" for k, v in spent.items())
    print(f"concurrency {concurrency}: {parts}")
    rows = concurrency * engine.scheduler.lanes_per_request
    graphs = engine.runner.graphs
    size = next(s for s in graphs.sizes if s >= rows)
    graph, _ = graphs.graphs[(size, True, False, False, spec is not None)]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = begin.elapsed_time(end) / steps
    print(f"concurrency {concurrency}: step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    )
    for request_id in list(engine.groups):
        engine.abort_request(request_id)


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.profile_pass", description=__doc__)
    parser.add_argument("--shape", default="ouro-1.4b", help="model shape (random weights)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 64], help="rows per decode pass"
    )
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per case")
    add_speculation_args(parser, replay=True)
    args = parser.parse_args()
    model = random_model(args.shape, torch.bfloat16, torch.device("cuda"))
    for concurrency in args.concurrency:
        profile(model, concurrency, args.steps, speculative_config(args))


if __name__ == "__main__":
    main()
