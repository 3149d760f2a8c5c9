"""AMD: hiprtc or clang/hipcc code objects, loaded through hip-python; launches and
batched copies through ctypes.

Twin of cuda.py: the same functions and methods in the same order; runtime.py holds
what the vendors share, gpu.py the backend over either.  On ROCm, torch.cuda streams
are HIP streams, so torch's stream handles pass straight to the HIP runtime.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from .. import config
from ..io.copier import CopyBatch
from ..io.kernel_args import KERNEL_WIDTHS
from .base import BackendUnavailable
from .gpu import GpuBackend
from .jit import COMMON_HEADERS, COMMON_KERNEL_DIR, PACKAGE_DIR, KernelSpec
from .runtime import DeviceRuntime, as_pointer_array, check, find_loaded_library

KERNEL_SOURCE = PACKAGE_DIR / "kernels_hip" / "kv_copy.hip"
AOT_ARCHS = ("gfx90a", "gfx942", "gfx950")
BATCH_MIN_VERSION = 70100000  # hipMemcpyBatchAsync appeared in ROCm 7.1 (HIP_VERSION encoding)
BATCH_MAX_DESCRIPTORS = 8192  # more descriptors in one call fault on some parts
MAX_DYNAMIC_SHARED = 8  # hipFuncAttributeMaxDynamicSharedMemorySize
BITCODE_DIRS = ("/opt/rocm/amdgcn/bitcode", "/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode", "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")
BITCODE_LIBS = ("ockl.bc", "oclc_abi_version_500.bc", "oclc_wavefrontsize64_on.bc")


def bindings() -> tuple[Any, Any]:
    """hip-python's runtime and hiprtc modules; a clear error when the `rocm` extra is missing.

    hip-python opens libamdhip64.so / libhiprtc.so by their unversioned names on
    first use; pip-installed ROCm ships only versioned files, so name them.
    """
    try:
        chip, chiprtc = importlib.import_module("hip.chip"), importlib.import_module("hip.chiprtc")
        hip, hiprtc = importlib.import_module("hip.hip"), importlib.import_module("hip.hiprtc")
    except ImportError as exc:
        raise BackendUnavailable(f"hip-python is not importable ({exc}); install it with: pip install 'portable-kv[rocm]'") from exc
    for module, stem in ((chip, "libamdhip64"), (chiprtc, "libhiprtc")):
        path = library_path(stem)
        if path and hasattr(module, "DLL"):
            module.DLL = path
    return hip, hiprtc


def runtime_library() -> ctypes.CDLL:
    """The HIP runtime library (libamdhip64): torch's, else pip-installed ROCm's or /opt/rocm's."""
    try:
        return ctypes.CDLL(library_path("libamdhip64") or "libamdhip64.so")
    except OSError as exc:
        raise BackendUnavailable(f"the HIP runtime (libamdhip64) could not be loaded ({exc}); install ROCm or a ROCm build of torch") from exc


def library_path(stem: str) -> str | None:
    """A HIP library by file-name stem: already loaded (torch's), else pip-installed or /opt/rocm, versioned names included."""
    loaded = find_loaded_library(stem)
    if loaded:
        return loaded
    roots = [os.path.join(os.path.dirname(torch.__file__), "lib"), os.environ.get("ROCM_PATH", "/opt/rocm") + "/lib"]
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, stem + ".so*")))
        if found:
            return found[0]
    return None


