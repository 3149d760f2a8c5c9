"""Indices as engines really pass them: any view (strided, offset, expanded), either
device, int32 or int64, produced on a busy stream, rewritten in place behind torch's
back.  What moves is what the values say, checked against an oracle written from the
docs' shape table, with both pools compared byte for byte outside the destination."""

from __future__ import annotations

import gc
import math
import weakref
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvspec import (
    KIND_LAYOUTS,
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

import portable_kv as pk
from portable_kv.layout import PAGE_LAYOUTS

VIEWS = ("contiguous", "strided", "offset", "expanded", "int32")


def as_view(values: torch.Tensor, view: str, device: torch.device) -> torch.Tensor:
    """`values` (int64, CPU) as the given kind of tensor view on `device`."""
    values = values.to(device)
    if view == "strided":  # a column of a 2-D tensor, as an engine's (token, field) table gives
        return torch.stack([values, torch.full_like(values, -7)], 1)[:, 0]
    if view == "offset":
        return torch.cat([torch.full((5,), -9, dtype=torch.int64, device=device), values])[5:]
    if view == "expanded":  # stride 0: every position reads the first value
        return values[:1].expand(values.numel())
    if view == "int32":
        return values.to(torch.int32)
    return values.clone()


def expected_after(dev, host, host_idx, dev_idx, layers, to_device):
    """The oracle: each (token, layer) row copied one by one, from the docs' shape table."""
    P = host.page_size
    devs = [[bits(t) for t in layers] for layers in device_buffers(dev)]
    hosts = [bits(t) for t in host_buffers(host)]
    for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
        for layer in layers:
            for dev_side, host_side in zip(devs, hosts):
                if to_device:
                    dev_side[layer][d] = host_row(host_side, host.layout, P, h, layer).to(dev_side[layer].device)
                else:
                    host_row(host_side, host.layout, P, h, layer).copy_(dev_side[layer][d].cpu())
    return [t for side in devs for t in side] + hosts


def state(dev, host):
    return [bits(t) for t in every_tensor(dev, host)]


def busy_stream_indices(values: torch.Tensor, view: str, device: torch.device) -> torch.Tensor:
    """Indices written by the current stream after a long kernel: not yet there when the call starts."""
    out = torch.empty_like(values, device=device)
    torch.cuda._sleep(50_000_000)
    out.copy_(values.to(device, non_blocking=True))
    return as_view(out, view, device) if view != "contiguous" else out


@st.composite
def engine_calls(draw, gpu: bool):
    page_size = draw(st.sampled_from([1, 4, 8]))
    pages = draw(st.integers(2, 5))
    kind = draw(st.sampled_from(("MHA", "MLA")))
    layout = draw(st.sampled_from(KIND_LAYOUTS[kind]))
    n_pages = draw(st.integers(1, pages))
    dev_pages = torch.tensor(draw(st.permutations(range(pages)))[:n_pages])
    host_pages = torch.tensor(draw(st.permutations(range(2 * pages)))[:n_pages])
    host_idx, dev_idx = page_tokens(host_pages, page_size), page_tokens(dev_pages, page_size)
    to_device = draw(st.booleans())
    source_view = draw(st.sampled_from(VIEWS if layout not in PAGE_LAYOUTS else [v for v in VIEWS if v != "expanded"]))
    destination_view = draw(st.sampled_from([v for v in VIEWS if v != "expanded"]))
    devices = ["cpu", "gpu"] if gpu else ["cpu"]
    host_device, dev_device = draw(st.sampled_from(devices)), draw(st.sampled_from(devices))
    busy = gpu and draw(st.booleans())
    all_layers = draw(st.booleans())
    return kind, page_size, pages, layout, host_idx, dev_idx, to_device, source_view, destination_view, host_device, dev_device, busy, all_layers, draw(st.integers(0, 2**31))


def _run_engine_call(backend, io, call):
    kind, page_size, pages, layout, host_idx, dev_idx, to_device, source_view, destination_view, host_device, dev_device, busy, all_layers, seed = call
    gen = torch.Generator().manual_seed(seed)
    dev = device_pool(kind, 2, pages * page_size, page_size, torch.bfloat16, k_heads=2, k_dim=8, v_heads=2, v_dim=4, latent_dim=12)
    host = host_pool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io)
    for t in every_tensor(dev, host):
        randomize(t, gen)
    host_view, dev_view = (source_view, destination_view) if to_device else (destination_view, source_view)
    if host_view == "expanded":
        host_idx = host_idx[:1].expand(host_idx.numel()).clone()
    if dev_view == "expanded":
        dev_idx = dev_idx[:1].expand(dev_idx.numel()).clone()
    layers = range(2) if all_layers else range(1, 2)
    want = expected_after(dev, host, host_idx, dev_idx, layers, to_device)
    gpu = backend.device
    make = busy_stream_indices if busy else as_view
    h = make(host_idx, host_view, gpu if host_device == "gpu" else torch.device("cpu"))
    d = make(dev_idx, dev_view, gpu if dev_device == "gpu" else torch.device("cpu"))
    if to_device:
        (host.load_to_device_all_layer(dev, h, d) if all_layers else host.load_to_device_per_layer(dev, h, d, 1))
    else:
        (host.backup_from_device_all_layer(dev, h, d) if all_layers else host.backup_from_device_per_layer(dev, h, d, 1))
    backend.synchronize()
    for got, expected in zip(state(dev, host), want):
        assert torch.equal(got, expected)
    host.close()


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_any_index_view_moves_what_its_values_say(backend, io):
    if io not in backend.io_backends:
        pytest.skip(f"{backend.name} has no {io} path")
    gpu = backend.device.type != "cpu"

    @given(engine_calls(gpu))
    def check(call):
        _run_engine_call(backend, io, call)

    check()


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_cpu_indices_rewritten_through_numpy_are_never_served_stale(backend, io):
    """Writes through .numpy() or .data do not bump torch's version counter; the next call
    must still move the new slots, and refuse an out-of-range rewrite."""
    if io not in backend.io_backends:
        pytest.skip(f"{backend.name} has no {io} path")
    P = 4
    dev = pk.DeviceKVPool(2, 8 * P, P, 2, 8, 4, dtype=torch.float16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io)
    gen = torch.Generator().manual_seed(7)
    for t in list(dev.k_buffer) + list(dev.v_buffer):
        randomize(t, gen)
    host_idx = page_tokens(torch.tensor([1, 2]), P)
    dev_idx = page_tokens(torch.tensor([3, 4]), P)
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 0)
    host_idx.numpy()[:] = page_tokens(torch.tensor([6, 5]), P).numpy()  # same tensor, same version
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 0)
    backend.synchronize()
    for token, slot in zip(host_idx.tolist(), dev_idx.tolist()):
        assert torch.equal(bits(host_row(host.k_buffer, host.layout, P, token, 0)), bits(dev.k_buffer[0][slot].cpu()))
    host_idx.data[0] = 10_000  # out of range, written behind the version counter
    before = state(dev, host)
    with pytest.raises(ValueError, match="host_indices.*expected indices <"):
        host.backup_from_device_per_layer(dev, host_idx, dev_idx, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, state(dev, host)))


