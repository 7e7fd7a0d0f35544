"""Split a decode step into device time (graph replay) and host time, and list the kernels;
with --rows, the host time of launching one pass against its device time, for decode-only
passes and for passes that also carry a prompt chunk, at each row count; with --budget,
each decoder layer's ops against their bytes and FLOPs bounds at each row count.

python -m benchmarks.profile_pass --shape ouro-1.4b --concurrency 1 64
python -m benchmarks.profile_pass --concurrency 1 8 --speculative-tokens 1 --draft-loops 2 \
    --spec-acceptance-rate 0.8
python -m benchmarks.profile_pass --concurrency --rows 1 8 64 256 512 [--kernels]
python -m benchmarks.profile_pass --concurrency 1 8 --quantization fp8 --kv-cache-dtype fp8
python -m benchmarks.profile_pass --concurrency 32 --prompt-len 1024 --steps 30
python -m benchmarks.profile_pass --budget [--rows 1 8 64 256 512] [--quantization fp8]
python -m benchmarks.profile_pass --budget --bounds-only   # no GPU needed
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from vllm_rlt.bench.budget_report import (
    Measured,
    attribute,
    budget_record,
    marginal_us,
    print_budget,
)
from vllm_rlt.bench.device_figures import copy_bandwidth
from vllm_rlt.bench.layer_budget import Device, LayerShape
from vllm_rlt.bench.shapes import SHAPES, random_model
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.core.contract import PrefillChunk, SchedulerOutput
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine_config import DeviceConfig, EngineConfig
from vllm_rlt.entrypoints.args import add_speculation_args, speculative_config
from vllm_rlt.layers.sampler import SamplingMode
from vllm_rlt.models.registry import resolve_family
from vllm_rlt.sampling_params import SamplingParams


def _engine(
    model, seqs: int, blocks: int, spec: SpeculativeConfig | None, kv_dtype: str, prompt_len: int
):
    """An engine core for `seqs` requests of `prompt_len`-token prompts whose prompts all fit
    in one pass, with `blocks` KV blocks (plus a few spare) of K/V stored as `kv_dtype`."""
    return build_engine_core(
        model,
        None,
        EngineConfig(
            cache_config=CacheConfig(num_blocks=blocks + 8, kv_cache_dtype=kv_dtype),
            scheduler_config=SchedulerConfig(
                max_num_seqs=seqs,
                max_num_batched_tokens=max(2048, prompt_len * seqs),
                max_prefill_batches_before_decode=seqs,
            ),
            speculative_config=spec,
            device_config=DeviceConfig(attention_backend="auto"),
        ),
    )


def profile(
    model,
    concurrency: int,
    steps: int,
    spec: SpeculativeConfig | None,
    kv_dtype: str,
    prompt_len: int = 64,
    sources: bool = False,
) -> None:
    # the prompt plus at most one token per step (16 warm-up steps and the timed ones), in
    # blocks of 16: large concurrencies fit beside the weights
    blocks = concurrency * (-(-(prompt_len + 16 + steps) // 16) + 1)
    engine = _engine(model, concurrency, blocks, spec, kv_dtype, prompt_len)
    params = SamplingParams(
        max_tokens=16 + steps, temperature=0.0, ignore_eos=True, exit_threshold=1.0
    )
    for i in range(concurrency):
        engine.add_request(str(i), [3 + (i + j) % 64 for j in range(prompt_len)], params)
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
    # the graph the steps above replayed: greedy rows, no logprobs, no logit adjustments
    graph, _ = graphs.graphs[(size, SamplingMode.GREEDY, False, False, spec is not None)]
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
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60)
    )
    if sources:
        with (
            engine.runner.eager_passes(),
            torch.profiler.profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                with_stack=True,
                # some torch builds fill an op's stack only in verbose mode
                experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True),
            ) as prof,
        ):
            for _ in range(SOURCE_STEPS):
                engine.step()
            torch.cuda.synchronize()
        print_sources(device_time_by_source(prof.events()), SOURCE_STEPS)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)


SOURCE_STEPS = 3  # eager steps profiled for --sources


def device_time_by_source(events) -> dict[str, tuple[float, int]]:
    """Microseconds of device time and kernel launches per package source line: each
    kernel goes to the innermost frame inside vllm_rlt of the event that launched it or of
    its nearest parent (its recorded stack, or a Python-function event's own name), else to
    the launching event's name. Where no parent links an event to a Python-function event
    (as in some torch builds with CUDA activity), the innermost package Python-function
    event whose time span holds it on its thread stands in."""
    events = list(events)
    enclosing = _EnclosingFrames(events)
    spent: dict[str, tuple[float, int]] = {}
    for event in events:
        kernels = getattr(event, "kernels", None) or []
        if not kernels:
            continue
        site, parent = None, event
        while site is None and parent is not None:  # Python frames are events too
            frames = [*(parent.stack or []), parent.name]
            site = next((frame for frame in frames if "vllm_rlt" in frame), None)
            parent = parent.cpu_parent
        site = site or enclosing.around(event) or f"({event.name})"
        total, launches = spent.get(site, (0.0, 0))
        spent[site] = (total + sum(k.duration for k in kernels), launches + len(kernels))
    return spent


class _EnclosingFrames:
    """The package's Python-function events per thread, by start time."""

    def __init__(self, events) -> None:
        self.frames: dict[int, list] = {}
        for event in events:
            timed = getattr(event, "time_range", None) is not None
            if timed and "vllm_rlt" in event.name and ".py(" in event.name:
                self.frames.setdefault(event.thread, []).append(event)
        for frames in self.frames.values():
            # an outer frame before the inner ones that start with it
            frames.sort(key=lambda frame: (frame.time_range.start, -frame.time_range.end))
        self.starts = {
            thread: [frame.time_range.start for frame in frames]
            for thread, frames in self.frames.items()
        }

    def around(self, event) -> str | None:
        """The name of the latest-starting frame whose span holds `event`'s."""
        thread, span = getattr(event, "thread", None), getattr(event, "time_range", None)
        if thread not in self.frames or span is None:
            return None
        frames = self.frames[thread]
        for index in range(bisect.bisect_right(self.starts[thread], span.start) - 1, -1, -1):
            if frames[index].time_range.end >= span.end:
                return frames[index].name
        return None


def print_sources(spent: dict[str, tuple[float, int]], steps: int) -> None:
    """The 30 source lines whose torch ops cost the most device time per step."""
    print(f"device time per eager step by package source line ({steps} steps):")
    if not any("vllm_rlt" in site for site in spent):
        print("(the profiler recorded no package Python frames: op names stand in)")
    ranked = sorted(spent.items(), key=lambda item: -item[1][0])
    for site, (us, launches) in ranked[:30]:
        print(f"{us / steps:10.1f} us {launches / steps:6.1f} launches  {site}")


def _timed_launch(runner, out: SchedulerOutput, repeats: int) -> tuple[float, float]:
    """(host ms, device ms) per pass: the host's time to launch it (build and enqueue; the
    device runs behind), and the device's time from the first launch's start to the last
    one's end over `repeats` passes launched back to back."""
    for _ in range(3):  # warm up: captures of lazily captured variants, allocator
        runner.collect(runner.launch(out))
    torch.cuda.synchronize()
    host = 0.0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    pending = []
    for _ in range(repeats):
        start = time.perf_counter()
        pending.append(runner.launch(out))
        host += time.perf_counter() - start
        if len(pending) == 2:  # as the engine runs: one pass in flight while one launches
            runner.collect(pending.pop(0))
    end.record()
    for item in pending:
        runner.collect(item)
    end.synchronize()
    return host / repeats * 1e3, begin.elapsed_time(end) / repeats


def _profiled(runner, out: SchedulerOutput, passes: int):
    """The CUDA profile of `passes` passes launched one after the other."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            runner.collect(runner.launch(out))
        torch.cuda.synchronize()
    return prof


def _kernel_times(runner, out: SchedulerOutput, passes: int = 5) -> dict[str, float]:
    """Device microseconds per pass of each kernel a pass runs (inside its graphs too), the
    largest first, and their sum under "total"."""
    prof = _profiled(runner, out, passes)
    times = {
        event.key: event.device_time_total / passes
        for event in prof.key_averages()
        if event.device_time_total > 0
    }
    ranked = sorted(times.items(), key=lambda item: -item[1])
    return {"total": round(sum(times.values()), 1)} | {k: round(v, 1) for k, v in ranked}


def _decoding_engine(model, seqs: int, kv_dtype: str, prompt_len: int):
    """An engine whose `seqs` requests of `prompt_len`-token prompts all decode, their slots,
    and the positions a request's blocks hold (the prompt's and 64 more)."""
    per_request = -(-(prompt_len + 64) // 16)
    engine = _engine(model, seqs, seqs * per_request, None, kv_dtype, prompt_len)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    for i in range(seqs):
        engine.add_request(str(i), [3 + j % 64 for j in range(prompt_len)], params)
    while engine.scheduler.waiting or any(
        r.status.value != "decode" for r in engine.scheduler.running.values()
    ):
        engine.step()
    return engine, sorted(engine.scheduler.running), per_request * 16


def pass_rows(model, rows: list[int], repeats: int, kernels: bool, kv_dtype: str) -> None:
    """Host launch time against device time per pass, decode-only and mixed (half the rows a
    prompt chunk at loop 0 on the runner's padding slot, which reads and writes only the
    padding block), with the captured prompt-pass graphs and without them (eager); with
    `kernels`, each graphed pass's device time per kernel."""
    engine, slots, max_context = _decoding_engine(model, max(rows), kv_dtype, 64)
    runner = engine.runner
    for count in rows:
        prompt = count // 2
        decode = tuple(slots[: count - prompt])
        chunk = PrefillChunk(runner.dummy_slot, "", 0, (3,) * prompt, 0, samples=False)
        for kind, chunks in (("decode", ()), ("mixed", (chunk,) if prompt else ())):
            if kind == "mixed" and not prompt:
                continue
            out = SchedulerOutput((), decode, ("",) * len(decode), chunks, max_context)
            for label in ("graphs", "eager"):
                if kind == "decode" and label == "eager":
                    continue
                graphs = runner.eager_passes() if label == "eager" else contextlib.nullcontext()
                with graphs:
                    host_ms, device_ms = _timed_launch(runner, out, repeats)
                record = {
                    "rows": count,
                    "pass": kind,
                    "prompt_rows": prompt if chunks else 0,
                    "path": label,
                    "host_ms": round(host_ms, 3),
                    "device_ms": round(device_ms, 3),
                }
                if kernels and label == "graphs":
                    record["kernels_us"] = _kernel_times(runner, out)
                print(json.dumps(record))
    for request_id in list(engine.groups):
        engine.abort_request(request_id)


