import os

import pytest
import torch

from portable_kv import backends

try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=int(os.environ.get("PORTABLE_KV_EXAMPLES", "40")), deadline=None)
    settings.load_profile("ci")
except ImportError:
    pass


@pytest.fixture(params=backends.available())
def backend(request):
    """Each usable backend in turn, bound for the test, then the import-time one restored."""
    before = backends.current()
    bound = backends.use(request.param)
    yield bound
    bound.synchronize()
    backends.use(before.name)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def simulated(monkeypatch):
    """The simulated GPU backend (tests/fake_gpu.py: real kernel arguments, a Python model of
    the kernel, 2-D copies row by row) bound for the test."""
    monkeypatch.setitem(backends._REGISTRY, "simulated", "fake_gpu:SimulatedGpuBackend")
    backends._instances.pop("simulated", None)
    before = backends.current().name
    yield backends.use("simulated")
    backends.use(before)


@pytest.fixture
def fake_rocm_bound(monkeypatch, tmp_path):
    """A RocmBackend over the fake HIP runtime (fake_runtimes.py) bound for the test: (backend, the fake library)."""
    from fake_runtimes import fake_rocm_backend

    from portable_kv.backends import rocm

    backend, _, _, lib = fake_rocm_backend(monkeypatch, tmp_path)
    monkeypatch.setitem(backends._instances, "rocm", backend)
    monkeypatch.setattr(rocm.RocmBackend, "unavailable_reason", classmethod(lambda cls: None))
    before = backends.current().name
    backends.use("rocm")
    yield backend, lib
    backends.use(before)


@pytest.fixture
def clean_env(monkeypatch):
    """No PORTABLE_KV_* setting in the environment for the test: each one at its default."""
    from portable_kv import config

    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    return monkeypatch


@pytest.fixture
def cpu_backend():
    """The cpu backend bound for the test, the one bound before restored."""
    before = backends.current().name
    yield backends.use("cpu")
    backends.use(before)
