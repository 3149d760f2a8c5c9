"""Real components for the storage tests: a loopback mooncake_master started here, stopped by its PID."""

from __future__ import annotations

import pytest
import torch
from storekit import MOONCAKE_MISSING, make_host, open_store

from portable_kv.storage.master import MooncakeMaster


@pytest.fixture(scope="module")
def master():
    """One master for a module's tests; they use unique keys, since objects outlive a test."""
    if MOONCAKE_MISSING:
        pytest.skip("Mooncake is not installed")
    with MooncakeMaster() as running:
        yield running
    assert running.process is None


@pytest.fixture
def own_master():
    """A master this test may kill."""
    if MOONCAKE_MISSING:
        pytest.skip("Mooncake is not installed")
    running = MooncakeMaster().start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    """`opened(kind, layout, dtype, pool)`: a host pool of kind `pool` (MHA or MLA) with a store over it, kept for
    the module (a Mooncake client takes ~1 s to close)."""
    cache, masters = {}, []

    def get(kind: str, layout: str = "page_first_direct", dtype: torch.dtype = torch.bfloat16, pool: str = "MHA"):
        if kind == "mooncake" and not masters:
            masters.append(MooncakeMaster().start())
        if (kind, layout, dtype, pool) not in cache:
            _, host = make_host(layout, dtype, pool=pool)
            cache[kind, layout, dtype, pool] = host, open_store(kind, host, tmp_path_factory.mktemp("pages"), masters[0] if kind == "mooncake" else None)
        return cache[kind, layout, dtype, pool]

    yield get
    for host, store in cache.values():
        store.close()
        host.close()
    for running in masters:
        running.stop()


# Each store in turn: a test that takes `kind` runs against both, alike.
STORES = ["local", pytest.param("mooncake", marks=pytest.mark.skipif(MOONCAKE_MISSING, reason="Mooncake is not installed"))]


@pytest.fixture(params=STORES)
def kind(request):
    return request.param


@pytest.fixture
def store_master(kind, request):
    return request.getfixturevalue("master") if kind == "mooncake" else None
