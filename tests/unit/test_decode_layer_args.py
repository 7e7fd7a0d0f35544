"""The ctypes LayerArgs of kernels/decode_layer.py against the struct the CUDA source
declares: every field at the same offset, the same size (a mismatch would hand the kernel
wrong pointers)."""

from __future__ import annotations

import subprocess

import pytest

from vllm_rlt.kernels import cuda_build
from vllm_rlt.kernels.decode_layer import LayerArgs


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (no GPU)")
def test_the_argument_struct_matches_the_kernels(tmp_path):
    names = [name for name, _ in LayerArgs._fields_]
    prints = "".join(f'  printf("%zu\\n", offsetof(LayerArgs, {name}));\n' for name in names)
    program = tmp_path / "layout.cu"
    program.write_text(
        f'#include "{cuda_build.SOURCES / "decode_layer.cu"}"\n#include <cstddef>\n'
        f"#include <cstdio>\nint main() {{\n{prints}"
        '  printf("%zu\\n", sizeof(LayerArgs));\n}\n'
    )
    binary = tmp_path / "layout"
    subprocess.run(
        [cuda_build.find_nvcc(), "-std=c++17", "-arch=sm_90", "-o", str(binary), str(program)],
        check=True,
        capture_output=True,
    )
    printed = [int(line) for line in subprocess.check_output([str(binary)]).split()]
    import ctypes

    want = [getattr(LayerArgs, name).offset for name in names] + [ctypes.sizeof(LayerArgs)]
    assert printed == want


def test_the_staged_x_fits_ouro_and_its_limit_is_the_cards():
    """The launch's dynamic shared memory: 8 or 16 rows of the widest product's x and a
    16-byte word of padding each. Ouro-1.4B (hidden 2,048, inter 5,632) fits at 16 rows; a
    layer twice as wide in its MLP does not, and the layer is refused for it."""
    from vllm_rlt.kernels.decode_layer import STAGED_X_LIMIT, staged_x_bytes

    assert staged_x_bytes(1, 2048, 5632) == staged_x_bytes(8, 2048, 5632) == 8 * (11264 + 16)
    assert staged_x_bytes(9, 2048, 5632) == 16 * (11264 + 16) <= STAGED_X_LIMIT
    assert staged_x_bytes(16, 2048, 11264) > STAGED_X_LIMIT
    assert STAGED_X_LIMIT + 40 * 1024 == 227 * 1024  # an H100's or H200's opt-in block limit
