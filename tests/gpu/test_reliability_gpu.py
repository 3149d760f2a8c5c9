"""GPU-only reliability: indices produced on a busy stream, host memory freed by
close() and by dropping a pool, Triton's registered memory page-locked, and unchecked
indices on the copy engines.  Skipped (with the reason) where no GPU backend can run."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from kvspec import bits, page_tokens, randomize

import portable_kv as pk
from portable_kv import backends

GPU = [n for n in ("cuda", "rocm", "triton") if backends.unavailable_reason(n) is None and torch.cuda.is_available()]
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU backend: " + str(backends.unavailable_reason("cuda")))
P = 16
LONG_KERNEL_CYCLES = 10**8  # ~50 ms of torch.cuda._sleep: the indices appear long after the call returns


@pytest.fixture(params=GPU or ["none"])
def gpu(request):
    before = backends.current()
    yield backends.use(request.param)
    backends.use(before.name)


def pools(io: str, validate: bool = True, tokens: int = 1024, layout: str = "page_first_direct"):
    dev = pk.DeviceKVPool(2, tokens, P, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend=io, validate=validate)
    gen = torch.Generator().manual_seed(5)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_indices_produced_after_a_long_kernel_are_read_when_they_exist(gpu, io):
    """GPU indices are validated (read on the host) after the producing stream wrote them."""
    if io not in gpu.io_backends:
        pytest.skip(f"{gpu.name} has no {io} path")
    dev, host = pools(io)
    pages = 16
    host_idx = torch.full((pages * P,), -1, dtype=torch.int64, device="cuda")
    dev_idx = torch.full((pages * P,), -1, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(LONG_KERNEL_CYCLES)
    order = torch.randperm(pages, device="cuda")
    host_idx.copy_(page_tokens(torch.arange(pages), P).to("cuda"))
    dev_idx.copy_((order[:, None] * P + torch.arange(P, device="cuda")).reshape(-1))
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)  # -1 would be refused if read too early
    torch.cuda.synchronize()
    assert torch.equal(bits(dev.k_buffer[1][dev_idx]), bits(host.k_buffer[:pages, 1].reshape(-1, 4, 192)))
    host.close()


def test_one_index_tensor_moved_on_two_streams(gpu):
    """The device copies of an engine's indices are made on the stream that asked for them:
    the same index tensors on a second stream get copies ordered on that stream, never the
    first stream's, which may not exist yet."""
    dev, host = pools("kernel")
    pages = 16
    host_idx = page_tokens(torch.arange(pages), P)
    dev_idx = page_tokens(torch.randperm(pages, generator=torch.Generator().manual_seed(3)) + 8, P)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)  # its index copies wait behind the sleep
    with torch.cuda.stream(second):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)
    torch.cuda.synchronize()
    for layer in (0, 1):
        assert torch.equal(bits(dev.k_buffer[layer][dev_idx]), bits(host.k_buffer[:pages, layer].reshape(-1, 4, 192))), f"layer {layer}"
    host.close()


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_closed_and_dropped_pools_free_their_host_memory(gpu, io):
    if io not in gpu.io_backends:
        pytest.skip(f"{gpu.name} has no {io} path")
    dev = pk.DeviceKVPool(2, 4096, P, 4, 192, 128, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    alive = []

    def pools_dropped(count: int) -> int | None:
        for n in range(count):
            host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io)
            host.load_to_device_per_layer(dev, idx, idx, n % 2)
            host.backup_from_device_all_layer(dev, idx, idx)
            alive.append(weakref.ref(host.k_buffer))
            if n % 2:
                host.close()
            del host
        torch.cuda.synchronize()
        gc.collect()
        assert sum(ref() is not None for ref in alive) == 0, "host buffers outlive their pools"
        return pinned_bytes_in_use()

    before = pinned_bytes_in_use()
    after_24, after_48 = pools_dropped(24), pools_dropped(24)
    if before is not None and after_24 is not None and after_48 is not None:
        # torch's pinned allocator counts the blocks freed last as in use until its next
        # allocation looks at their events: one pool's K and V (rounded up to powers of two,
        # 48 MiB here), its bad-index flag and its page-locked index copy, whatever the
        # number of pools (tools/host_memory_probe.py). A leak grows with the pools: 24
        # more pools must leave nothing more.
        blocks = sum(1 << (t.numel() * 2 * 2 * 2 - 1).bit_length() for t in (dev.k_buffer[0], dev.v_buffer[0]))  # 2 layers, ratio 2, bf16
        one_pool_small = 64 << 10  # the flag (4 bytes) and the index copy (8 KiB) of the last pool, with room
        assert after_24 - before <= blocks + one_pool_small, f"{after_24 - before} bytes of pinned host memory still in use after 24 pools were dropped"
        assert after_48 <= after_24, f"{after_48 - after_24} bytes more of pinned host memory in use after 24 more pools were dropped"


