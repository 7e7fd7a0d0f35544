"""Building the CUDA C++ kernels on first use, without a GPU: the compiler is found through
CUDA_HOME or PATH, a cubin is cached under a key of its source, compiler and target and
built once, a failing build says what nvcc said, and a machine without nvcc falls back
to Triton after one log line."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from vllm_rlt.kernels import cuda_build


def test_nvcc_is_found_under_cuda_home_first(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert cuda_build.find_nvcc() == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", "")
    assert cuda_build.find_nvcc() is None


def test_without_a_compiler_one_line_and_no_library(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    cuda_build.cuda_module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cuda_build.__name__):
            assert cuda_build.cuda_module("few_row_gemm") is None
            assert cuda_build.cuda_module("few_row_gemm") is None  # said once
        assert [r.getMessage() for r in caplog.records] == [
            "no CUDA compiler (nvcc) found on PATH or under CUDA_HOME: the few_row_gemm "
            "kernels fall back to Triton"
        ]
    finally:
        cuda_build.cuda_module.cache_clear()


def test_a_driver_that_cannot_load_the_kernels_gives_one_line_and_no_module(
    tmp_path, monkeypatch, caplog
):
    """Built, but not loadable (here: no CUDA driver library, or one that refuses the
    cubin): the Triton kernels serve after one line naming the driver call."""
    from vllm_rlt.kernels import cuda_driver

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "nvcc")
    cubin = tmp_path / "kernels.cubin"
    cubin.write_bytes(b"\x7fELF")
    monkeypatch.setattr(cuda_build, "build", lambda name, nvcc, arch: cubin)

    class Refusing:
        def cuCtxGetCurrent(self, context):
            context._obj.value = 1  # a context is current
            return 0

        def cuModuleLoadData(self, module, image):
            return 200  # CUDA_ERROR_INVALID_IMAGE

        def cuGetErrorName(self, error, name):
            name._obj.value = b"CUDA_ERROR_INVALID_IMAGE"
            return 0

    monkeypatch.setattr(cuda_driver, "_driver", lambda: Refusing())
    cuda_build.cuda_module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cuda_build.__name__):
            assert cuda_build.cuda_module("few_row_gemm") is None
        (line,) = [r.getMessage() for r in caplog.records]
        assert "few_row_gemm kernels failed to build or load, Triton serves" in line
        assert "cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (200)" in line
    finally:
        cuda_build.cuda_module.cache_clear()


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (no GPU)")
def test_a_library_is_built_once_per_source_and_a_failure_names_nvccs_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RLT_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "csrc"
    shutil.copytree(cuda_build.SOURCES, sources)
    monkeypatch.setattr(cuda_build, "SOURCES", sources)
    nvcc = cuda_build.find_nvcc()
    path = cuda_build.build("few_row_gemm", nvcc, "sm_90")
    assert path.parent == tmp_path / "cache" / "cuda"
    image = path.read_bytes()
    assert image[:4] == b"\x7fELF"  # a cubin, with the kernels under their C names
    for kernel in ("w8a16_n8", "w8a16_n16_silu", "w16a16_n8", "w16a16_n16_silu"):
        assert kernel.encode() + b"\0" in image
    built = path.stat().st_mtime_ns
    assert cuda_build.build("few_row_gemm", nvcc, "sm_90") == path
    assert path.stat().st_mtime_ns == built  # cached: not built again
    assert cuda_build.library_path("few_row_gemm", nvcc, "sm_80") != path
    header = sources / "few_row_mma.cuh"  # the device code it includes
    header.write_text(header.read_text() + "// changed\n")
    assert cuda_build.library_path("few_row_gemm", nvcc, "sm_90") != path
    (sources / "few_row_gemm.cu").write_text("this is not C++\n")
    assert cuda_build.library_path("few_row_gemm", nvcc, "sm_90") != path
    with pytest.raises(cuda_build.BuildError, match="nvcc exited with"):
        cuda_build.build("few_row_gemm", nvcc, "sm_90")
    assert not [p for p in os.listdir(path.parent) if p.endswith(".part")]