# The budget times so many passes per row count and then profiles so many: few, so that the
# rows' contexts grow by a few positions only (a pass takes a row one loop further).
BUDGET_TIMED, BUDGET_PROFILED = 10, 5
BUDGET_ROWS = [1, 8, 64, 256, 512]


def measure_budget(
    shape: str, rows: list[int], weights: str, kv_dtype: str, prompt_len: int
) -> dict[int, Measured]:
    """Per row count, decode passes of that many rows on the GPU, of a new model of the
    shape: what budget_record compares the bounds with."""
    model = random_model(shape, torch.bfloat16, torch.device("cuda"))
    model.quantize("fp8" if weights == "fp8" else None)
    engine, slots, max_context = _decoding_engine(model, max(rows), kv_dtype, prompt_len)
    runner = engine.runner
    measured = {}
    for count in rows:
        decode = tuple(slots[:count])
        out = SchedulerOutput((), decode, ("",) * count, (), max_context)
        host_ms, device_ms = _timed_launch(runner, out, BUDGET_TIMED)
        context = round(runner.state.position[list(decode)].float().mean().item() + 1)
        prof = _profiled(runner, out, BUDGET_PROFILED)
        kernels = [
            (event.name, event.time_range.start, event.time_range.end)
            for event in prof.events()
            if event.device_type == DeviceType.CUDA
        ]
        spent = attribute(marginal_us(kernels), len(model.layers))
        measured[count] = Measured(context, host_ms, device_ms, spent)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
    return measured


