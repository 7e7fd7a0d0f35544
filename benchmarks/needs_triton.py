"""Imported first by the kernel tools built on Triton: without it they stop with one line
that says how to get it, not with a traceback."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("triton") is None:
    tool = Path(sys.argv[0]).stem
    sys.exit(
        f"python -m benchmarks.{tool}: error: needs Triton, which a CUDA build of torch "
        "brings (or: pip install triton)"
    )
