"""Fuzzing invalid input: every drawn bad call raises the documented error and leaves
both pools byte-identical, on every backend and pool kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvspec import KIND_LAYOUTS, assert_same, device_pool, every_tensor, host_pool, randomize, snapshot

from portable_kv import backends
from portable_kv.layout import PAGE_LAYOUTS

P, TOKENS = 4, 32

MUTATIONS = {
    "host out of range": (ValueError, lambda h, d, g: (h.clone().index_fill_(0, torch.tensor([g]), 2 * TOKENS + 7), d)),
    "device out of range": (ValueError, lambda h, d, g: (h, d.clone().index_fill_(0, torch.tensor([g]), TOKENS + g))),
    "negative": (ValueError, lambda h, d, g: (h.clone().index_fill_(0, torch.tensor([g]), -1 - g), d)),
    "length": (ValueError, lambda h, d, g: (h, d[: g])),
    "dtype": (TypeError, lambda h, d, g: (h.to(torch.int16), d)),
    "float": (TypeError, lambda h, d, g: (h, d.double())),
    "2-D": (ValueError, lambda h, d, g: (h.view(1, -1), d)),
    "duplicate destination": (ValueError, lambda h, d, g: (h, d.clone().index_fill_(0, torch.tensor([g]), int(d[(g + P) % len(d)])))),
}


@st.composite
def bad_calls(draw):
    kind = draw(st.sampled_from(("MHA", "MLA")))
    layout = draw(st.sampled_from(KIND_LAYOUTS[kind]))
    pages = draw(st.integers(2, 4))
    dev_pages = draw(st.permutations(range(TOKENS // P)))[:pages]
    host_pages = draw(st.permutations(range(2 * TOKENS // P)))[:pages]
    offsets = torch.arange(P)
    h = (torch.tensor(host_pages)[:, None] * P + offsets).reshape(-1)
    d = (torch.tensor(dev_pages)[:, None] * P + offsets).reshape(-1)
    mutation = draw(st.sampled_from(sorted(MUTATIONS) + (["misaligned"] if layout in PAGE_LAYOUTS else [])))
    g = draw(st.integers(0, len(h) - 1))
    if mutation == "misaligned":
        error, (h, d) = ValueError, (h + 1, d)
    else:
        error, mangle = MUTATIONS[mutation]
        h, d = mangle(h, d, g)
    op = draw(st.sampled_from(["load_to_device_per_layer", "load_to_device_all_layer", "backup_from_device_per_layer", "backup_from_device_all_layer"]))
    if mutation == "duplicate destination" and op.startswith("backup"):
        h, d = d, h  # on a backup the host side is the destination
        h = h % (2 * TOKENS)
    return kind, layout, mutation, op, h, d, error


@pytest.mark.parametrize("name", backends.available())
def test_invalid_calls_change_nothing(name):
    @given(bad_calls())
    def check(case):
        kind, layout, mutation, op, h, d, error = case
        before_backend = backends.current().name
        backends.use(name)
        try:
            dev = device_pool(kind, 2, TOKENS, P, torch.float16, k_heads=2, k_dim=8, v_heads=2, v_dim=4, latent_dim=12)
            host = host_pool(dev, layout=layout, io_backend=backends.current().io_backends[0])
            gen = torch.Generator().manual_seed(0)
            for t in every_tensor(dev, host):
                randomize(t, gen)
            before = snapshot(dev, host)
            args = (dev, h, d, 1) if op.endswith("per_layer") else (dev, h, d)
            with pytest.raises(error):
                getattr(host, op)(*args)
            host.backend.synchronize()
            assert_same(before, snapshot(dev, host))
        finally:
            backends.use(before_backend)

    check()
