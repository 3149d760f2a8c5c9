"""The staged io path on a GPU: bit-exact against the CPU oracle, pipelined over many
chunks, both directions at once on two streams, staging memory released by close().

Skipped (with the reason) where no GPU backend can run.  Every transfer here is
small, so the mover's rule is set to stage whatever staging can carry: the tests
check the path, `portable-kv bench --section staged` its speed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kvspec import bits, page_tokens, randomize

import portable_kv as pk
from portable_kv import backends
from portable_kv.io import auto, staged
from portable_kv.layout import LAYOUTS

GPU = [n for n in ("cuda", "rocm", "triton") if backends.unavailable_reason(n) is None and backends.get(n).device.type == "cuda"]
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU backend: " + str(backends.unavailable_reason("cuda")))


@pytest.fixture(params=GPU or ["none"])
def gpu(request):
    before = backends.current()
    yield backends.use(request.param)
    backends.use(before.name)


# The host-side copies as 2-D copies, and as their rows in one batched call a chunk.
COPIES = {"2d": staged.EVERY_SCHEDULE, "batched": replace(staged.EVERY_SCHEDULE, batch_row_bytes=0)}


def pools(layout: str, page_size: int, io: str = "staged", layers: int = 4, pages: int = 64, seed: int = 3, copies: str = "2d"):
    dev = pk.DeviceKVPool(layers, pages * page_size, page_size, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io)
    if io == "staged":
        host._mover("staged").rule = COPIES[copies]
    gen = torch.Generator().manual_seed(seed)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


def both_pools_bits(dev, host) -> list[torch.Tensor]:
    return [bits(t.cpu()) for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]]


def run_ops(dev, host, host_idx, dev_idx) -> list[torch.Tensor]:
    """A backup of every layer, loads of single layers elsewhere, a backup of one layer."""
    host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    shifted = dev_idx.roll(dev.page_size)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, host_idx, shifted, layer)
    host.backup_from_device_per_layer(dev, host_idx.flip(0) if host.layout in ("layer_first", "page_first") else host_idx, dev_idx, 1)
    host.load_to_device_all_layer(dev, host_idx, dev_idx)
    torch.cuda.synchronize()
    return both_pools_bits(dev, host)


@pytest.mark.parametrize("copies", tuple(COPIES))
@pytest.mark.parametrize("page_size", [64, 16, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_matches_the_oracle(gpu, layout, page_size, copies, monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(1 << 20))  # several chunks at every page size
    host_pages = torch.tensor([5, 6, 7, 8, 9, 30, 31, 2, 60, 61, 62, 100])
    host_idx = page_tokens(host_pages, page_size)
    dev_idx = page_tokens(torch.randperm(64, generator=torch.Generator().manual_seed(1))[:12], page_size)
    dev, host = pools(layout, page_size, copies=copies)
    got = run_ops(dev, host, host_idx, dev_idx.to(dev.device))
    host.close()
    before = backends.current().name
    backends.use("cpu")
    try:
        cpu_dev, cpu_host = pools(layout, page_size, io="kernel")
        expected = run_ops(cpu_dev, cpu_host, host_idx, dev_idx)
    finally:
        backends.use(before)
    for n, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"{gpu.name} staged, {layout} page {page_size}: buffer {n} differs from the oracle"


@pytest.mark.parametrize("copies", tuple(COPIES))
def test_one_chunk_on_the_legacy_default_stream(gpu, copies):
    """One chunk, issued from torch's default stream (handle 0, which the batched copy
    calls refuse): the copies go on a side stream ordered both ways, the bytes arrive."""
    assert torch.cuda.current_stream().cuda_stream == 0
    dev, host = pools("layer_first", 16, copies=copies)
    host_idx, dev_idx = page_tokens(torch.arange(3, 11), 16), page_tokens(torch.randperm(64)[:8], 16).to(dev.device)
    expected = [bits(dev.k_buffer[1][dev_idx]), bits(dev.v_buffer[1][dev_idx])]
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 1)
    dev.k_buffer[1].zero_()
    dev.v_buffer[1].zero_()
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)
    torch.cuda.synchronize()
    assert host._mover("staged").last_path == "staged"  # 330 KB a layer: one chunk (runs.MIN_CHUNK_BYTES)
    assert torch.equal(bits(dev.k_buffer[1][dev_idx]), expected[0]) and torch.equal(bits(dev.v_buffer[1][dev_idx]), expected[1])
    host.close()


def test_many_chunks_over_two_slots(gpu, monkeypatch):
    """A staging size of two pages a slot: 32 chunks, the slots reused 16 times each."""
    page_bytes = 16 * (4 * 192 + 4 * 128) * 2
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * (2 * page_bytes + 256)))
    dev, host = pools("page_first_direct", 16)
    host_idx = page_tokens(torch.arange(10, 74), 16)
    dev_idx = page_tokens(torch.randperm(64), 16).to(dev.device)
    expected = [bits(dev.k_buffer[2][dev_idx]), bits(dev.v_buffer[2][dev_idx])]
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 2)
    dev.k_buffer[2].zero_()
    dev.v_buffer[2].zero_()
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 2)
    torch.cuda.synchronize()
    assert torch.equal(bits(dev.k_buffer[2][dev_idx]), expected[0]) and torch.equal(bits(dev.v_buffer[2][dev_idx]), expected[1])
    host.close()


@pytest.mark.parametrize("copies", tuple(COPIES))
def test_loads_behind_loads_and_late_backups_of_other_io_paths(gpu, monkeypatch, copies):
    """Staged per-layer loads issued back to back copy without waiting for the stream, so
    each load behind a backup must still see what the backup wrote: every layer is backed up
    through the kernel path after a long sleep on the stream, then loaded at once, never
    synchronised; and two loads behind each other each move their own layer."""
    page_bytes = 16 * (4 * 192 + 4 * 128) * 2
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * (5 * page_bytes + 256)))  # 5 pages a slot: 7 chunks, odd
    dev, host = pools("layer_first", 16, copies=copies)
    host_idx = page_tokens(torch.arange(0, 32), 16)
    source, target = page_tokens(torch.arange(0, 32), 16).to(dev.device), page_tokens(torch.arange(32, 64), 16).to(dev.device)
    host.load_to_device_per_layer(dev, host_idx, target, 0)  # the mover's first load waits for the stream
    for layer in range(dev.layer_num):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the backup lands long after the load is enqueued
        host.backup_from_device_per_layer(dev, host_idx, source, layer, io_backend="kernel")
        host.load_to_device_per_layer(dev, host_idx, target, layer)
        host.load_to_device_per_layer(dev, host_idx, target, (layer + 1) % dev.layer_num)
        host.load_to_device_per_layer(dev, host_idx, target, layer)
    torch.cuda.synchronize()
    for layer in range(dev.layer_num):
        for buffer in (dev.k_buffer[layer], dev.v_buffer[layer]):
            assert torch.equal(bits(buffer[target]), bits(buffer[source])), f"layer {layer}"
    host.close()


@pytest.mark.parametrize("copies", tuple(COPIES))
def test_kernel_streams_keep_the_current_streams_order(gpu, monkeypatch, copies):
    """The staged kernels run on a stream of their own: a backup gathers what the current
    stream wrote just before it (after a long sleep), a load scatters after the current
    stream's earlier writes to the same slots, and the current stream's next work (a
    clone, before any synchronise) reads what the load and the backup wrote."""
    page_bytes = 16 * (4 * 192 + 4 * 128) * 2
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * (5 * page_bytes + 256)))
    dev, host = pools("layer_first", 16, copies=copies)
    host_idx = page_tokens(torch.arange(0, 32), 16)
    source, target = page_tokens(torch.arange(0, 32), 16).to(dev.device), page_tokens(torch.arange(32, 64), 16).to(dev.device)
    layer = 2
    torch.cuda._sleep(20_000_000)
    dev.k_buffer[layer][source] = 1.0  # on the current stream, ~10 ms from now
    dev.v_buffer[layer][source] = -1.0
    host.backup_from_device_per_layer(dev, host_idx, source, layer)
    backed_up = (host.k_buffer[layer, :512].to(dev.device, non_blocking=True), host.v_buffer[layer, :512].to(dev.device, non_blocking=True))
    torch.cuda._sleep(20_000_000)
    dev.k_buffer[layer][target] = 7.0  # written before the load, which must overwrite it
    dev.v_buffer[layer][target] = 7.0
    host.load_to_device_per_layer(dev, host_idx, target, layer)
    loaded = (dev.k_buffer[layer][target].clone(), dev.v_buffer[layer][target].clone())
    torch.cuda.synchronize()
    assert bool((backed_up[0] == 1.0).all()) and bool((backed_up[1] == -1.0).all()), "the backup gathered the stream's writes"
    assert bool((loaded[0] == 1.0).all()) and bool((loaded[1] == -1.0).all()), "the load scattered after the stream's writes"
    host.close()


def test_both_directions_at_once_on_two_streams(gpu, monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(1 << 20))
    dev, host = pools("page_first_direct", 16)
    load_host, backup_host = page_tokens(torch.arange(0, 32), 16), page_tokens(torch.arange(40, 72), 16)
    order = torch.randperm(64)
    load_dev, backup_dev = page_tokens(order[:32], 16).to(dev.device), page_tokens(order[32:], 16).to(dev.device)
    to_load = [bits(host.k_buffer[p, l].cpu()) for p in range(32) for l in range(dev.layer_num)]
    to_backup = [bits(dev.k_buffer[l][backup_dev]) for l in range(dev.layer_num)]
    loads, backups = torch.cuda.Stream(), torch.cuda.Stream()
    loads.wait_stream(torch.cuda.current_stream())
    backups.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        with torch.cuda.stream(loads):
            host.load_to_device_all_layer(dev, load_host, load_dev)
        with torch.cuda.stream(backups):
            host.backup_from_device_all_layer(dev, backup_host, backup_dev)
    torch.cuda.synchronize()
    for layer in range(dev.layer_num):
        got = bits(dev.k_buffer[layer][load_dev]).view(32, 16, -1)
        for p in range(32):
            assert torch.equal(got[p].reshape(-1), to_load[p * dev.layer_num + layer].reshape(-1))
        assert torch.equal(bits(host.k_buffer[40:72, layer].cpu()).reshape(-1), to_backup[layer].reshape(-1))
    host.close()


def test_close_releases_staging_memory(gpu):
    dev, host = pools("page_first_direct", 64)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host_idx = page_tokens(torch.arange(0, 32), 64)
    host.backup_from_device_all_layer(dev, host_idx, host_idx.to(dev.device))
    host.load_to_device_per_layer(dev, host_idx, host_idx.to(dev.device), 0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() > before, "the staging slots were allocated"
    host.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 16), "close() released the staging slots"


def test_auto_moves_the_same_bytes_whichever_path_it_takes(gpu, monkeypatch):
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    for host_pages in (torch.arange(0, 40), torch.arange(0, 80, 2)):
        dev, host = pools("page_first_direct", 64, io="auto")
        host_idx = page_tokens(host_pages, 64)
        dev_idx = page_tokens(torch.randperm(64)[:40], 64).to(dev.device)
        expected = [bits(b[dev_idx]) for b in dev.k_buffer + dev.v_buffer]
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        for b in dev.k_buffer + dev.v_buffer:
            b.zero_()
        for layer in range(dev.layer_num):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
        torch.cuda.synchronize()
        assert all(torch.equal(bits(b[dev_idx]), e) for b, e in zip(dev.k_buffer + dev.v_buffer, expected))
        host.close()