def pinned_bytes_in_use() -> int | None:
    """Bytes torch's caching host allocator has handed out and not had back (None: torch does not say)."""
    if not hasattr(torch.cuda, "host_memory_stats"):
        return None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()  # also returns the caching host allocator's free blocks
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.current", stats.get("active_bytes.current"))


def test_triton_registered_memory_is_page_locked_and_released(monkeypatch):
    if backends.unavailable_reason("triton") is not None or not torch.cuda.is_available():
        pytest.skip("needs the triton backend on a GPU")
    triton = backends.get("triton")
    assert triton.runtime is not None, "Triton on a GPU holds its vendor's runtime"
    calls = []
    register, unregister = triton.runtime.register_host, triton.runtime.unregister_host
    monkeypatch.setattr(triton.runtime, "register_host", lambda a, n: calls.append(("register", a)) or register(a, n))
    monkeypatch.setattr(triton.runtime, "unregister_host", lambda a: calls.append(("unregister", a)) or unregister(a))
    before = backends.current().name
    backends.use("triton")
    try:
        dev = pk.DeviceKVPool(2, 1024, P, 4, 192, 128, dtype=torch.bfloat16)
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="direct", host_memory="registered")
        registered = [a for kind, a in calls if kind == "register"]
        assert registered, "registered host memory was not page-locked"
        idx = page_tokens(torch.arange(8), P)
        host.backup_from_device_all_layer(dev, idx, idx)
        torch.cuda.synchronize()
        assert torch.equal(bits(host.k_buffer[:8, 0].reshape(-1, 4, 192)), bits(dev.k_buffer[0][idx]))
        host.close()
        gc.collect()
        assert sorted(a for kind, a in calls if kind == "unregister") == sorted(registered)
    finally:
        backends.use(before)


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_unchecked_indices_outside_the_pools_on_the_gpu(gpu, io):
    """validate=False on both io paths: the bad page is skipped and flagged, the good one moves."""
    if io not in gpu.io_backends:
        pytest.skip(f"{gpu.name} has no {io} path")
    dev, host = pools(io, validate=False)
    before = [bits(t) for t in dev.k_buffer]
    host_idx = page_tokens(torch.tensor([1, host.page_num + 10**5]), P)
    dev_idx = page_tokens(torch.tensor([3, 4]), P)
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="outside the pools"):
        host.load_to_device_per_layer(dev, host_idx[:P], dev_idx[:P], 0)
    after = bits(dev.k_buffer[0])
    assert torch.equal(after[3 * P:4 * P], bits(host.k_buffer[1, 0]))
    assert torch.equal(after[4 * P:5 * P], before[0][4 * P:5 * P]), "the skipped page was written"
    host.close()


def test_a_device_pool_on_another_gpu_is_refused(gpu):
    """The backend launches on its own GPU: a device pool on another one is refused, not faulted on."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 visible GPUs, {torch.cuda.device_count()} visible")
    other = (gpu.device.index + 1) % torch.cuda.device_count()
    here = pk.DeviceKVPool(2, 256, P, 4, 192, 128, dtype=torch.bfloat16)
    there = pk.DeviceKVPool(2, 256, P, 4, 192, 128, dtype=torch.bfloat16, device=torch.device("cuda", other))
    host = pk.AsymmetricHostPool(here, layout="page_first_direct", io_backend="kernel")
    idx = page_tokens(torch.arange(2), P)
    with pytest.raises(ValueError, match="device_pool: expected buffers on cuda"):
        host.load_to_device_per_layer(there, idx, idx, 0)
    host.close()

