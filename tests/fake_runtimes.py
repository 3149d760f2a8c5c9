"""Test doubles for the vendor runtimes: hip-python, hiprtc, and the ctypes libraries
(libamdhip64, libcudart). They record every call so that tests can check dispatch
(kernel, grid, arguments, stream, batch signatures) without a GPU."""

from __future__ import annotations

import ctypes
import sys
import types

import torch


class Fn:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


class FakeRtc:
    """hiprtc / nvrtc: returns (error, value) tuples like the real bindings."""

    def __init__(self, prefix: str, fail_log: str | None = None) -> None:
        self.prefix, self.fail_log, self.calls = prefix, fail_log, []
        self.code = b"\x7fELF-fake-code-object"

    def __getattr__(self, name):
        raise AttributeError(name)

    def _record(self, name, *args):
        self.calls.append((name, args))

    def create(self, src, name, n, headers, names):
        self._record("create", src, name, n, headers, names)
        return (0, "program")

    def compile(self, program, n, options):
        self._record("compile", n, list(options))
        return (1 if self.fail_log else 0,)

    def log_size(self, program):
        return (0, len(self.fail_log or ""))

    def log(self, program, buf):
        buf[:] = (self.fail_log or "").encode()
        return (0,)

    def code_size(self, program):
        return (0, len(self.code))

    def get_code(self, program, buf):
        buf[:] = self.code
        return (0,)

    def destroy(self, program):
        return (0,)

    def version(self):
        return (0, 7, 1)


def fake_hiprtc(fail_log: str | None = None) -> types.SimpleNamespace:
    rtc = FakeRtc("hiprtc", fail_log)
    return types.SimpleNamespace(
        rtc=rtc, hiprtcCreateProgram=rtc.create, hiprtcCompileProgram=rtc.compile, hiprtcGetProgramLogSize=rtc.log_size,
        hiprtcGetProgramLog=rtc.log, hiprtcGetCodeSize=rtc.code_size, hiprtcGetCode=rtc.get_code,
        hiprtcDestroyProgram=rtc.destroy, hiprtcVersion=rtc.version,
    )


class FakeHip:
    def __init__(self) -> None:
        self.calls = []

    def hipModuleLoadData(self, image):
        self.calls.append(("hipModuleLoadData", bytes(image)))
        return (0, "module")

    def hipModuleGetFunction(self, module, name):
        self.calls.append(("hipModuleGetFunction", name))
        return (0, Fn(0x1000 + int(name.decode().rsplit("_", 1)[1])))


def install_fake_hip(monkeypatch, fail_log: str | None = None):
    """Put a fake hip-python package into sys.modules; returns (hip, hiprtc) doubles."""
    hip, rtc = FakeHip(), fake_hiprtc(fail_log)
    package = types.ModuleType("hip")
    modules = {"hip": package, "hip.hip": hip, "hip.hiprtc": rtc,
               "hip.chip": types.SimpleNamespace(DLL="libamdhip64.so"), "hip.chiprtc": types.SimpleNamespace(DLL="libhiprtc.so")}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return hip, rtc


class FakeLib:
    """A ctypes library double: records each call with its arguments as plain values."""

    def __init__(self, version: int, symbols: tuple[str, ...], failing: dict[str, int] | None = None) -> None:
        self.version, self.calls = version, []
        self.failing = failing or {}  # symbol -> the error code it returns
        for name in symbols:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def call(*args):
            if name.endswith("RuntimeGetVersion"):
                args[0]._obj.value = self.version
                return 0
            if name.endswith("GetErrorName"):
                return b"fakeError"
            self.calls.append((name, [_plain(a) for a in args]))
            return self.failing.get(name, 0)

        return call


def _plain(arg):
    if arg is None:
        return None
    if isinstance(arg, (int, bytes)):
        return arg
    if hasattr(arg, "_obj"):  # byref(...)
        return ("byref", type(arg._obj).__name__)
    if isinstance(arg, ctypes._SimpleCData):
        return arg.value
    return arg


EVENT_CALLS = ("EventCreateWithFlags", "EventRecord", "StreamWaitEvent", "EventSynchronize", "EventQuery", "EventElapsedTime", "EventDestroy")
HIP_SYMBOLS = ("hipRuntimeGetVersion", "hipModuleLaunchKernel", "hipMemcpyBatchAsync", "hipMemcpyAsync", "hipMemcpy2DAsync", "hipGetErrorName",
               "hipSetDevice", *("hip" + name for name in EVENT_CALLS))
CUDART_SYMBOLS = ("cudaRuntimeGetVersion", "cudaMemcpyBatchAsync", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaGetErrorName",
                  *("cuda" + name for name in EVENT_CALLS))


FAKE_STREAM = 0x5EED  # the stream handle the fake runtimes report as current


def fake_rocm_backend(monkeypatch, tmp_path):
    """A RocmBackend over the fake hip-python and libamdhip64; returns (backend, hip, hiprtc, lib).

    Its device is the CPU, where nothing runs behind a call: the runtime's copy engine
    orders no streams (InlineStreams), on one fixed stream handle the tests look for."""
    from portable_kv.backends import rocm
    from portable_kv.io.streams import InlineStreams

    hip, hiprtc = install_fake_hip(monkeypatch)
    monkeypatch.setenv("PORTABLE_KV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(rocm.HipRuntime, "arch", lambda self: "gfx942:sramecc+:xnack-")
    monkeypatch.setattr(rocm.HipRuntime, "current_stream", lambda self: FAKE_STREAM)
    monkeypatch.setattr(rocm.HipRuntime, "streams", lambda self: InlineStreams(self.current_stream))
    lib = FakeLib(70200000, HIP_SYMBOLS)
    runtime = rocm.HipRuntime(lib=lib)
    runtime.device = torch.device("cpu")
    return rocm.RocmBackend(runtime=runtime), hip, hiprtc, lib