def budget(args) -> None:
    """Each weight dtype's and row count's layer budget (see --budget)."""
    bandwidth = args.bandwidth
    if bandwidth is None:  # this card's, as bench throughput's roofline takes it
        bandwidth = Device.bandwidth if args.bounds_only else copy_bandwidth(torch.device("cuda"))
    device = Device(bandwidth, args.bf16_flops, args.fp8_flops or 2 * args.bf16_flops)
    raw = SHAPES[args.shape]()
    shape = LayerShape.from_config(raw, resolve_family(raw)[1].branch_norms)
    rows = args.rows or BUDGET_ROWS
    print(
        f"bounds at HBM {device.bandwidth:.3g} B/s, bf16 tensor cores {device.bf16_flops:.3g} "
        f"FLOP/s, fp8 {device.fp8_flops:.3g} FLOP/s (--bandwidth, --bf16-flops, --fp8-flops)"
    )
    kv_dtype, context = args.kv_cache_dtype, args.prompt_len
    for weights in ["fp8"] if args.quantization else ["bf16", "fp8"]:
        measured: dict[int, Measured] = {}
        if not args.bounds_only:
            measured = measure_budget(args.shape, rows, weights, kv_dtype, context)
            gc.collect()  # the engine's graphs and K/V, before the next one's
            torch.cuda.empty_cache()
        for count in rows:
            record = budget_record(
                args.shape, shape, count, weights, kv_dtype, context, device, measured.get(count)
            )
            print_budget(record)


