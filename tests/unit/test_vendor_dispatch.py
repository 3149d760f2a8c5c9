"""The ROCm and CUDA backends against fake runtimes: what they call, with what, and
the errors they give when a piece is missing. No GPU needed."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest
import torch
from fake_runtimes import CUDART_SYMBOLS, FAKE_STREAM, HIP_SYMBOLS, FakeLib, fake_rocm_backend, install_fake_hip

from portable_kv.backends import base, cuda, rocm
from portable_kv.backends.runtime import MEMCPY_DEFAULT, DeviceError, check
from portable_kv.io import direct as dma
from portable_kv.io import kernel_args as ka
from portable_kv.io.copier import CopyBatch

STREAM = FAKE_STREAM


def batch(n: int) -> CopyBatch:
    return CopyBatch(np.arange(n, dtype=np.uint64) * 64 + (1 << 20), np.arange(n, dtype=np.uint64) * 64 + (1 << 30), np.full(n, 64, np.uint64))


@pytest.fixture
def fake_rocm(monkeypatch, tmp_path):
    return fake_rocm_backend(monkeypatch, tmp_path)


def test_rocm_compiles_with_hiprtc_for_the_device_arch_and_caches(fake_rocm, monkeypatch):
    backend, hip, hiprtc, _ = fake_rocm
    kernels = backend.kernels()
    (name, (src, fname, n, headers, names)), = [c for c in hiprtc.rtc.calls if c[0] == "create"]
    assert fname == b"kv_copy.hip" and n == 2 and names == [b"kv_copy.h", b"kv_bulk.h"]
    assert b"PkvCopyArgs" in headers[0] and b"PkvBulkArgs" in headers[1]
    (_, (count, options)), = [c for c in hiprtc.rtc.calls if c[0] == "compile"]
    assert b"--offload-arch=gfx942:sramecc+:xnack-" in options and count == len(options)
    assert hip.calls[0] == ("hipModuleLoadData", hiprtc.rtc.code)
    assert kernels == {w: 0x1000 + w for w in ka.KERNEL_WIDTHS}
    # A second process finds the code object in the cache and does not compile.
    again = rocm.RocmBackend(runtime=backend.runtime)
    hiprtc.rtc.calls.clear()
    again.kernels()
    assert not [c for c in hiprtc.rtc.calls if c[0] == "compile"]


def test_rocm_kernel_transfer_dispatch(fake_rocm, monkeypatch):
    backend, _, _, lib = fake_rocm
    import portable_kv as pk
    from portable_kv import backends

    monkeypatch.setitem(backends._instances, "rocm", backend)
    monkeypatch.setattr(rocm.RocmBackend, "unavailable_reason", classmethod(lambda cls: None))
    before = backends.current().name
    backends.use("rocm")
    try:
        dev = pk.DeviceKVPool(4, 256, 16, 4, 192, 128, dtype=torch.bfloat16)
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="kernel")
        idx, slots = torch.arange(64), torch.arange(64) + 128  # kept: the launch's index copies live while they do
        host.load_to_device_per_layer(dev, idx, slots, 2)
    finally:
        backends.use(before)
    assert host.stats()["load"]["kernel"]["calls"] == 1 and "kernel" not in host.stats()["paths"]
    (name, args), = [c for c in lib.calls if c[0] == "hipModuleLaunchKernel"]
    kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra = args
    assert kernel == 0x1000 + 16 and (gy, gz, by, bz, shared, extra) == (1, 1, 1, 1, 0, None)
    # (the stream it goes on: test_plans.py, test_every_io_path_enqueues_on_the_callers_current_stream)
    assert bx == ka.BLOCK and 1 <= gx <= backend.block_quota
    launch = ka.CopyArgs.from_address(ctypes.c_void_p.from_address(params).value)
    assert (launch.tokens, launch.layer_begin, launch.layers, launch.to_device, launch.page_size, launch.stream_device) == (64, 2, 1, 1, 16, 0)
    k, v = launch.job[0], launch.job[1]
    assert k.chunk_bytes == 4 * 192 * 2 and v.chunk_bytes == 4 * 128 * 2 and k.groups == v.groups == 1
    assert v.vec_begin == 64 * k.chunk_bytes // 16 and launch.total_vecs == 64 * (k.chunk_bytes + v.chunk_bytes) // 16
    assert k.host_base == host.k_buffer.data_ptr() and k.host_layer == 16 * 4 * 192 * 2
    assert ctypes.c_int64.from_address(launch.host_indices).value == 0
    assert ctypes.c_int64.from_address(launch.device_indices).value == 128


def test_rocm_batch_is_chunked_at_8192_with_no_attributes(fake_rocm):
    backend, _, _, lib = fake_rocm
    backend.runtime.memcpy_batch(batch(20000), STREAM)
    calls = [args for name, args in lib.calls if name == "hipMemcpyBatchAsync"]
    assert [c[3] for c in calls] == [8192, 8192, 3616]
    for _dsts, _srcs, _sizes, _count, attrs, attrs_idxs, num_attrs, fail_idx, stream in calls:
        assert (attrs, attrs_idxs, num_attrs, stream) == (None, None, 0, STREAM)
        assert fail_idx == ("byref", "c_ulong")


def test_rocm_before_7_1_falls_back_to_a_memcpy_loop():
    lib = FakeLib(60400000, HIP_SYMBOLS)
    runtime = rocm.HipRuntime(lib=lib)
    assert not runtime.has_batch
    runtime.memcpy_batch(batch(5), STREAM)
    calls = [args for name, args in lib.calls if name == "hipMemcpyAsync"]
    assert len(calls) == 5 and calls[0][2:] == [64, MEMCPY_DEFAULT, STREAM]


def test_rocm_missing_hip_python_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)
    with pytest.raises(base.BackendUnavailable, match=r"pip install 'portable-kv\[rocm\]'"):
        rocm.bindings()


def test_rocm_missing_runtime_library(monkeypatch):
    monkeypatch.setattr(rocm, "library_path", lambda stem: None)
    monkeypatch.setattr(rocm.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError(f"{path}: cannot open shared object file")))
    with pytest.raises(base.BackendUnavailable, match="libamdhip64.*install ROCm"):
        rocm.HipRuntime()


def test_rocm_versioned_library_names_are_given_to_hip_python(monkeypatch, tmp_path):
    install_fake_hip(monkeypatch)
    monkeypatch.setattr(rocm, "library_path", lambda stem: f"/opt/x/{stem}.so.7")
    rocm.bindings()
    assert sys.modules["hip.chip"].DLL == "/opt/x/libamdhip64.so.7"
    assert sys.modules["hip.chiprtc"].DLL == "/opt/x/libhiprtc.so.7"


def test_rocm_compile_failure_and_unknown_arch_name_the_cause(monkeypatch, tmp_path):
    install_fake_hip(monkeypatch, fail_log="error: unknown target ID 'gfx1337'")
    hiprtc = sys.modules["hip.hiprtc"]
    with pytest.raises(base.BackendUnavailable, match="(?s)hiprtc failed to compile kv_copy.hip for gfx1337.*unknown target"):
        rocm.hiprtc_compile(hiprtc, "gfx1337")


def test_rocm_without_any_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(rocm.shutil, "which", lambda name: None)
    monkeypatch.setattr(rocm, "find_bitcode_dir", lambda: None)
    monkeypatch.delenv("PORTABLE_KV_CLANG", raising=False)
    with pytest.raises(base.BackendUnavailable, match="no HIP compiler found.*apt-get install clang-19"):
        rocm.clang_build(tmp_path, ("gfx942",))


@pytest.mark.parametrize("version,args", [(12080, 9), (12090, 9), (13000, 8), (13020, 8)])
def test_cuda_batch_signature_follows_the_runtime_version(version, args):
    lib = FakeLib(version, CUDART_SYMBOLS)
    runtime = cuda.CudaRuntime(lib=lib)
    runtime.memcpy_batch(batch(3), STREAM)
    (name, call), = lib.calls
    assert name == "cudaMemcpyBatchAsync" and len(call) == args and call[3] == 3 and call[-1] == STREAM
    assert call[6] == 1, "one attribute entry (srcAccessOrder = stream) for every copy"
    assert runtime.attrs.src_access_order == cuda.SRC_ACCESS_ORDER_STREAM


def test_cuda_before_12_8_falls_back_to_a_memcpy_loop():
    lib = FakeLib(12040, CUDART_SYMBOLS)
    runtime = cuda.CudaRuntime(lib=lib)
    runtime.memcpy_batch(batch(4), STREAM)
    assert [name for name, _ in lib.calls] == ["cudaMemcpyAsync"] * 4


def test_cuda_missing_binding_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(base.BackendUnavailable, match=r"pip install 'portable-kv\[cuda\]'"):
        cuda.bindings()


def test_nvrtc_failure_carries_the_log():
    class FailingNvrtc:
        def nvrtcCreateProgram(self, *a):
            return (0, "p")

        def nvrtcCompileProgram(self, *a):
            return (6,)

        def nvrtcGetProgramLogSize(self, p):
            return (0, 24)

        def nvrtcGetProgramLog(self, p, buf):
            # The real binding writes into the bytes object it is given.
            ctypes.memmove(ctypes.c_char_p(buf), b"error: unknown sm_1000  ", len(buf))
            return (0,)

        def nvrtcDestroyProgram(self, p):
            return (0,)

    with pytest.raises(base.BackendUnavailable, match="(?s)NVRTC failed to compile kv_copy.cu for sm_1000.*unknown sm_1000"):
        cuda.nvrtc_compile(FailingNvrtc(), "sm_1000")


def test_nvcc_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda.shutil, "which", lambda name: None)
    with pytest.raises(base.BackendUnavailable, match="nvcc was not found"):
        cuda.nvcc_build(tmp_path)


def test_split_even_covers_every_descriptor_once():
    b = batch(1001)
    pieces = dma.split_even(b, 3)
    assert len(pieces) == 3 and sum(len(p) for p in pieces) == 1001
    assert np.array_equal(np.concatenate([p.dst for p in pieces]), b.dst)
    assert dma.split_even(batch(3), 2)[0] is not None and len(dma.split_even(batch(3), 2)) == 1


@pytest.mark.parametrize("module,lib_version,symbols,prefix", [
    (cuda, 13000, CUDART_SYMBOLS + ("cudaHostRegister", "cudaHostGetDevicePointer", "cudaHostUnregister"), "cuda"),
    (rocm, 70200000, HIP_SYMBOLS + ("hipHostRegister", "hipHostGetDevicePointer", "hipHostUnregister"), "hip"),
])
def test_host_registration_is_portable_and_mapped(module, lib_version, symbols, prefix):
    lib = FakeLib(lib_version, symbols)
    runtime = module.CudaRuntime(lib=lib) if prefix == "cuda" else module.HipRuntime(lib=lib)
    runtime.register_host(1 << 20, 4096)
    runtime.unregister_host(1 << 20)
    names = [name for name, _ in lib.calls if "Host" in name]
    assert names == [f"{prefix}HostRegister", f"{prefix}HostGetDevicePointer", f"{prefix}HostUnregister"]
    (_, register_args), = [c for c in lib.calls if c[0] == f"{prefix}HostRegister"]
    assert register_args == [1 << 20, 4096, 3]


def test_one_typed_error_carries_the_call_code_and_driver_name():
    class Enum(int):
        name = "CUDA_ERROR_INVALID_VALUE"

    with pytest.raises(DeviceError, match=r"cuModuleLoadData failed: CUDA_ERROR_INVALID_VALUE \(1\)") as raised:
        check((Enum(1), None), "cuModuleLoadData")
    assert (raised.value.call, raised.value.code, raised.value.name) == ("cuModuleLoadData", 1, "CUDA_ERROR_INVALID_VALUE")
    assert isinstance(raised.value, RuntimeError) and check((0, 7), "x") == 7
    hip = rocm.HipRuntime(lib=FakeLib(70200000, HIP_SYMBOLS, failing={"hipModuleLaunchKernel": 98}))
    with pytest.raises(DeviceError) as raised:
        hip.launch(0x1010, 1, ka.BLOCK, 0, STREAM)
    assert (raised.value.call, raised.value.code, raised.value.name) == ("hipModuleLaunchKernel", 98, "fakeError")
    cudart = cuda.CudaRuntime(lib=FakeLib(13000, CUDART_SYMBOLS, failing={"cudaMemcpyBatchAsync": 1}))
    with pytest.raises(DeviceError, match="cudaMemcpyBatchAsync failed: fakeError"):
        cudart.memcpy_batch(batch(2), STREAM)


def test_the_vendor_runtimes_are_twins():
    """The same methods in the same order (the bindings' names aside: driver/nvrtc, hip/hiprtc)."""
    def methods(cls):
        return [name for name, value in vars(cls).items() if callable(value)]

    assert methods(cuda.CudaRuntime) == methods(rocm.HipRuntime)
    assert not set(vars(cuda.CudaBackend)) - {"name", "vendor", "unavailable_reason", "__init__", "__module__", "__doc__", "__qualname__", "__firstlineno__", "__static_attributes__", "__abstractmethods__", "_abc_impl"}
