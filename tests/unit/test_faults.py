"""Faults give one clear error naming the cause and the fix, and leave the package importable."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import portable_kv as pk
from portable_kv import backends
from portable_kv.backends import base, cuda


def test_pinning_refused_is_a_memory_error_with_the_fix(monkeypatch):
    backend = backends.current()

    def refuse(shape, dtype, pin):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(backend, "allocate_host", refuse)
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(MemoryError, match="page-locking.*refused.*ulimit -l"):
        pk.AsymmetricHostPool(dev, layout="layer_first", io_backend=backend.io_backends[0])


def test_host_memory_checked_with_a_reserve_before_allocating(monkeypatch):
    from portable_kv import host_memory

    monkeypatch.setattr(host_memory, "_available_host_memory", lambda: 3 << 30)
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(MemoryError, match="2.00 GB requested but 3.22 GB available with 2.15 GB kept in reserve"):
        pk.AsymmetricHostPool(dev, host_size_gb=2.0, io_backend=backends.current().io_backends[0])


def test_missing_cuda_runtime_library(monkeypatch):
    monkeypatch.setattr(cuda, "find_loaded_library", lambda stem: None)
    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError(f"{path}: cannot open shared object file")))
    with pytest.raises(base.BackendUnavailable, match="CUDA runtime library could not be loaded.*install a CUDA build of torch"):
        cuda.CudaRuntime()


def test_importable_without_any_vendor_binding():
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['hip'] = None; sys.modules['triton'] = None\n"
        "import portable_kv, torch\n"
        "print(portable_kv.backends.current().name, portable_kv.backends.available())\n"
        "print(portable_kv.backends.unavailable_reason('triton'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("cpu") and "triton" in second


def test_gpu_seen_but_backend_unusable_falls_back_with_a_warning(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_current", None)
    monkeypatch.setattr(backends, "detect", lambda: "cuda")
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name == "cpu" else "no CUDA GPU is visible")
    monkeypatch.setattr(backends, "_instances", {})
    with pytest.warns(UserWarning, match="backend 'cuda' cannot run here.*falling back to the cpu backend"):
        assert backends.current().name == "cpu"
