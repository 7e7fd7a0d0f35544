"""Registers, spills and programs per SM of the decode attention kernels, compiled for a GPU
architecture without one (Triton's bundled ptxas, `ptxas -v`): what a launch shape or a
register cap (Triton's maxnreg option) costs in occupancy before any GPU time is spent.
Pointers are taken 16-byte aligned, as Triton specializes them at a real launch. One JSON
line per case.

python -m benchmarks.kernel_registers [--arch 90] [--block-n 64 128] [--warps 2 4] \
    [--maxnreg 0 128 96]
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import tempfile

from vllm_rlt.cli_parser import CLIParser

INDEX_ARGS = {"positions_ptr", "table_rows_ptr", "planes_ptr", "block_table_ptr", "count_ptr"}
INDEX_ARGS |= {"entry_ptr", "lo_ptr", "hi_ptr"}
FLOAT_ARGS = {"k_scale_ptr", "v_scale_ptr", "part_ptr", "cos_ptr", "sin_ptr"}
REGISTERS_PER_SM = 65536


def _signature(fn, constants: dict, kv_type: str) -> dict:
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            types[name] = kv_type
        elif name in FLOAT_ARGS:
            types[name] = "*fp32"
        elif name in INDEX_ARGS:
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types


def compile_report(fn, constants: dict, kv_type: str, warps: int, maxnreg: int, arch: int):
    """(registers, spill bytes) per thread of fn compiled with these constants."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if "_ptr" in n}
    source = ASTSource(
        fn=fn,
        signature=_signature(fn, constants, kv_type),
        constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
        attrs=aligned,
    )
    options = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        cmd = [get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", ptx.name, "-o", "/dev/null"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.findall(r"Used (\d+) registers", log)[-1])
    spills = int(re.findall(r"(\d+) bytes spill stores", log)[-1])
    return registers, spills


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.kernel_registers", description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128], help="keys a tile")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4], help="warps a program")
    parser.add_argument(
        "--maxnreg", type=int, nargs="+", default=[0, 128, 96], help="register caps (0: none)"
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        parser.error("needs Triton, which compiles the kernels (no GPU needed): pip install triton")
    from vllm_rlt.kernels.decode_attention import _paged_attention_kernel, _rope_attend_kernel

    shape = dict(NUM_HEADS=16, NUM_KV_HEADS=16, HEAD_DIM=128, HEAD_P2=128, KV_SCALED=False)
    shape |= dict(STAGES=1)
    kernels = {
        "row": (
            _paged_attention_kernel,
            dict(shape, SPLITS=1, GROUP_TILE=0, PERSISTENT=False, USE_PDL=True),
        ),
        "fused": (
            _rope_attend_kernel,
            dict(shape, PLANES=1, SPLITS=1, GROUP_TILE=0, USE_PDL=True),
        ),
    }
    for name, (fn, constants) in kernels.items():
        for kv_type in ("*bf16", "*fp8e4nv"):
            for block_n in args.block_n:
                for warps in args.warps:
                    for cap in args.maxnreg:
                        registers, spills = compile_report(
                            fn, constants | {"BLOCK_N": block_n}, kv_type, warps, cap, args.arch
                        )
                        threads = 32 * warps
                        per_sm = REGISTERS_PER_SM // (-(-registers // 8) * 8 * threads)
                        record = dict(kernel=name, kv=kv_type[1:], block_n=block_n, warps=warps)
                        record |= dict(maxnreg=cap or None, registers=registers)
                        record |= dict(spill_bytes=spills, programs_per_sm=per_sm)
                        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
