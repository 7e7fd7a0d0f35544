"""Loading cubins and launching their kernels through the CUDA driver API (libcuda).

The kernels of kernels/csrc/ are built as cubins and loaded into the context torch already
uses, as Triton does its own: no second CUDA runtime lives in the process, so no runtime
state (registered kernels, stream handles) can disagree with torch's. A launch goes on
torch's current stream and may be captured into a CUDA graph.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaDriverError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an enum id padded to 8 bytes, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(function: str, *args) -> None:
    """libcuda's `function` on `args`, raising CudaDriverError unless it returns success."""
    result = getattr(_driver(), function)(*args)
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise CudaDriverError(f"{function} failed: {(name.value or b'?').decode()} ({result})")


def _bind_context(device: int) -> None:
    """Make the device's primary context (torch's) current on this thread if none is."""
    context = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(context))
    if context.value:
        return
    handle = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(handle), device)
    _call("cuDevicePrimaryCtxRetain", ctypes.byref(context), handle)
    _call("cuCtxSetCurrent", context)


class CudaModule:
    """A cubin loaded into a device's primary context; kernels by their extern "C" name."""

    def __init__(self, image: bytes, device: int) -> None:
        _bind_context(device)
        self._image = image  # the driver may read it until the module is unloaded
        self._handle = ctypes.c_void_p()
        _call("cuModuleLoadData", ctypes.byref(self._handle), image)
        self._kernels: dict[str, CudaKernel] = {}

    def kernel(self, name: str) -> CudaKernel:
        if name not in self._kernels:
            function = ctypes.c_void_p()
            _call("cuModuleGetFunction", ctypes.byref(function), self._handle, name.encode())
            self._kernels[name] = CudaKernel(function)
        return self._kernels[name]


class CudaKernel:
    """One kernel of a loaded module, launched with ctypes-typed arguments."""

    def __init__(self, function: ctypes.c_void_p) -> None:
        self._function = function
        threads = ctypes.c_int()
        limit = _FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        _call("cuFuncGetAttribute", ctypes.byref(threads), limit, function)
        self.max_threads = threads.value  # the kernel's __launch_bounds__, if it has one
        self._shared_allowed = 0  # the dynamic shared memory the kernel has opted in to
        self._pdl = _LaunchAttribute(id=_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._pdl.value[0] = 1

    def launch(
        self,
        grid: int | tuple[int, int, int],
        threads: int,
        stream: int,  # torch.cuda.Stream.cuda_stream
        args: Sequence[ctypes.c_void_p | ctypes.c_int | ctypes.c_float],  # each parameter
        pdl: bool = False,  # a programmatic dependent launch (see kernels/pdl.py)
        shared_bytes: int = 0,  # dynamic shared memory a block
    ) -> None:
        if shared_bytes > self._shared_allowed:  # static + dynamic above 48 KB needs it
            limit = _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _call("cuFuncSetAttribute", self._function, limit, shared_bytes)
            self._shared_allowed = shared_bytes
        grid = (grid, 1, 1) if isinstance(grid, int) else grid
        config = _LaunchConfig(grid=grid, block=(threads, 1, 1), shared_bytes=shared_bytes)
        config.stream = stream
        if pdl:
            config.attrs = ctypes.pointer(self._pdl)
            config.num_attrs = 1
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        _call("cuLaunchKernelEx", ctypes.byref(config), self._function, pointers, None)
