"""Prepared transfers (`host.prepare`) move what the per-call API moves, on every backend x pool
kind x layout x io path; they keep their own indices, refuse bad input at prepare(), and the
pool's stats() count what they moved."""

from __future__ import annotations

import pytest
import torch
from kvspec import bits, device_buffers, device_pool, every_tensor, host_buffers, host_pool, page_tokens, pool_layouts, randomize
from test_transfers import expect_host_rows, untouched_host_tokens

P = 8


def pools(backend, kind, layout, io, gen):
    if io not in backend.io_backends:
        pytest.skip(f"backend {backend.name} has no {io} io path")
    dev = device_pool(kind, 3, 128, P)
    host = host_pool(dev, layout=layout, io_backend=io)
    for t in every_tensor(dev, host):
        randomize(t, gen)
    return dev, host


@pytest.mark.parametrize("io", ["kernel", "direct", "staged", "auto", "bulk"])
@pytest.mark.parametrize("kind,layout", pool_layouts())
def test_prepared_backup_and_loads_are_bit_exact(backend, gen, kind, layout, io):
    dev, host = pools(backend, kind, layout, io, gen)
    host_idx = page_tokens(torch.tensor([5, 0, 9]), P)
    dev_idx = page_tokens(torch.tensor([2, 11, 7]), P).to(dev.device)
    before = [bits(b).clone() for b in host_buffers(host)]
    plan = host.prepare(dev, host_idx, dev_idx)
    plan.backup()
    backend.synchronize()
    expect_host_rows(host, dev, host_idx, dev_idx.cpu(), range(3))
    untouched_host_tokens(host, host_idx, before, range(3))
    other = page_tokens(torch.tensor([14, 3, 12]), P).to(dev.device)
    load = host.prepare(dev, host_idx, other)
    for layer in (2, 0):
        load.load(layer)
    backend.synchronize()
    for buffer in device_buffers(dev):
        for layer in (0, 2):
            assert torch.equal(bits(buffer[layer][other]), bits(buffer[layer][dev_idx])), f"layer {layer}"
        assert not torch.equal(bits(buffer[1][other]), bits(buffer[1][dev_idx])), "layer 1 was not loaded"
    load.load_all()
    backend.synchronize()
    for buffer in device_buffers(dev):
        assert torch.equal(bits(buffer[1][other]), bits(buffer[1][dev_idx]))
    stats = host.stats()
    per_layer = sum(t[0].nbytes for t in device_buffers(dev)) // 128 * host_idx.numel()
    row = stats["load"][io]
    assert (row["calls"], row["bytes"], row["device_calls"]) == (3, 5 * per_layer, 3), "every call read back once synchronized"
    assert row["seconds"] > 0 and row["device_seconds"] > 0
    assert stats["backup"][io]["calls"] == 1 and stats["backup"][io]["bytes"] == 3 * per_layer
    assert stats["last_error"] is None
    host.close()
    with pytest.raises(ValueError, match="closed"):
        load.load(0)


def test_a_plan_moves_the_indices_it_was_given(backend, gen):
    """The plan keeps its own copy: the caller may reuse its tensors (in place, under inference
    mode too) without changing what the plan moves."""
    dev, host = pools(backend, "MHA", "page_first_direct", backend.io_backends[0], gen)
    with torch.inference_mode():
        host_idx, dev_idx = page_tokens(torch.tensor([1, 2]), P), page_tokens(torch.tensor([3, 4]), P)
    plan = host.prepare(dev, host_idx, dev_idx)
    with torch.inference_mode():
        dev_idx += 8 * P  # the caller's tensor now names other slots
    plan.backup()
    backend.synchronize()
    expect_host_rows(host, dev, host_idx, page_tokens(torch.tensor([3, 4]), P), range(3))


@pytest.mark.parametrize("io", ["kernel", "bulk"])
def test_bad_input_is_refused_at_prepare_and_recorded(backend, gen, io):
    dev, host = pools(backend, "MHA", "page_first_direct", io, gen)
    with pytest.raises(ValueError, match="host_indices.*< 256"):
        host.prepare(dev, page_tokens(torch.tensor([40]), P), page_tokens(torch.tensor([1]), P))
    assert host.stats()["last_error"].startswith("ValueError: host_indices")
    with pytest.raises(ValueError, match="io_backend"):
        host.prepare(dev, page_tokens(torch.tensor([1]), P), page_tokens(torch.tensor([1]), P), io_backend="dma")
    plan = host.prepare(dev, page_tokens(torch.tensor([1]), P), page_tokens(torch.tensor([1]), P))
    for bad, error in ((3, ValueError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(error, match="layer_id"):
            plan.load(bad)
    assert host.stats()["load"] == {}, "nothing moved"


def test_stats_say_which_path_auto_took_and_why(backend, gen, monkeypatch):
    from portable_kv.io import auto

    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 1 << 40)
    dev, host = pools(backend, "MHA", "page_first_direct", "auto", gen)
    host.load_to_device_per_layer(dev, page_tokens(torch.tensor([1]), P), page_tokens(torch.tensor([2]), P), 0)
    kernel = "indexing" if backend.name == "cpu" else "kernel"  # the cpu backend's kernel path is torch indexing
    assert host.stats()["paths"]["auto"][kernel]["calls"] == 1
    assert "latency" in host.stats()["paths"]["auto"][kernel]["reason"]