class HipRuntime(DeviceRuntime):
    """One AMD GPU: hip-python for code objects, libamdhip64 for each call and the device binding."""

    prefix = "hip"
    code_suffix = "hsaco"
    kernel_source = KERNEL_SOURCE
    batch_min_version = BATCH_MIN_VERSION
    max_batch = BATCH_MAX_DESCRIPTORS
    # CDNA has no bulk asynchronous copy: the bulk kernel's vector walker, four wavefronts a
    # workgroup; AMD needs more in flight than NVIDIA to fill the link (docs/DESIGN.md).
    bulk_threads = 256
    bulk_blocks = 8
    # Not measured on MI300 (whose batched copy is a loop of copies up to ROCm 7.2): direct
    # io keeps spreading every transfer over its streams' SDMA engines.
    one_call_copy_bytes = None

    def __init__(self, device_index: int = 0, lib: Any = None) -> None:
        super().__init__(lib if lib is not None else runtime_library(), device_index)
        self.module: Any = None
        u = ctypes.c_uint
        self.lib.hipModuleLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.hipModuleLaunchKernel.restype = ctypes.c_int

    @property
    def hip(self) -> Any:
        return self._vendor_bindings()[0]

    @property
    def hiprtc(self) -> Any:
        return self._vendor_bindings()[1]

    import_bindings = staticmethod(lambda: bindings())

    def arch(self) -> str:
        # "gfx942:sramecc+:xnack-": the features matter to hiprtc's --offload-arch.
        return torch.cuda.get_device_properties(self.device_index).gcnArchName

    def compiler(self) -> str:
        major, minor = check(self.hiprtc.hiprtcVersion(), "hiprtcVersion")
        return f"hiprtc {major}.{minor}"

    def compile(self, spec: KernelSpec) -> bytes:
        return hiprtc_compile(self.hiprtc, spec.arch, spec.defines)

    def load(self, image: bytes) -> dict[int, int]:
        self.module = check(self.hip.hipModuleLoadData(image), "hipModuleLoadData")
        return {w: self.function(f"pkv_copy_{w}") for w in KERNEL_WIDTHS}

    def function(self, name: str) -> int:
        return int(check(self.hip.hipModuleGetFunction(self.module, name.encode()), "hipModuleGetFunction"))

    def allow_shared(self, function: int, nbytes: int) -> None:
        check(self.hip.hipFuncSetAttribute(function, MAX_DYNAMIC_SHARED, nbytes), "hipFuncSetAttribute")

    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None:
        code = self.lib.hipModuleLaunchKernel(kernel, grid, 1, 1, block, 1, 1, shared_bytes, stream, params, None)
        check(code, "hipModuleLaunchKernel", self.error_name)

    def batch_call(self, batch: CopyBatch, stream: int) -> int:
        # numAttrs = 0: ROCm 7.2 answers hipErrorNotSupported to any attribute.
        return self.lib.hipMemcpyBatchAsync(
            ctypes.c_void_p(as_pointer_array(batch.dst)),
            ctypes.c_void_p(as_pointer_array(batch.src)),
            ctypes.c_void_p(as_pointer_array(batch.sizes)),
            ctypes.c_size_t(len(batch)),
            None,
            None,
            ctypes.c_size_t(0),
            ctypes.byref(self.fail_index),
            ctypes.c_void_p(stream),
        )

    def _bind(self) -> None:
        # A module launch runs on the calling thread's current device, which is
        # device 0 on a thread that never touched torch.
        check(self.lib.hipSetDevice(self.device_index), "hipSetDevice", self.error_name)

    def version_text(self) -> str:
        return str(self.version)


class RocmBackend(GpuBackend):
    name = "rocm"
    vendor = "amd"
    # hipHostRegister may map a range at another device address than the host's (docs/DESIGN.md).
    kernel_reads_registered_memory = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not getattr(torch.version, "hip", None):
            return "torch is not a ROCm build"
        if not torch.cuda.is_available():
            return "no ROCm GPU is visible"
        if importlib.util.find_spec("hip") is None:
            return "hip-python is not installed (pip install 'portable-kv[rocm]')"
        return None

    def __init__(self, runtime: HipRuntime | None = None) -> None:
        super().__init__(runtime or HipRuntime(torch.cuda.current_device()))


