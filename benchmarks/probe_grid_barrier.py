"""Is a persistent layer kernel worth building? Time a chain of dependent one-row GEMVs
(y_s = W_s y_(s-1), each W_s 2048 x 2048 bf16, a distinct 8 MB matrix per step so that
the weights stream from HBM as a decode pass's do) three ways:

- "launches": a kernel per step, back to back with programmatic dependent launch, in one
  CUDA graph (how a pass runs today);
- "persistent": one kernel for every step, its programs (one per 16 output rows, all
  resident) meeting at a grid barrier (a counter in device memory) between steps;
- "persistent+prefetch": the same, each program loading its first K chunk of the next
  step's weights before it waits at the barrier, so the weight stream overlaps the wait;
- "+half strip" and "+whole strip" (launches and persistent): each program loads half or
  all of its 16 x 2,048 strip of the step's weights (32 or 64 KB, in registers of 8
  warps) before it waits, on the predecessor kernel or at the barrier, so the step's HBM
  time can hide the wait (a whole strip takes 152 registers a thread: one program an SM,
  so under PDL it cannot load beside its predecessor);

and the barrier alone (steps with no work). Prints one JSON line per case: microseconds
per step, against the HBM time of one step's weights.

python -m benchmarks.probe_grid_barrier [--steps 24]
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from benchmarks.graph_timing import graph_time_us
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.kernels.pdl import launch_options, pdl_enter

N = K = 2048
BLOCK_N, BLOCK_K = 16, 256


@triton.jit
def _gemv_slice(
    w_ptr,
    x_ptr,
    out_ptr,
    n0,
    first_w,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FIRST: tl.constexpr,
):
    """out[n0 : n0 + BLOCK_N] = W[n0 : n0 + BLOCK_N] @ x, with the first FIRST columns of
    W's strip already loaded (first_w: BLOCK_K, or K for the whole strip)."""
    rows = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_first = tl.load(x_ptr + tl.arange(0, FIRST), cache_modifier=".cg").to(tl.float32)
    acc = tl.sum(first_w.to(tl.float32) * x_first[None, :], axis=1)
    for k0 in tl.range(FIRST, K, BLOCK_K, num_stages=3):
        w = tl.load(w_ptr + rows[:, None] * K + (k0 + ks)[None, :])
        x = tl.load(x_ptr + k0 + ks, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _first_chunk(w_ptr, n0, K: tl.constexpr, BLOCK_N: tl.constexpr, FIRST: tl.constexpr):
    rows = n0 + tl.arange(0, BLOCK_N)
    return tl.load(w_ptr + rows[:, None] * K + tl.arange(0, FIRST)[None, :])


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Wait until `target` arrivals have been counted: this program's stores are released
    by its arrival, and every program's are acquired before it goes on."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _step_kernel(
    w_ptr,
    x_ptr,
    out_ptr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One step; PRELOAD > 0: the strip's first PRELOAD columns load before the wait on the
    predecessor."""
    n0 = tl.program_id(0) * BLOCK_N
    if PRELOAD:
        first = _first_chunk(w_ptr, n0, K, BLOCK_N, PRELOAD)
        pdl_enter(USE_PDL)
        _gemv_slice(w_ptr, x_ptr, out_ptr, n0, first, K, BLOCK_N, BLOCK_K, PRELOAD)
    else:
        pdl_enter(USE_PDL)
        first = _first_chunk(w_ptr, n0, K, BLOCK_N, BLOCK_K)
        _gemv_slice(w_ptr, x_ptr, out_ptr, n0, first, K, BLOCK_N, BLOCK_K, BLOCK_K)


@triton.jit
def _chain_kernel(
    w_ptr,
    y_ptr,
    counter_ptr,
    steps,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WORK: tl.constexpr,
    PREFETCH: tl.constexpr,
    FIRST: tl.constexpr,
):
    """y[s + 1] = W[s] @ y[s] for s < steps, a grid barrier after each step. PREFETCH: the
    first FIRST columns of the next step's strip load before the barrier."""
    programs = tl.num_programs(0)
    n0 = tl.program_id(0) * BLOCK_N
    first = _first_chunk(w_ptr, n0, K, BLOCK_N, FIRST)
    for s in range(steps):
        if WORK:
            w_s = w_ptr + s * N * K
            if not PREFETCH:
                first = _first_chunk(w_s, n0, K, BLOCK_N, FIRST)
            y_s = y_ptr + s * K
            _gemv_slice(w_s, y_s, y_s + K, n0, first, K, BLOCK_N, BLOCK_K, FIRST)
            if PREFETCH:  # the next step's weights stream while this program waits
                first = _first_chunk(w_s + N * K, n0, K, BLOCK_N, FIRST)
        _grid_barrier(counter_ptr, (s + 1) * programs)


def _check_chain(y: torch.Tensor, want: torch.Tensor) -> None:
    """Unordered steps would read half-written vectors: far off, not rounding. Summing a
    strip in another order moves single bf16 outputs by an ulp, which 24 dependent steps
    carry on, so the check is on each step's relative error, not per element."""
    error = (y.float() - want.float()).norm(dim=1) / want.float().norm(dim=1)
    if error.max() > 2e-2:
        raise AssertionError(f"chain outputs differ by up to {error.max():.3g} (relative)")


def _case(name: str, us: float, steps_bytes: int) -> None:
    bound = steps_bytes / 4.27e12 * 1e6  # H200 HBM3e, about 4.27 TB/s measured
    print(json.dumps({"case": name, "us_per_step": round(us, 2), "hbm_us": round(bound, 2)}))


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.probe_grid_barrier", description=__doc__)
    parser.add_argument("--steps", type=int, default=24, help="dependent GEMVs per chain")
    args = parser.parse_args()
    parser.require_cuda()
    steps = args.steps
    programs = N // BLOCK_N
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if programs > sms:
        raise SystemExit(f"{programs} programs would not all be resident on {sms} SMs")
    # one extra matrix: the prefetching variant reads the first chunk past the last step
    w = torch.randn(steps + 1, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    y = torch.zeros(steps + 1, K, device="cuda", dtype=torch.bfloat16)
    y[0] = torch.randn(K, device="cuda")
    step_bytes = N * K * 2

    want = y
    for preload, name in (
        (0, "launches"),
        (K // 2, "launches+half strip"),
        (K, "launches+whole strip"),
    ):

        def launches(_: int, preload=preload) -> None:
            for s in range(steps):
                _step_kernel[(programs,)](
                    w[s],
                    y[s],
                    y[s + 1],
                    K=K,
                    BLOCK_N=BLOCK_N,
                    BLOCK_K=BLOCK_K,
                    PRELOAD=preload,
                    num_warps=8 if preload else 4,
                    **launch_options(True),
                )

        _case(name, graph_time_us(launches, 1) / steps, step_bytes)
        if preload:  # against the plain launches' outputs
            _check_chain(y, want)
        else:
            want = y.clone()
    for work, prefetch, first, name in (
        (True, False, BLOCK_K, "persistent"),
        (True, True, BLOCK_K, "persistent+prefetch"),
        (True, True, K // 2, "persistent+half strip"),
        (True, True, K, "persistent+whole strip"),
        (False, False, BLOCK_K, "barrier only"),
    ):
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")

        def chain(_: int, work=work, prefetch=prefetch, first=first, counter=counter) -> None:
            counter.zero_()
            _chain_kernel[(programs,)](
                w,
                y,
                counter,
                steps,
                N=N,
                K=K,
                BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K,
                WORK=work,
                PREFETCH=prefetch,
                FIRST=first,
                num_warps=8 if first > BLOCK_K else 4,
            )

        _case(name, graph_time_us(chain, 1) / steps, step_bytes if work else 0)
        if work:
            _check_chain(y, want)


if __name__ == "__main__":
    main()
