"""Pools past 2^31 and 2^32 bytes: every offset a mover computes is 64-bit.

A host pool's byte (and access-word) offsets pass 2^31 long before the pool
ends: in layer_first, layer * host_layer does for the last layer of a 4 GB
pool.  One-byte elements with 3-byte K rows force one-byte accesses, so word
offsets equal byte offsets.  The host pool is allocated and never filled:
memory is committed only where a transfer writes, so a 7 GB pool costs a few
pages.  The moved slots are compared with the contract (kvspec.host_row).
"""

from __future__ import annotations

import pytest
import torch
from kvspec import bits, host_row

import portable_kv as pk
from portable_kv.layout import LAYOUTS

LAYERS, PAGE, K_DIM, V_DIM = 4, 2, 3, 1
TOKEN_BYTES = LAYERS * (K_DIM + V_DIM)  # uint8, one head each
# Host tokens putting the last K offset past the bound in every layout: in
# layer_first the last layer starts at 3/4 of the K buffer, in the page-major
# layouts the last token sits at its end.
WIDE = {"2^31": (2**31 * 4 // 3) // K_DIM // LAYERS + 64, "2^32": (2**32 * 4 // 3) // K_DIM // LAYERS + 64}


@pytest.mark.parametrize("bound", WIDE, ids=str)
@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_last_slots_of_a_wide_pool(backend, layout, io, bound):
    if io not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no {io} io backend")
    host_tokens = WIDE[bound]
    dev = pk.DeviceKVPool(LAYERS, 16, PAGE, 1, K_DIM, V_DIM, v_heads=1, dtype=torch.uint8)
    host = pk.AsymmetricHostPool(dev, host_size_gb=host_tokens * TOKEN_BYTES / 1e9, layout=layout, io_backend=io)
    try:
        assert host.k_buffer.numel() > 2**31 * (2 if bound == "2^32" else 1) * 3 // 4
        gen = torch.Generator().manual_seed(11)
        for t in dev.k_buffer + dev.v_buffer:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen).to(t.device))
        last = host.size - 2 * PAGE  # the last two pages
        host_idx = torch.arange(last, host.size)
        src = torch.tensor([6, 7, 0, 1]).to(dev.device)
        host.backup_from_device_all_layer(dev, host_idx, src)
        backend.synchronize()
        for layer in range(LAYERS):
            for h, d in zip(host_idx.tolist(), src.tolist()):
                assert torch.equal(bits(host_row(host.k_buffer, layout, PAGE, h, layer)), bits(dev.k_buffer[layer][d])), f"K token {h} layer {layer}"
                assert torch.equal(bits(host_row(host.v_buffer, layout, PAGE, h, layer)), bits(dev.v_buffer[layer][d])), f"V token {h} layer {layer}"
        dst = torch.tensor([10, 11, 12, 13]).to(dev.device)
        for t in dev.k_buffer + dev.v_buffer:
            t[dst] = 0
        host.load_to_device_per_layer(dev, host_idx, dst, LAYERS - 1)
        backend.synchronize()
        assert torch.equal(bits(dev.k_buffer[LAYERS - 1][dst]), bits(dev.k_buffer[LAYERS - 1][src]))
        assert torch.equal(bits(dev.v_buffer[LAYERS - 1][dst]), bits(dev.v_buffer[LAYERS - 1][src]))
        assert not bits(dev.k_buffer[0][dst]).any(), "a per-layer load of the last layer wrote layer 0"
    finally:
        host.close()
