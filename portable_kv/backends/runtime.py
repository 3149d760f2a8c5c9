"""A vendor's device runtime, the part CUDA and ROCm share: the one error type, the
one error helper, and the ctypes calls whose only difference is a name prefix.

A DeviceRuntime is the GPU's copy engine (io/engine.py) and more: it compiles,
loads and launches the copy kernel and binds threads to the device.  cuda.py and
rocm.py each subclass it with the same methods in the same order (compile and
load through the vendor's binding, launch, the batched memcpy's signature,
bind_thread).  The per-call hot paths stay ctypes: a launch from Python costs
less that way than through the vendors' wrappers, and the batched memcpy takes
numpy's pointer arrays, which the Python bindings convert element by element
(hip-python cannot take a sizes array at all); docs/DESIGN.md has the numbers.
"""

from __future__ import annotations

import ctypes
import threading
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import config
from ..io.copier import Copier, CopyBatch
from ..io.direct import DirectMover
from ..io.mover import Mover
from ..io.streams import DeviceStreams, Streams
from .jit import KernelSpec

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault = hipMemcpyDefault: direction from the addresses
REGISTER_FLAGS = 3  # Portable | Mapped, the same bits for cudaHostRegister and hipHostRegister
EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming = hipEventDisableTiming
NOT_READY = 600  # cudaErrorNotReady = hipErrorNotReady: an event's work has not completed


