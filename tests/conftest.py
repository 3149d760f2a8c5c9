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