def hiprtc_compile(hiprtc: Any, arch: str, defines: tuple[str, ...] = ()) -> bytes:
    """hiprtc: the vendor source to a code object for `arch`; the shared headers are passed as program headers."""
    program = check(hiprtc.hiprtcCreateProgram(KERNEL_SOURCE.read_bytes(), KERNEL_SOURCE.name.encode(), len(COMMON_HEADERS),
                                               [h.read_bytes() for h in COMMON_HEADERS], [h.name.encode() for h in COMMON_HEADERS]),
                    "hiprtcCreateProgram")
    options = [f"--offload-arch={arch}".encode(), b"-O3", b"-std=c++17"] + [f"-D{d}".encode() for d in defines]
    try:
        err, = hiprtc.hiprtcCompileProgram(program, len(options), options)
        if int(err) != 0:
            size = check(hiprtc.hiprtcGetProgramLogSize(program), "hiprtcGetProgramLogSize")
            log = bytearray(size)
            check(hiprtc.hiprtcGetProgramLog(program, log), "hiprtcGetProgramLog")
            raise BackendUnavailable(
                f"hiprtc failed to compile {KERNEL_SOURCE.name} for {arch}:\n{bytes(log).decode(errors='replace')}\n"
                "fix: use a ROCm whose compiler knows this GPU, or build ahead of time: portable-kv build --vendor rocm --arch <gfx>"
            )
        size = check(hiprtc.hiprtcGetCodeSize(program), "hiprtcGetCodeSize")
        code = bytearray(size)
        check(hiprtc.hiprtcGetCode(program, code), "hiprtcGetCode")
        return bytes(code)
    finally:
        hiprtc.hiprtcDestroyProgram(program)


def find_bitcode_dir() -> Path | None:
    configured = config.HIP_BITCODE.raw()
    candidates = [configured] if configured else []
    for pattern in BITCODE_DIRS:
        candidates += sorted(glob.glob(pattern))
    for directory in candidates:
        if all((Path(directory) / lib).is_file() for lib in BITCODE_LIBS):
            return Path(directory)
    return None


def clang_command(arch: str, out: Path, clang: str | None = None) -> list[str]:
    """The offline compile: hipcc where ROCm is installed, else clang with Debian's HIP headers and device bitcode."""
    hipcc = shutil.which("hipcc") if clang is None else None
    if hipcc:
        return [hipcc, f"--offload-arch={arch}", "--genco", "-O3", "-std=c++17", f"-I{COMMON_KERNEL_DIR}", "-o", str(out), str(KERNEL_SOURCE)]
    clang = clang or config.CLANG.raw() or shutil.which("clang++-19") or shutil.which("clang++")
    bitcode = find_bitcode_dir()
    if clang is None or bitcode is None:
        raise BackendUnavailable(
            "no HIP compiler found: install ROCm (hipcc), or clang-19 with Debian's libamdhip64-dev and rocm-device-libs "
            "(apt-get install clang-19 lld-19 libamdhip64-dev rocm-device-libs)"
        )
    link = [arg for lib in BITCODE_LIBS for arg in ("-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(bitcode / lib))]
    return [clang, "-x", "hip", f"--offload-arch={arch}", "--offload-device-only", "-nogpulib", "--no-gpu-bundle-output",
            "-O3", "-std=c++17", f"-I{COMMON_KERNEL_DIR}", *link, "-c", str(KERNEL_SOURCE), "-o", str(out)]


def clang_build(out_dir: Path, archs: tuple[str, ...] = AOT_ARCHS, clang: str | None = None) -> list[Path]:
    """Ahead of time: one code object per arch the compiler knows, named so that the loader prefers it."""
    written = []
    for arch in archs:
        out = out_dir / KernelSpec.for_source(KERNEL_SOURCE, arch, "clang", "hsaco").prebuilt_name()
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = clang_command(arch, out, clang)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            if any(s in result.stderr.lower() for s in ("invalid target id", "unsupported", "invalid offload arch", "unknown target")):
                continue  # e.g. gfx950 before LLVM 20
            raise BackendUnavailable(f"HIP compile failed for {arch}: {' '.join(cmd)}\n{result.stderr}")
        written.append(out)
    if not written:
        raise BackendUnavailable(f"the HIP compiler knows none of {', '.join(archs)}")
    return written


__all__ = ["HipRuntime", "RocmBackend", "clang_build", "hiprtc_compile"]