class DeviceError(RuntimeError):
    """A driver or runtime call failed: `call` is the function, `code` its return code,
    `name` the vendor's name for it (cudaErrorInvalidValue, hipErrorNotSupported, ...)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


def check(result: Any, call: str, error_name: Callable[[int], str] | None = None) -> Any:
    """Unwrap a binding's (error, *values) tuple, or a bare return code; DeviceError on failure.

    The bindings' error enums carry their name; a bare ctypes code is named by
    `error_name` (the runtime's GetErrorName)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        name = error_name(code) if error_name is not None else getattr(err, "name", str(code))
        raise DeviceError(call, code, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class DeviceRuntime(Copier):
    """One GPU's runtime: code objects, launches, copies, events, host registration."""

    prefix: str  # "cuda" | "hip": the runtime library's symbol prefix
    code_suffix: str  # "cubin" | "hsaco"
    kernel_source: Path  # the vendor's kv_copy source
    batch_min_version: int  # first runtime version with <prefix>MemcpyBatchAsync
    bulk_threads: int  # threads of a bulk-kernel block (kv_bulk.h)
    bulk_blocks: int  # blocks of a bulk-kernel launch
    max_batch: int | None = None  # descriptors per batched memcpy call

    def __init__(self, lib: Any, device_index: int) -> None:
        self.lib = lib
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)  # torch.cuda serves ROCm too
        version = ctypes.c_int()
        self._fn("RuntimeGetVersion")(ctypes.byref(version))
        self.version: int = version.value
        self.has_batch: bool = self.version >= self.batch_min_version and hasattr(lib, f"{self.prefix}MemcpyBatchAsync")
        self.fail_index = ctypes.c_size_t(0)
        # Each stream can drive a copy engine of its own (docs/PERFORMANCE.md: direct io over streams).
        self.dma_streams: int = config.DMA_STREAMS.integer(minimum=1) or 1
        self._bound = threading.local()
        self._bindings: tuple[Any, Any] | None = None  # the vendor's (runtime, compiler) modules, imported at first use

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, self.prefix + name)

    def error_name(self, code: int) -> str:
        name = self._fn("GetErrorName")
        name.restype = ctypes.c_char_p
        return name(code).decode()

    # -- code objects (the vendor's binding) ---------------------------------------------

    @staticmethod
    @abstractmethod
    def import_bindings() -> tuple[Any, Any]:
        """The vendor's Python binding modules: (driver, nvrtc) | (hip, hiprtc)."""

    def _vendor_bindings(self) -> tuple[Any, Any]:
        if self._bindings is None:
            self._bindings = self.import_bindings()
        return self._bindings

    @abstractmethod
    def arch(self) -> str:
        """The device's code-object target: "sm_90", "gfx942:sramecc+:xnack-", ..."""

    @abstractmethod
    def compiler(self) -> str:
        """The run-time compiler and its version ("nvrtc 13.0"): part of the cache key."""

    @abstractmethod
    def compile(self, spec: KernelSpec) -> bytes:
        """Compile `spec` at run time (NVRTC | hiprtc)."""

    @abstractmethod
    def load(self, image: bytes) -> dict[int, int]:
        """Load a code object; return the entry point of each access width (the module is kept
        for `function`)."""

    @abstractmethod
    def function(self, name: str) -> int:
        """Another entry point of the loaded code object, by name (`pkv_bulk`)."""

    @abstractmethod
    def allow_shared(self, function: int, nbytes: int) -> None:
        """Let `function` launch with `nbytes` of dynamic shared memory (over 48 KiB must be asked for)."""

    def kernel_spec(self) -> KernelSpec:
        """The copy kernel for this device: sources, arch and compiler decide the code object."""
        return KernelSpec.for_source(self.kernel_source, self.arch(), self.compiler(), self.code_suffix)

    def code_object(self) -> bytes:
        """The copy kernel's code object: prebuilt, cached or compiled now (jit.py)."""
        return self.kernel_spec().build(self.compile)

    # -- per call (ctypes) -----------------------------------------------------------------

    @abstractmethod
    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None:
        """Launch with `params` the address of the kernel's void* argument array."""

    @abstractmethod
    def batch_call(self, batch: CopyBatch, stream: int) -> int:
        """One batched memcpy call; returns the runtime's error code."""

    # -- the copy engine (io/engine.py) ---------------------------------------------------

    def current_stream(self) -> int:
        """The handle of the device's current torch stream: transfers are ordered on it."""
        return raw_stream(self.device_index)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self._fn("MemcpyAsync")(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), MEMCPY_DEFAULT, ctypes.c_void_p(stream))
        check(code, f"{self.prefix}MemcpyAsync", self.error_name)

    def memcpy_batch(self, batch: CopyBatch, stream: int) -> None:
        """Every copy of `batch` on `stream` (never the legacy default stream): one batched
        call per `max_batch` copies where the runtime has it, else copy by copy."""
        for piece in split_batch(batch, self.max_batch):
            if self.has_batch:
                check(self.batch_call(piece, stream), f"{self.prefix}MemcpyBatchAsync", self.error_name)
            else:
                super().memcpy_batch(piece, stream)

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        code = self._fn("Memcpy2DAsync")(ctypes.c_void_p(dst), ctypes.c_size_t(dst_pitch), ctypes.c_void_p(src), ctypes.c_size_t(src_pitch),
                                         ctypes.c_size_t(width), ctypes.c_size_t(height), MEMCPY_DEFAULT, ctypes.c_void_p(stream))
        check(code, f"{self.prefix}Memcpy2DAsync", self.error_name)

    def streams(self) -> Streams:
        return DeviceStreams(self)

    def direct_mover(self) -> Mover:
        return DirectMover(self)

    # -- events, which DeviceStreams orders streams with ----------------------------------

    def event_create(self, timing: bool = False) -> int:
        event = ctypes.c_void_p()
        check(self._fn("EventCreateWithFlags")(ctypes.byref(event), ctypes.c_uint(0 if timing else EVENT_DISABLE_TIMING)),
              f"{self.prefix}EventCreateWithFlags", self.error_name)
        return event.value or 0

    def event_record(self, event: int, stream: int) -> None:
        check(self._fn("EventRecord")(ctypes.c_void_p(event), ctypes.c_void_p(stream)), f"{self.prefix}EventRecord", self.error_name)

    def stream_wait_event(self, stream: int, event: int) -> None:
        check(self._fn("StreamWaitEvent")(ctypes.c_void_p(stream), ctypes.c_void_p(event), ctypes.c_uint(0)),
              f"{self.prefix}StreamWaitEvent", self.error_name)

    def event_synchronize(self, event: int) -> None:
        check(self._fn("EventSynchronize")(ctypes.c_void_p(event)), f"{self.prefix}EventSynchronize", self.error_name)

    def event_done(self, event: int) -> bool:
        """Whether the work before the event's latest record has completed (a never-recorded event has)."""
        code = self._fn("EventQuery")(ctypes.c_void_p(event))
        if code == NOT_READY:
            return False
        check(code, f"{self.prefix}EventQuery", self.error_name)
        return True

    def event_elapsed(self, start: int, end: int) -> float:
        """Seconds between two completed timing events."""
        ms = ctypes.c_float()
        check(self._fn("EventElapsedTime")(ctypes.byref(ms), ctypes.c_void_p(start), ctypes.c_void_p(end)),
              f"{self.prefix}EventElapsedTime", self.error_name)
        return ms.value / 1e3

    def event_destroy(self, event: int) -> None:
        # Unchecked: it also runs from finalizers, after the runtime may have shut down; an
        # event destroyed with work pending is released once that work completes.
        self._fn("EventDestroy")(ctypes.c_void_p(event))

    # -- host memory ---------------------------------------------------------------------

    def register_host(self, address: int, nbytes: int) -> int:
        """Page-lock and map [address, address + nbytes); returns the device address of it."""
        code = self._fn("HostRegister")(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), REGISTER_FLAGS)
        check(code, f"{self.prefix}HostRegister", self.error_name)
        device = ctypes.c_void_p()
        code = self._fn("HostGetDevicePointer")(ctypes.byref(device), ctypes.c_void_p(address), 0)
        check(code, f"{self.prefix}HostGetDevicePointer", self.error_name)
        return device.value or 0

    def unregister_host(self, address: int) -> None:
        check(self._fn("HostUnregister")(ctypes.c_void_p(address)), f"{self.prefix}HostUnregister", self.error_name)

    # -- threads -------------------------------------------------------------------------

    def bind_thread(self) -> None:
        """Make the device's context current on the calling thread, once per thread."""
        if getattr(self._bound, "done", False):
            return
        self._bind()
        self._bound.done = True

    @abstractmethod
    def _bind(self) -> None: ...

    def describe(self) -> dict[str, str]:
        return {f"{self.prefix} runtime": self.version_text(), "direct": f"{self.prefix}MemcpyBatchAsync" if self.has_batch else f"{self.prefix}MemcpyAsync loop"}

    @abstractmethod
    def version_text(self) -> str: ...


def raw_stream(index: int) -> int:
    """The handle of GPU `index`'s current torch stream (torch.cuda serves ROCm too)."""
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a fraction of the public call's cost, per call
    raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def split_batch(batch: CopyBatch, limit: int | None) -> list[CopyBatch]:
    """Pieces of at most `limit` copies (ROCm faults above 8192 descriptors on some parts)."""
    if limit is None or len(batch) <= limit:
        return [batch]
    return [batch.slice(i, i + limit) for i in range(0, len(batch), limit)]


def find_loaded_library(stem: str) -> str | None:
    """The path of an already-loaded shared library (torch's own runtime), by file-name stem."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if Path(path).name.startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


def as_pointer_array(values: np.ndarray) -> int:
    """The address of a contiguous uint64 array, for ctypes calls taking void** / size_t*."""
    assert values.dtype == np.uint64 and values.flags.c_contiguous
    return values.ctypes.data
