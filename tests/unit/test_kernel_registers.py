"""benchmarks/kernel_registers.py: a register cap is obeyed and raises occupancy, compiled
for sm_90 without a GPU (skipped where Triton or its ptxas is missing)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")


def test_a_register_cap_raises_programs_per_sm(capsys):
    from benchmarks.kernel_registers import main

    try:
        main(["--block-n", "128", "--warps", "2", "--maxnreg", "0", "96"])
    except (FileNotFoundError, RuntimeError) as error:  # no bundled ptxas here
        pytest.skip(f"cannot compile for sm_90 here: {error}")
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["kernel"], r["kv"]) for r in records} == {
        (kernel, kv) for kernel in ("row", "fused") for kv in ("bf16", "fp8e4nv")
    }
    for free, capped in zip(records[::2], records[1::2], strict=True):
        assert free["maxnreg"] is None and capped["maxnreg"] == 96
        assert capped["registers"] <= 96 < free["registers"]
        assert capped["programs_per_sm"] > free["programs_per_sm"]
