"""What the device sampler costs per sampled pass, and what its top-n-sigma step adds when no
row asks for it: `layers.sampler.sample` captured in a CUDA graph over random logits of the
Ouro vocabulary, at each row count, as written and with `top_n_sigma` replaced by the
identity; then the path a pass with no filtering row takes instead (`sample_plain`, no
sort), in torch and as the Triton kernel; top_p 0.7 rows in torch (the sort) and in Triton
(the search for the cut, then the one-read draw), and the sort alone. Prints microseconds
per call (median of the replays). Needs a CUDA GPU.

python -m benchmarks.probe_sampler --rows 1 8 64 256 --output probe.json
"""

from __future__ import annotations

import json
import sys
from unittest import mock

import torch

from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.layers import sampler


def time_call(step) -> float:
    """Microseconds of one `step()`, replayed from a graph where it can be captured."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        call = graph.replay
    except RuntimeError:  # not capturable: time the eager calls, launches included
        call = step
    ms = triton.testing.do_bench(call, rep=200, return_mode="median")
    return ms * 1e3


def time_sample(rows: int, vocab: int, settings: sampler.SamplingTensors, draw=None) -> float:
    """Microseconds of one `draw(logits, settings, counters)` call over [rows, vocab]
    logits (`sample`, the torch form, by default)."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32) * 4
    counters = torch.arange(rows, device="cuda", dtype=torch.int64)
    draw = draw or sampler.sample
    return time_call(lambda: draw(logits, settings, counters))


def time_sort(rows: int, vocab: int) -> float:
    """Microseconds of the descending sort alone that the filters are found on."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32) * 4
    return time_call(lambda: logits.sort(dim=-1, descending=True))


def time_plain(rows: int, vocab: int, plain) -> float:
    """Microseconds of one `plain(logits, temperature, seeds, counters)` call at T=1."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32) * 4
    counters = torch.arange(rows, device="cuda", dtype=torch.int64)
    temperature = torch.ones(rows, device="cuda")
    seeds = torch.full((rows,), 7, dtype=torch.int64, device="cuda")
    return time_call(lambda: plain(logits, temperature, seeds, counters))


def main(argv: list[str] | None = None) -> None:
    parser = CLIParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256], help="row counts")
    parser.add_argument("--vocab", type=int, default=49152, help="Ouro's vocabulary")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    parser.require_cuda()
    from vllm_rlt.ops.triton_ops import TritonOps

    results = []
    print(
        f"{'rows':>5} {'greedy':>9} {'T=1':>9} {'T=1 no sigma':>13} {'T=1 sigma=1':>12}"
        f" {'plain torch':>12} {'plain triton':>13} {'top_p torch':>12} {'top_p triton':>13}"
        f" {'sort':>9}"
    )
    for rows in args.rows:
        greedy = sampler.SamplingTensors.filled(rows, "cuda")
        sampled = sampler.SamplingTensors.filled(rows, "cuda", temperature=1.0, seed=7)
        sigma = sampler.SamplingTensors.filled(
            rows, "cuda", temperature=1.0, seed=7, top_n_sigma=1.0
        )
        row = {"rows": rows, "greedy_us": time_sample(rows, args.vocab, greedy)}
        row["sampled_us"] = time_sample(rows, args.vocab, sampled)
        with mock.patch.object(sampler, "top_n_sigma", lambda scaled, n: scaled):
            row["sampled_without_top_n_sigma_us"] = time_sample(rows, args.vocab, sampled)
        row["top_n_sigma_rows_us"] = time_sample(rows, args.vocab, sigma)
        row["plain_torch_us"] = time_plain(rows, args.vocab, sampler.sample_plain)
        row["plain_triton_us"] = time_plain(rows, args.vocab, TritonOps().sample_plain)
        top_p = sampler.SamplingTensors.filled(rows, "cuda", temperature=1.0, seed=7, top_p=0.7)
        row["top_p_torch_us"] = time_sample(rows, args.vocab, top_p)
        row["top_p_triton_us"] = time_sample(rows, args.vocab, top_p, TritonOps().sample_filtered)
        row["sort_us"] = time_sort(rows, args.vocab)
        results.append(row)
        print(
            f"{rows:>5} {row['greedy_us']:>9.1f} {row['sampled_us']:>9.1f} "
            f"{row['sampled_without_top_n_sigma_us']:>13.1f} {row['top_n_sigma_rows_us']:>12.1f}"
            f" {row['plain_torch_us']:>12.1f} {row['plain_triton_us']:>13.1f}"
            f" {row['top_p_torch_us']:>12.1f} {row['top_p_triton_us']:>13.1f}"
            f" {row['sort_us']:>9.1f}"
        )
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["vocab"] = args.vocab
    report["results"] = results
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=2)
    json.dump(report, sys.stderr)


if __name__ == "__main__":
    main()
