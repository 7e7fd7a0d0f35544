"""CUDA C++ kernels (kernels/csrc/*.cu) compiled on first use on a GPU machine.

A source is device code only, with extern "C" kernels. nvcc builds one cubin per source,
device architecture and compiler, cached on disk (VLLM_RLT_CACHE_DIR, default
~/.cache/vllm-rlt), so later processes load it at once; the build shows one progress line
on stderr and takes seconds. The driver API loads the cubin into torch's context and
launches its kernels on torch's stream (cuda_driver.py): no torch headers, and no CUDA
runtime of its own. Where no compiler is found, or a build or load fails, or
VLLM_RLT_CUDA_KERNELS=0, one log line says so and the Triton kernels serve instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from vllm_rlt.config import cache_root
from vllm_rlt.kernels.cuda_driver import CudaDriverError, CudaModule

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
NVCC_FLAGS = ("-O3", "-std=c++17", "-cubin", "-lineinfo")


class BuildError(RuntimeError):
    """nvcc failed; the message holds the end of its output."""


def find_nvcc() -> str | None:
    """CUDA_HOME's (or CUDA_PATH's) nvcc, else the first on PATH."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    return cache_root() / "cuda"


def library_path(name: str, nvcc: str, arch: str) -> Path:
    """Where the cubin of csrc/{name}.cu for `arch` (e.g. "sm_90") lives: keyed by the
    source, the headers beside it, the compiler's version and the flags, so any change
    builds anew."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    headers = [path.read_bytes() for path in sorted(SOURCES.glob("*.cuh"))]
    for part in ((SOURCES / f"{name}.cu").read_bytes(), *headers, version.encode(), arch.encode()):
        digest.update(part)
    digest.update(" ".join(NVCC_FLAGS).encode())
    return cache_dir() / f"{name}-{arch}-{digest.hexdigest()[:16]}.cubin"


def build(name: str, nvcc: str, arch: str) -> Path:
    """The cached cubin, built first if missing (atomically: concurrent processes each
    build to a file of their own and the last rename wins, with equal contents)."""
    path = library_path(name, nvcc, arch)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    command = [nvcc, *NVCC_FLAGS, f"-arch={arch}"]
    command += ["-o", str(partial), str(SOURCES / f"{name}.cu")]
    description = f"building CUDA kernels {name} for {arch}"
    with (
        tempfile.TemporaryFile() as log,
        tqdm(desc=description, bar_format="{desc}: {elapsed}") as bar,
    ):
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(0.1)
            bar.refresh()
        log.seek(0)
        output = log.read().decode(errors="replace")
    if process.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(f"nvcc exited with {process.returncode}: {output.strip()[-2000:]}")
    os.replace(partial, path)
    return path


@functools.cache
def cuda_module(
    name: str, device: int = 0, min_capability: tuple[int, int] = (0, 0)
) -> CudaModule | None:
    """csrc/{name}.cu built for CUDA device `device` and loaded there, or None where it
    cannot be (after one log line saying why, unless the GPU is older than the source's
    `min_capability`): the caller's Triton kernels serve then."""
    import torch

    if os.environ.get("VLLM_RLT_CUDA_KERNELS") == "0" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < min_capability:
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        logger.warning(
            "no CUDA compiler (nvcc) found on PATH or under CUDA_HOME: the %s kernels fall "
            "back to Triton",
            name,
        )
        return None
    try:
        return CudaModule(build(name, nvcc, f"sm_{major}{minor}").read_bytes(), device)
    except (OSError, BuildError, CudaDriverError) as exc:
        logger.warning("the %s kernels failed to build or load, Triton serves: %s", name, exc)
        return None
