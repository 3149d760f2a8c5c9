"""NVIDIA: NVRTC or nvcc code objects, loaded through cuda-python; launches and batched
copies through ctypes.

Twin of rocm.py: the same functions and methods in the same order; runtime.py holds
what the vendors share, gpu.py the backend over either.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from ..io.copier import CopyBatch
from ..io.kernel_args import KERNEL_WIDTHS
from .base import BackendUnavailable
from .gpu import GpuBackend
from .jit import COMMON_KERNEL_DIR, PACKAGE_DIR, KernelSpec
from .runtime import DeviceRuntime, as_pointer_array, check, find_loaded_library

KERNEL_SOURCE = PACKAGE_DIR / "kernels_cuda" / "kv_copy.cu"
AOT_ARCHS = ("sm_80", "sm_90", "sm_100")
BATCH_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
BATCH_FAILIDX_UNTIL = 13000  # 12.8/12.9 take a failIdx argument; 13.0 dropped it
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream; 0 is invalid
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def bindings() -> tuple[Any, Any]:
    """cuda-python's driver and NVRTC modules; a clear error when the `cuda` extra is missing."""
    try:
        return importlib.import_module("cuda.bindings.driver"), importlib.import_module("cuda.bindings.nvrtc")
    except ImportError as exc:
        raise BackendUnavailable(
            f"cuda-python is not importable ({exc}); install it with: pip install 'portable-kv[cuda]'"
        ) from exc


def runtime_library() -> ctypes.CDLL:
    """The CUDA runtime library torch already loaded (libcudart)."""
    try:
        return ctypes.CDLL(find_loaded_library("libcudart") or "libcudart.so")
    except OSError as exc:
        raise BackendUnavailable(f"the CUDA runtime library could not be loaded ({exc}); install a CUDA build of torch") from exc


class MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA >= 12.8); the location hints are ignored for pinned memory."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_hint_type", ctypes.c_int),
        ("src_hint_id", ctypes.c_int),
        ("dst_hint_type", ctypes.c_int),
        ("dst_hint_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class CudaRuntime(DeviceRuntime):
    """One NVIDIA GPU: cuda-python for code objects and contexts, libcudart and libcuda for each call."""

    prefix = "cuda"
    code_suffix = "cubin"
    kernel_source = KERNEL_SOURCE
    batch_min_version = BATCH_MIN_VERSION
    bulk_threads = 32  # one warp drives a block's bulk copies (kernels_cuda/kv_copy.cu)
    bulk_blocks = 4  # io/bulk.py: BULK_BLOCKS, measured
    # Copies of 1 MiB and more on average go out as one batched call (io/direct.py): on the
    # H200, vLLM's cross-layer blocks (128 copies of 1.1-2 MiB) moved at 97-98% of the link
    # that way and at 86-92% over 4 streams, with 70-120 against 500-700 us of the caller's
    # time (docs/PERFORMANCE.md, "vLLM's blocks through the offloading spec").
    one_call_copy_bytes = 1 << 20

    def __init__(self, device_index: int = 0, lib: Any = None) -> None:
        super().__init__(lib if lib is not None else runtime_library(), device_index)
        self.module: Any = None
        self.attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self.attrs_index = ctypes.c_size_t(0)
        self._launch_kernel: Any = None  # libcuda's cuLaunchKernel, opened at the first launch

    @property
    def driver(self) -> Any:
        return self._vendor_bindings()[0]

    @property
    def nvrtc(self) -> Any:
        return self._vendor_bindings()[1]

    import_bindings = staticmethod(lambda: bindings())

    def arch(self) -> str:
        major, minor = torch.cuda.get_device_capability(self.device_index)
        return f"sm_{major}{minor}"

    def compiler(self) -> str:
        major, minor = check(self.nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"nvrtc {major}.{minor}"

    def compile(self, spec: KernelSpec) -> bytes:
        return nvrtc_compile(self.nvrtc, spec.arch, spec.defines)

    def load(self, image: bytes) -> dict[int, int]:
        self.module = check(self.driver.cuModuleLoadData(image), "cuModuleLoadData")
        return {w: self.function(f"pkv_copy_{w}") for w in KERNEL_WIDTHS}

    def function(self, name: str) -> int:
        return int(check(self.driver.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction"))

    def allow_shared(self, function: int, nbytes: int) -> None:
        attribute = self.driver.CUfunction_attribute(MAX_DYNAMIC_SHARED)
        check(self.driver.cuFuncSetAttribute(self.driver.CUfunction(function), attribute, nbytes), "cuFuncSetAttribute")

    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None:
        if self._launch_kernel is None:
            # ctypes: a launch from Python costs less so than through cuda-python's wrapper (docs/DESIGN.md).
            call = ctypes.CDLL(find_loaded_library("libcuda") or "libcuda.so.1").cuLaunchKernel
            u = ctypes.c_uint
            call.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            call.restype = ctypes.c_int
            self._launch_kernel = call
        code = self._launch_kernel(kernel, grid, 1, 1, block, 1, 1, shared_bytes, stream, params, None)
        if code:
            check((self.driver.CUresult(code),), "cuLaunchKernel")

    def batch_call(self, batch: CopyBatch, stream: int) -> int:
        # One attribute entry (srcAccessOrder = stream) for every copy.
        args = [
            ctypes.c_void_p(as_pointer_array(batch.dst)),
            ctypes.c_void_p(as_pointer_array(batch.src)),
            ctypes.c_void_p(as_pointer_array(batch.sizes)),
            ctypes.c_size_t(len(batch)),
            ctypes.byref(self.attrs),
            ctypes.byref(self.attrs_index),
            ctypes.c_size_t(1),
        ]
        if self.version < BATCH_FAILIDX_UNTIL:
            args.append(ctypes.byref(self.fail_index))
        args.append(ctypes.c_void_p(stream))
        return self.lib.cudaMemcpyBatchAsync(*args)

    def _bind(self) -> None:
        # The driver API needs the primary context current on each calling thread;
        # torch makes it current only on threads that touched the runtime.
        device = check(self.driver.cuDeviceGet(self.device_index), "cuDeviceGet")
        context = check(self.driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        check(self.driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def version_text(self) -> str:
        return f"{self.version // 1000}.{self.version % 1000 // 10}"


class CudaBackend(GpuBackend):
    name = "cuda"
    vendor = "nvidia"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if getattr(torch.version, "hip", None) or not getattr(torch.version, "cuda", None):
            return "torch is not a CUDA build"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
        if importlib.util.find_spec("cuda.bindings") is None:
            return "cuda-python is not installed (pip install 'portable-kv[cuda]')"
        return None

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        super().__init__(runtime or CudaRuntime(torch.cuda.current_device()))


def nvrtc_compile(nvrtc: Any, arch: str, defines: tuple[str, ...] = ()) -> bytes:
    """NVRTC: the vendor source to a cubin for `arch` (no GPU needed)."""
    source = KERNEL_SOURCE.read_bytes()
    program = check(nvrtc.nvrtcCreateProgram(source, KERNEL_SOURCE.name.encode(), 0, [], []), "nvrtcCreateProgram")
    options = [f"--gpu-architecture={arch}".encode(), f"--include-path={COMMON_KERNEL_DIR}".encode(), b"--std=c++17"]
    options += [f"-D{d}".encode() for d in defines]
    try:
        err, = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(err) != 0:
            size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
            raise BackendUnavailable(
                f"NVRTC failed to compile {KERNEL_SOURCE.name} for {arch}:\n{log.decode(errors='replace')}\n"
                "fix: install an NVRTC that knows this GPU (pip install -U nvidia-cuda-nvrtc), or build ahead of time: portable-kv build --vendor cuda"
            )
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def nvcc_build(out_dir: Path, archs: tuple[str, ...] = AOT_ARCHS, nvcc: str | None = None) -> list[Path]:
    """Ahead of time: one cubin per arch with nvcc, named so that the loader prefers it."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise BackendUnavailable("nvcc was not found on PATH; install the CUDA toolkit or rely on NVRTC at first use")
    written = []
    for arch in archs:
        out = out_dir / KernelSpec.for_source(KERNEL_SOURCE, arch, "nvcc", "cubin").prebuilt_name()
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", f"-I{COMMON_KERNEL_DIR}", "-o", str(out), str(KERNEL_SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BackendUnavailable(f"nvcc failed for {arch}: {' '.join(cmd)}\n{result.stderr}")
        written.append(out)
    return written


__all__ = ["CudaBackend", "CudaRuntime", "nvcc_build", "nvrtc_compile"]