def main(argv: list[str] | None = None) -> None:
    parser = CLIParser(prog="python -m benchmarks.profile_pass", description=__doc__)
    parser.add_argument(
        "--shape", choices=list(SHAPES), default="ouro-1.4b", help="model shape (random weights)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[1, 64],
        help="rows per decode pass; given with no value, no decode case runs (for --rows alone)",
    )
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per case")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="*",
        default=[],
        help="row counts of single passes to time (host launch against device), decode-only "
        "and mixed; none: skip (--budget: 1 8 64 256 512)",
    )
    parser.add_argument(
        "--sources",
        action="store_true",
        help="with --concurrency: also profile eager decode steps and rank the package's "
        "source lines by the device time of the kernels they launch (the glue shows there)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="with --rows: also list each graphed pass's device time per kernel",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="weights (default: bf16; --budget: bf16 and fp8)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="K/V storage"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=64,
        help="prompt tokens per request (decode profiles, --budget: the positions a row attends)",
    )
    parser.add_argument(
        "--budget",
        action="store_true",
        help="instead of the profiles: at each of --rows, for bf16 and fp8 weights (fp8 alone "
        "with --quantization fp8), each op of a decoder layer against its bounds (its HBM "
        "bytes over --bandwidth, its FLOPs over the tensor cores' rate) and the time a decode "
        "pass's kernels spend on it, per layer",
    )
    parser.add_argument(
        "--bounds-only",
        action="store_true",
        help="--budget without profiling: the bounds alone, which need no GPU",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help=(
            "--budget: HBM bytes/s (default: the GPU's copy bandwidth, measured; with "
            f"--bounds-only {Device.bandwidth:.3g}, an H200's)"
        ),
    )
    parser.add_argument(
        "--bf16-flops",
        type=float,
        default=Device.bf16_flops,
        help="--budget: dense bf16 tensor-core FLOP/s (default: %(default).3g, an H200's)",
    )
    parser.add_argument(
        "--fp8-flops",
        type=float,
        default=None,
        help="--budget: dense FP8 tensor-core FLOP/s (default: twice --bf16-flops)",
    )
    add_speculation_args(parser, replay=True)
    args = parser.parse_args(argv)
    args.budget |= args.bounds_only
    if not (args.bounds_only or torch.cuda.is_available()):
        hint = " (--bounds-only prints the bounds alone)" if args.budget else ""
        parser.error(f"it profiles the CUDA path, and no CUDA device is available here{hint}")
    if args.budget:
        family = resolve_family(SHAPES[args.shape]())[1]
        if not hasattr(family, "branch_norms"):
            parser.error(
                f"--budget models Ouro- and Nanbeige-style layers, not {args.shape}'s; its "
                "kernel table comes without --budget (--concurrency)"
            )
        budget(args)
        return
    model = random_model(args.shape, torch.bfloat16, torch.device("cuda"))
    if args.quantization is not None:
        model.quantize(args.quantization)
    for concurrency in args.concurrency:
        spec = speculative_config(args)
        profile(
            model, concurrency, args.steps, spec, args.kv_cache_dtype, args.prompt_len, args.sources
        )
        gc.collect()  # the engine's graphs and K/V, before the next concurrency's engine
        torch.cuda.empty_cache()
    if args.rows:
        pass_rows(model, args.rows, args.steps, args.kernels, args.kv_cache_dtype)


if __name__ == "__main__":
    main()
