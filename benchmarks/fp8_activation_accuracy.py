"""`vllm-rlt bench accuracy` on the CPU with every fp8 projection's input rounded to float8
per token, as the FP8 tensor cores compute in GPU passes of more than 16 rows: the worst
case of a GPU run, one whose every pass is that large (the CPU's reference ops keep the
activations in their dtype). Takes bench accuracy's flags.

python -m benchmarks.fp8_activation_accuracy --per-task 200 --dtype bfloat16 --quantization fp8
"""

from __future__ import annotations

from unittest import mock

from benchmarks.fp8_quality import per_token_fp8_product
from vllm_rlt.bench.accuracy import main as accuracy_main


def main(argv: list[str] | None = None) -> int:
    with mock.patch("vllm_rlt.ops.torch_ops.fp8_linear_reference", per_token_fp8_product):
        return accuracy_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