@pytest.mark.parametrize("kind", ("MHA", "MLA"))
@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_closed_and_dropped_pools_release_their_host_memory(backend, io, kind):
    if io not in backend.io_backends:
        pytest.skip(f"{backend.name} has no {io} path")
    dev = device_pool(kind, 2, 64, 4, torch.float16)
    idx = torch.arange(16)
    alive = []
    for i in range(24):
        host = host_pool(dev, layout="page_first_direct", io_backend=io)
        host.backup_from_device_all_layer(dev, idx, idx.to(dev.device))
        host.load_to_device_per_layer(dev, idx, idx.to(dev.device), 1)
        alive += [weakref.ref(buffer) for buffer in host_buffers(host)]
        if i % 2:
            host.close()
        del host
    backend.synchronize()
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0, "host buffers outlived their pools"


@pytest.mark.parametrize("kind, layout", pool_layouts())
@pytest.mark.parametrize("io", ["kernel", "direct", "staged", "auto"])
def test_close_gives_the_memory_back_while_the_pool_object_lives(backend, io, kind, layout):
    """Engines keep the pool object (controller, radix cache, storage backend all hold it)
    and call close() to give the memory back: nothing of the pool may keep a buffer alive."""
    if io not in backend.io_backends:
        pytest.skip(f"{backend.name} has no {io} path")
    dev = device_pool(kind, 2, 64, 4, torch.float16, device=backend.device)
    host = host_pool(dev, layout=layout, io_backend=io)
    idx = torch.arange(16)
    host.backup_from_device_all_layer(dev, idx, idx.to(dev.device))
    host.load_to_device_per_layer(dev, idx, idx.to(dev.device), 1)
    host.get_data_page(0)
    buffers = [weakref.ref(buffer) for buffer in host_buffers(host)]
    host.close()
    gc.collect()
    assert all(ref() is None for ref in buffers), "close() left the host buffers alive behind the pool object"
    with pytest.raises(ValueError, match="closed"):
        host.load_to_device_per_layer(dev, idx, idx.to(dev.device), 0)


