"""The conformance suite: every backend x pool kind x layout x io backend x dtype, one specification.

It runs unchanged on every backend that registers itself (backends.available()), over
MHA pools (K and V) and MLA pools (one latent buffer) alike.
"""

from __future__ import annotations

import pytest
import torch
from kvspec import (
    DTYPES,
    LAYOUTS,
    TOKEN_LAYOUTS,
    bits,
    device_buffers,
    device_pool,
    every_tensor,
    host_buffers,
    host_pool,
    host_row,
    page_tokens,
    pool_layouts,
    randomize,
)

IOS = ("kernel", "direct", "bulk")


def make_pools(backend, kind, layout, io, dtype=torch.bfloat16, *, layers=3, tokens=128, page_size=8, ratio=2.0, **geometry):
    if io not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no {io} io backend")
    dev = device_pool(kind, layers, tokens, page_size, dtype, **geometry)
    host = host_pool(dev, host_to_device_ratio=ratio, layout=layout, io_backend=io)
    return dev, host


def fill(dev, host, gen):
    for t in every_tensor(dev, host):
        randomize(t, gen)


def expect_host_rows(host, dev, host_idx, dev_idx, layers):
    """Each host token's rows equal the device token it came from, buffer by buffer (K and V separately)."""
    for n, (buffer, device) in enumerate(zip(host_buffers(host), device_buffers(dev))):
        for layer in layers:
            for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
                assert torch.equal(bits(host_row(buffer, host.layout, host.page_size, h, layer)), bits(device[layer][d])), f"buffer {n} token {h} layer {layer}"


def untouched_host_tokens(host, moved, before, layers):
    """No host token outside `moved` changed, in any layer."""
    moved = set(moved.tolist())
    for t in range(0, host.size, max(1, host.size // 64)):
        if t in moved:
            continue
        for layer in layers:
            for buffer, old in zip(host_buffers(host), before):
                assert torch.equal(bits(host_row(buffer, host.layout, host.page_size, t, layer)), bits(host_row(old, host.layout, host.page_size, t, layer)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("kind, layout", pool_layouts())
def test_split_kv_roundtrip(backend, kind, layout, io, dtype, gen):
    dev, host = make_pools(backend, kind, layout, io, dtype)
    fill(dev, host, gen)
    P, L = host.page_size, host.layer_num
    src = page_tokens(torch.randperm(dev.size // P, generator=gen)[:6], P)
    host_idx = page_tokens(torch.randperm(host.page_num, generator=gen)[:6], P)
    dst = page_tokens(torch.randperm(dev.size // P, generator=gen)[:6], P)
    original = [[b.clone() for b in layers] for layers in device_buffers(dev)]
    host_before = [b.clone() for b in host_buffers(host)]

    host.backup_from_device_all_layer(dev, host_idx, src.to(dev.device))
    backend.synchronize()
    expect_host_rows(host, dev, host_idx, src, range(L))
    untouched_host_tokens(host, host_idx, host_before, range(L))

    for b in every_tensor(dev):
        b.zero_()
    for layer in range(L):
        host.load_to_device_per_layer(dev, host_idx, dst.to(dev.device), layer)
    backend.synchronize()
    others = torch.ones(dev.size, dtype=torch.bool)
    others[dst] = False
    for n, (device, before) in enumerate(zip(device_buffers(dev), original)):
        for layer in range(L):
            assert torch.equal(bits(device[layer][dst]), bits(before[layer][src])), f"buffer {n} layer {layer}"
            assert not bits(device[layer][others.to(dev.device)]).any(), f"a token of buffer {n} outside the targets changed"
    host.close()


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("kind, layout", pool_layouts())
def test_per_layer_backup_all_layer_load(backend, kind, layout, io, gen):
    dev, host = make_pools(backend, kind, layout, io)
    fill(dev, host, gen)
    P = host.page_size
    src = page_tokens(torch.tensor([3, 0, 7]), P)
    host_idx = page_tokens(torch.tensor([20, 5, 11]), P)
    dst = page_tokens(torch.tensor([1, 9, 4]), P)
    original = [[b.clone() for b in layers] for layers in device_buffers(dev)]
    for layer in reversed(range(host.layer_num)):
        host.backup_from_device_per_layer(dev, host_idx, src, layer)
    host.load_to_device_all_layer(dev, host_idx, dst)
    backend.synchronize()
    for device, before in zip(device_buffers(dev), original):
        for layer in range(host.layer_num):
            assert torch.equal(bits(device[layer][dst]), bits(before[layer][src]))


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("kind, layout", pool_layouts(TOKEN_LAYOUTS))
def test_token_granular(backend, kind, layout, io, gen):
    """Token layouts move any tokens: unaligned, in random order, across page boundaries."""
    dev, host = make_pools(backend, kind, layout, io)
    fill(dev, host, gen)
    def with_run(size, run):  # a consecutive run first, then random distinct tokens
        rest = torch.randperm(size, generator=gen)
        rest = rest[(rest < run[0]) | (rest > run[-1])]
        return torch.cat((run, rest))[:37]

    host_idx = with_run(host.size, torch.arange(6, 11))  # the run crosses a page boundary (page 8)
    dev_idx = with_run(dev.size, torch.arange(60, 65))
    layer = 1
    host_before = [b.clone() for b in host_buffers(host)]
    host.backup_from_device_per_layer(dev, host_idx.int(), dev_idx, layer)
    backend.synchronize()
    expect_host_rows(host, dev, host_idx, dev_idx, [layer])
    untouched_host_tokens(host, host_idx, host_before, [0, 2])


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_different_head_counts(backend, layout, io, gen):
    """8 K heads and 2 V heads (GQA-like asymmetric pools)."""
    dev, host = make_pools(backend, "MHA", layout, io, k_heads=8, k_dim=16, v_heads=2, v_dim=8)
    fill(dev, host, gen)
    P = host.page_size
    src, host_idx = page_tokens(torch.tensor([2, 5]), P), page_tokens(torch.tensor([30, 1]), P)
    host.backup_from_device_all_layer(dev, host_idx, src)
    backend.synchronize()
    expect_host_rows(host, dev, host_idx, src, range(host.layer_num))
    assert host.k_buffer.shape[-1] == 16 and host.v_buffer.shape[-1] == 8
