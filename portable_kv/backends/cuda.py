"""NVIDIA: NVRTC or nvcc code objects, loaded and launched through cuda-python.

Twin of rocm.py: the same methods in the same order; gpu.py holds the rest.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from ..plan import CopyBatch
from .base import BackendUnavailable
from .gpu import COMMON_KERNEL_DIR, KERNEL_WIDTHS, PACKAGE_DIR, GpuBackend, RuntimeLibrary, as_pointer_array, find_loaded_library

KERNEL_SOURCE = PACKAGE_DIR / "kernels_cuda" / "kv_copy.cu"
AOT_ARCHS = ("sm_80", "sm_90", "sm_100")
BATCH_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
BATCH_FAILIDX_UNTIL = 13000  # 12.8/12.9 take a failIdx argument; 13.0 dropped it
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream; 0 is invalid


def bindings():
    """cuda-python's driver and NVRTC modules; a clear error when the `cuda` extra is missing."""
    try:
        return importlib.import_module("cuda.bindings.driver"), importlib.import_module("cuda.bindings.nvrtc")
    except ImportError as exc:
        raise BackendUnavailable(
            f"cuda-python is not importable ({exc}); install it with: pip install 'portable-kv[cuda]'"
        ) from exc


def check(result, what: str):
    """Unwrap a cuda-python (error, *values) tuple, raising with the driver's name for the error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)} ({int(err)})")
    return values[0] if len(values) == 1 else values


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


class CudaRuntime(RuntimeLibrary):
    """The CUDA runtime library torch already loaded."""

    prefix = "cuda"
    batch_min_version = BATCH_MIN_VERSION

    def __init__(self, lib=None) -> None:
        if lib is None:
            try:
                lib = ctypes.CDLL(find_loaded_library("libcudart") or "libcudart.so")
            except OSError as exc:
                raise BackendUnavailable(f"the CUDA runtime library could not be loaded ({exc}); install a CUDA build of torch") from exc
        super().__init__(lib)
        self.attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self.attrs_index = ctypes.c_size_t(0)

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


class DriverLaunch:
    """cuLaunchKernel through ctypes: ~6 us a launch from Python where cuda-python's wrapper takes ~9 (DESIGN.md)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(find_loaded_library("libcuda") or "libcuda.so.1")
        self.call = lib.cuLaunchKernel
        u = ctypes.c_uint
        self.call.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.call.restype = ctypes.c_int

    def __call__(self, kernel: int, grid: int, block: int, params: int, stream: int) -> int:
        return self.call(kernel, grid, 1, 1, block, 1, 1, 0, stream, params, None)


class CudaBackend(GpuBackend):
    name = "cuda"
    vendor = "nvidia"
    default_block_quota = 16  # H200: 16 blocks of 512 reach the PCIe ceiling (DESIGN.md)
    vendor_kernel = KERNEL_SOURCE
    code_suffix = "cubin"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if getattr(torch.version, "hip", None) or not getattr(torch.version, "cuda", None):
            return "torch is not a CUDA build"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
        if importlib.util.find_spec("cuda.bindings") is None:
            return "cuda-python is not installed (pip install 'portable-kv[cuda]')"
        return None

    def __init__(self) -> None:
        super().__init__()
        self.driver, self.nvrtc = bindings()
        self.runtime = CudaRuntime()
        self._launch = DriverLaunch()
        self._thread = threading.local()

    def arch(self) -> str:
        major, minor = torch.cuda.get_device_capability(self.device)
        return f"sm_{major}{minor}"

    def compiler_version(self) -> str:
        major, minor = check(self.nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"nvrtc {major}.{minor}"

    def compile(self, arch: str) -> bytes:
        return nvrtc_compile(self.nvrtc, arch, self.defines)

    def load(self, image: bytes) -> dict[int, object]:
        self.bind_thread()
        module = check(self.driver.cuModuleLoadData(image), "cuModuleLoadData")
        functions = {w: check(self.driver.cuModuleGetFunction(module, f"pkv_copy_{w}".encode()), "cuModuleGetFunction") for w in KERNEL_WIDTHS}
        return {w: int(f) for w, f in functions.items()}

    def launch(self, kernel: object, grid: int, block: int, params: int, stream: int) -> None:
        err = self._launch(kernel, grid, block, params, stream)
        if err:
            check((self.driver.CUresult(err),), "cuLaunchKernel")

    def bind_thread(self) -> None:
        # The driver API needs the primary context current on each calling thread;
        # torch makes it current only on threads that touched the runtime.
        if getattr(self._thread, "bound", False):
            return
        device = check(self.driver.cuDeviceGet(self.device.index), "cuDeviceGet")
        context = check(self.driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        check(self.driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self._thread.bound = True

    def describe(self) -> dict[str, str]:
        facts = super().describe()
        facts["cuda runtime"] = f"{self.runtime.version // 1000}.{self.runtime.version % 1000 // 10}"
        facts["direct"] = "cudaMemcpyBatchAsync" if self.runtime.has_batch else "cudaMemcpyAsync loop"
        return facts


def nvrtc_compile(nvrtc, arch: str, defines: tuple[str, ...] = ()) -> bytes:
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
    from .gpu import code_object_name

    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise BackendUnavailable("nvcc was not found on PATH; install the CUDA toolkit or rely on NVRTC at first use")
    written = []
    for arch in archs:
        out = out_dir / code_object_name(KERNEL_SOURCE, arch, "cubin")
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", f"-I{COMMON_KERNEL_DIR}", "-o", str(out), str(KERNEL_SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BackendUnavailable(f"nvcc failed for {arch}: {' '.join(cmd)}\n{result.stderr}")
        written.append(out)
    return written


__all__ = ["CudaBackend", "nvcc_build", "nvrtc_compile"]
