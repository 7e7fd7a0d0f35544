"""Write a checkpoint folder of a benchmark shape with seeded random weights.

    python -m benchmarks.random_checkpoint ouro-1.4b /tmp/ouro-1.4b-random --device cuda

`vllm-rlt bench serve --launch FOLDER` and `vllm-rlt serve FOLDER` then load the same
weights that `vllm-rlt bench throughput --shape ouro-1.4b` makes in memory.
"""

from __future__ import annotations

import sys

from vllm_rlt.bench.shapes import SHAPES
from vllm_rlt.cli_parser import CLIParser


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.random_checkpoint", description=__doc__)
    parser.add_argument("shape", choices=list(SHAPES), help="model shape")
    parser.add_argument("folder", help="where to write config.json and model.safetensors")
    parser.add_argument("--device", default="cpu", help="where to draw the weights")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    from vllm_rlt.bench.shapes import save_random_checkpoint
    from vllm_rlt.models.load import resolve_dtype

    device = parser.device(args.device)
    save_random_checkpoint(args.shape, args.folder, resolve_dtype(args.dtype, device), device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