@pytest.mark.parametrize("kind", ("MHA", "MLA"))
@pytest.mark.parametrize("io", ["kernel", "direct", "staged", "auto"])
def test_a_device_pool_the_engine_dropped_is_not_kept(backend, io, kind):
    """An engine that moves on to a new device pool (a resize, a restart of its model
    runner) gets the old one's memory back: nothing a host pool caches holds it."""
    if io not in backend.io_backends:
        pytest.skip(f"{backend.name} has no {io} path")
    old, new = (device_pool(kind, 2, 64, 4, torch.float16, device=backend.device) for _ in range(2))
    host = host_pool(old, host_to_device_ratio=1, layout="page_first_direct", io_backend=io)
    idx = torch.arange(0, 8)
    host.load_to_device_all_layer(old, idx, idx.to(backend.device))
    host.backup_from_device_per_layer(old, idx, idx.to(backend.device), 1)
    host.load_to_device_all_layer(new, idx, idx.to(backend.device))
    backend.synchronize()
    dropped = [weakref.ref(t) for t in every_tensor(old)]
    del old
    gc.collect()
    assert all(ref() is None for ref in dropped), "the host pool keeps a dropped device pool's buffers alive"
    host.close()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(host_to_device_ratio=math.nan), ValueError, "host_to_device_ratio: expected a finite number"),
        (dict(host_to_device_ratio=math.inf), ValueError, "host_to_device_ratio: expected a finite number"),
        (dict(host_to_device_ratio="2"), ValueError, "host_to_device_ratio: expected a finite number"),
        (dict(host_size_gb=-1.0), ValueError, "host_size_gb: expected >= 0"),
        (dict(host_size_gb=math.nan), ValueError, "host_size_gb: expected a finite number"),
        (dict(host_size_gb=1e-12), ValueError, "host_size_gb: .* holds no token"),
    ],
)
def test_sizes_are_checked_and_named(backend, kwargs, error, message):
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(error, match=message):
        pk.AsymmetricHostPool(dev, io_backend=backend.io_backends[0], **kwargs)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_dtypes_are_refused_at_construction(backend, dtype):
    """By the device pool itself, before a buffer is allocated, and by a host pool given an
    engine's own (duck-typed) pool of complex buffers."""
    with pytest.raises(TypeError, match="^dtype: .*complex"):
        pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=dtype, device=backend.device)
    buffers = ([torch.zeros(8, 1, 4, dtype=dtype, device=backend.device)], [torch.zeros(8, 1, 4, dtype=dtype, device=backend.device)])
    with pytest.raises(TypeError, match="^dtype: .*complex"):
        pk.DeviceKVPool.from_buffers(*buffers, 4)
    engine_pool = SimpleNamespace(k_buffer=buffers[0], v_buffer=buffers[1], page_size=4)
    for io in backend.io_backends:
        with pytest.raises(TypeError, match="dtype: .*complex"):
            pk.AsymmetricHostPool(engine_pool, io_backend=io)


def test_a_dtype_that_is_not_a_torch_dtype_is_named(backend):
    with pytest.raises(TypeError, match="^dtype: expected a torch.dtype, got 'bf16'"):
        pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype="bf16", device=backend.device)


def test_default_io_is_kernel(backend):
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    assert pk.AsymmetricHostPool(dev).io_backend == "kernel"
