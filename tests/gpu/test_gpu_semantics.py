"""GPU-only guarantees: kernel-side index checks, stream order, close(), threads.

Skipped (with the reason) where no CUDA/ROCm backend can run.
"""

from __future__ import annotations

import threading

import pytest
import torch
from kvspec import bits, page_tokens, randomize

import portable_kv as pk
from portable_kv import backends

GPU = [n for n in ("cuda", "rocm") if backends.unavailable_reason(n) is None]
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU backend: " + str(backends.unavailable_reason("cuda")))
P = 16


@pytest.fixture(params=GPU or ["none"])
def gpu(request):
    before = backends.current()
    yield backends.use(request.param)
    backends.use(before.name)


def pools(io="kernel", validate=True, tokens=1024, layers=4):
    dev = pk.DeviceKVPool(layers, tokens, P, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io, validate=validate)
    gen = torch.Generator().manual_seed(7)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


def test_out_of_range_indices_are_skipped_and_flagged(gpu):
    dev, host = pools(validate=False)
    before = [bits(t) for t in dev.k_buffer + dev.v_buffer]
    host_idx = page_tokens(torch.tensor([1, 2]), P)
    dev_idx = page_tokens(torch.tensor([3, 10**6]), P)  # the second page is far outside the pool
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="outside the pools"):
        host.load_to_device_per_layer(dev, host_idx[:P], dev_idx[:P], 0)
    after = [bits(t) for t in dev.k_buffer + dev.v_buffer]
    # The valid page arrived (K and V of layer 0); nothing else changed anywhere.
    assert torch.equal(after[0][3 * P : 4 * P], bits(host.k_buffer[1, 0]))
    assert torch.equal(after[dev.layer_num][3 * P : 4 * P], bits(host.v_buffer[1, 0]))
    untouched = torch.ones(dev.size, dtype=torch.bool)
    untouched[3 * P : 4 * P] = False
    for n, (a, b) in enumerate(zip(after, before)):
        if n % dev.layer_num == 0:
            assert torch.equal(a[untouched], b[untouched])
        else:
            assert torch.equal(a, b)
    # The flag was reset by the error: the next valid call goes through.
    host.load_to_device_per_layer(dev, host_idx[:P], dev_idx[:P], 0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_side_stream_then_event(gpu, io):
    dev, host = pools(io)
    host_idx, dev_idx = page_tokens(torch.arange(8), P), page_tokens(torch.arange(8, 16), P)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 2)
        done = torch.cuda.Event()
        done.record()
    torch.cuda.current_stream().wait_event(done)
    # The next kernel on the waiting stream sees the data (an exact integer checksum on the GPU).
    total = dev.k_buffer[2][dev_idx].view(torch.int16).long().sum()
    expected = host.k_buffer[:8, 2].reshape(-1, 4, 192).view(torch.int16).long().sum()
    assert int(total) == int(expected)


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_stream_order_kept(gpu, io):
    """A backup enqueued after a device write sees the write; a load after a zeroing overwrites it."""
    dev, host = pools(io)
    idx = page_tokens(torch.arange(4), P)
    dev.k_buffer[0][idx] = 1.0
    host.backup_from_device_per_layer(dev, idx, idx, 0)
    dev.k_buffer[0][idx] = 2.0
    host.load_to_device_per_layer(dev, idx, idx + 4 * P, 0)
    torch.cuda.synchronize()
    assert bool((dev.k_buffer[0][idx + 4 * P] == 1.0).all())


def test_close_waits_for_transfers(gpu):
    dev, host = pools("kernel", tokens=8192, layers=8)
    idx = page_tokens(torch.arange(256), P)
    host.backup_from_device_all_layer(dev, idx, idx)
    expected = bits(dev.k_buffer[7][idx])
    k_host = host.k_buffer
    host.close()  # must not return while the GPU still writes into k_host
    assert torch.equal(bits(k_host[:256, 7].reshape(-1, 4, 192)), expected)


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_two_threads_two_streams(gpu, io):
    dev, host = pools(io, tokens=2048)
    errors = []

    def worker(first_page):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for rep in range(20):
                    h = page_tokens(torch.arange(first_page, first_page + 8), P)
                    d = page_tokens(torch.arange(first_page, first_page + 8), P)
                    host.load_to_device_per_layer(dev, h, d, rep % 4)
            stream.synchronize()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in (0, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for layer in range(4):
        for first in (0, 40):
            idx = page_tokens(torch.arange(first, first + 8), P)
            got = bits(dev.k_buffer[layer][idx])
            want = bits(host.k_buffer[first : first + 8, layer].reshape(-1, 4, 192))
            assert torch.equal(got, want)


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_head"])
def test_direct_over_several_streams_moves_every_chunk(gpu, streams, layout):
    dev = pk.DeviceKVPool(3, 1024, P, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend="direct")
    gen = torch.Generator().manual_seed(streams)
    for t in list(dev.k_buffer) + list(dev.v_buffer):
        randomize(t, gen)
    saved, gpu.runtime.dma_streams = gpu.runtime.dma_streams, streams
    try:
        src = page_tokens(torch.randperm(64, generator=gen)[:40], P)
        host_idx = page_tokens(torch.randperm(128, generator=gen)[:40], P)
        dst = page_tokens(torch.randperm(64, generator=gen)[:40], P)
        original = [bits(t) for t in dev.k_buffer + dev.v_buffer]
        host.backup_from_device_all_layer(dev, host_idx, src)
        for t in dev.k_buffer + dev.v_buffer:
            t.zero_()
        host.load_to_device_all_layer(dev, host_idx, dst)
        torch.cuda.synchronize()
        for got, want in zip([bits(t) for t in dev.k_buffer + dev.v_buffer], original):
            assert torch.equal(got[dst], want[src])
    finally:
        gpu.runtime.dma_streams = saved
