"""host_memory='registered': mmap'ed host memory page-locked in pieces of whole pages;
no DMA copy may span two pieces, and transfers stay byte-exact."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from kvspec import bits, device_pool, every_tensor, host_buffers, host_pool, page_tokens, pool_layouts, randomize

import portable_kv as pk
from portable_kv import host_memory
from portable_kv.io.staged import EVERY_SCHEDULE


@pytest.fixture
def recorded(monkeypatch, backend):
    calls = {"register": [], "unregister": []}
    register, unregister = backend.register_host, backend.unregister_host

    def recording_register(address, nbytes):
        calls["register"].append((address, nbytes))
        return register(address, nbytes)

    def recording_unregister(address):
        calls["unregister"].append(address)
        unregister(address)

    monkeypatch.setattr(backend, "register_host", recording_register)
    monkeypatch.setattr(backend, "unregister_host", recording_unregister)
    monkeypatch.setattr(host_memory, "REGISTRATION_BYTES", 3 * 4 * 2 * 24 * 2 * 4)  # three pages of K
    return calls


@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("kind, layout", pool_layouts(("page_first", "page_first_direct", "page_head")))
def test_registered_pool_roundtrip_and_pieces(backend, recorded, kind, layout, io, gen, monkeypatch):
    if io not in backend.io_backends or (io == "kernel" and not backend.kernel_reads_registered_memory):
        pytest.skip(f"{backend.name} has no {io} path over registered memory")
    dev = device_pool(kind, 2, 64, 4, torch.bfloat16)
    host = host_pool(dev, layout=layout, io_backend=io, host_memory="registered")
    first = host_buffers(host)[0]
    pieces = [r for r in recorded["register"] if first.data_ptr() <= r[0] < first.data_ptr() + first.numel() * 2]
    page_bytes = first.numel() * 2 // host.page_num
    assert all(size % page_bytes == 0 for _, size in pieces), "pieces are whole pages"
    assert sum(size for _, size in pieces) == first.numel() * 2 and len(pieces) > 1
    for t in every_tensor(dev):
        randomize(t, gen)
    # Consecutive host pages across a piece boundary: a merged run would span two registrations.
    host_idx = torch.arange(0, 40)
    dev_idx = page_tokens(torch.randperm(16, generator=gen)[:10], 4)
    dev_idx = dev_idx.to(dev.device)
    sent = sent_copies(backend, monkeypatch)
    host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    assert bool(sent) == (io == "direct")
    ranges = sorted(recorded["register"])
    for dst, size in sent:
        assert any(a <= dst and dst + size <= a + n for a, n in ranges), "a copy spans two registrations"
    original = [bits(t[dev_idx]) for t in every_tensor(dev)]
    for t in every_tensor(dev):
        t.zero_()
    host.load_to_device_all_layer(dev, host_idx, dev_idx)
    backend.synchronize()
    for got, want in zip([bits(t[dev_idx]) for t in every_tensor(dev)], original):
        assert torch.equal(got, want)
    host.close()
    assert sorted(recorded["unregister"]) == sorted(a for a, _ in recorded["register"])


def sent_copies(backend, monkeypatch) -> list[tuple[int, int]]:
    """(destination, bytes) of every 1-D copy the backend's copier is handed from now on."""
    sent, copier = [], backend.copier
    real = copier.memcpy_batch
    monkeypatch.setattr(copier, "memcpy_batch", lambda batch, stream: sent.extend(zip(batch.dst.tolist(), batch.sizes.tolist())) or real(batch, stream))
    return sent


@pytest.mark.parametrize("io", ["direct", "staged"])
def test_no_copy_spans_two_pieces_of_k_or_of_v(backend, recorded, io, gen, monkeypatch):
    """K's and V's pages differ in size, so their pieces hold different page counts: runs
    consecutive on both sides are cut where either tensor's piece ends, never only V's."""
    if io not in backend.io_backends or (io == "staged" and not backend.kernel_reads_registered_memory):
        pytest.skip(f"{backend.name} has no {io} path over registered memory (staged falls back to the kernel)")
    dev = pk.DeviceKVPool(2, 64, 4, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io, host_memory="registered")
    k_tokens, v_tokens = host._memory.registration_tokens
    assert k_tokens != v_tokens, "the geometry must give K and V pieces of different page counts"
    copies = sent_copies(backend, monkeypatch)
    if io == "staged":
        mover = host._io_context.mover("staged")
        mover.rule = EVERY_SCHEDULE  # a GPU's rule leaves a transfer this small to the kernel path
        memcpy_2d = mover.memcpy_2d

        def recording(dst, dst_pitch, src, src_pitch, width, height, stream):
            address, pitch = (dst, dst_pitch) if _inside(dst, (host.k_buffer, host.v_buffer)) else (src, src_pitch)
            copies.append((address, width + (height - 1) * pitch))
            memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, stream)

        mover.memcpy_2d = recording
    for t in dev.k_buffer + dev.v_buffer:
        randomize(t, gen)
    idx = torch.arange(0, 64)  # consecutive on both sides: every run may merge across pages
    host.backup_from_device_all_layer(dev, idx, idx.to(dev.device))
    assert copies, "the transfer made no host copy to check"
    ranges = sorted(recorded["register"])
    for address, size in copies:
        assert any(a <= address and address + size <= a + n for a, n in ranges), "a copy spans two registrations"
    for t in dev.k_buffer + dev.v_buffer:
        t.zero_()
    host.load_to_device_all_layer(dev, idx, idx.to(dev.device))
    backend.synchronize()
    want = [bits(t) for t in (host.k_buffer, host.v_buffer)]
    host.backup_from_device_all_layer(dev, idx, idx.to(dev.device))
    backend.synchronize()
    assert all(torch.equal(bits(t), w) for t, w in zip((host.k_buffer, host.v_buffer), want))
    host.close()


def _inside(address: int, tensors) -> bool:
    return any(t.data_ptr() <= address < t.data_ptr() + t.numel() * t.element_size() for t in tensors)


def test_registered_needs_a_page_major_layout(backend):
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="host_memory='registered'.*page-major"):
        pk.AsymmetricHostPool(dev, layout="layer_first", io_backend=backend.io_backends[0], host_memory="registered")
    with pytest.raises(ValueError, match="host_memory.*pinned, registered"):
        pk.AsymmetricHostPool(dev, host_memory="hugepages")
    if not backend.kernel_reads_registered_memory and "kernel" in backend.io_backends:
        with pytest.raises(ValueError, match="host_memory='registered' on backend.*use io_backend='direct'"):
            pk.AsymmetricHostPool(dev, layout="page_first", io_backend="kernel", host_memory="registered")


def test_a_per_call_io_backend_gets_the_constructors_checks(backend, monkeypatch):
    """An engine names the io path on every call (SGLang does): a path whose GPU threads
    cannot read this pool's memory is refused per call as at construction, before a byte moves."""
    if "direct" not in backend.io_backends:
        pytest.skip(f"{backend.name} has no direct path")
    dev = pk.DeviceKVPool(2, 32, 4, 2, 8, 8, dtype=torch.float16)
    idx = torch.arange(0, 8)
    if not backend.kernel_reads_registered_memory:
        host = pk.AsymmetricHostPool(dev, layout="page_first", io_backend="direct", host_memory="registered")
        with pytest.raises(ValueError, match="io_backend='kernel' with host_memory='registered' on backend"):
            host.load_to_device_all_layer(dev, idx, idx.to(dev.device), io_backend="kernel")
        host.close()
    # A GPU that maps registered memory at another address (the kernels would read the host address).
    register = backend.register_host
    monkeypatch.setattr(backend, "register_host", lambda address, nbytes: register(address, nbytes) + 4096)
    with pytest.raises(ValueError, match="maps registered memory at another address|with host_memory='registered' on backend"):
        pk.AsymmetricHostPool(dev, layout="page_first", io_backend="kernel", host_memory="registered")
    host = pk.AsymmetricHostPool(dev, layout="page_first", io_backend="direct", host_memory="registered")
    before = [bits(t).clone() for t in dev.k_buffer + dev.v_buffer]
    for io in ("kernel", "staged", "auto"):
        if io in backend.io_backends:
            with pytest.raises(ValueError, match=f"io_backend='{io}'.*another address|io_backend='{io}' with host_memory='registered' on backend"):
                host.load_to_device_all_layer(dev, idx, idx.to(dev.device), io_backend=io)
    assert all(torch.equal(bits(t), b) for t, b in zip(dev.k_buffer + dev.v_buffer, before))
    host.close()


@pytest.mark.parametrize("io", ["direct", "kernel"])
def test_registered_pool_dropped_without_close_unregisters(backend, recorded, io):
    """A pool that goes out of scope cleans up exactly like close(): every piece unregistered,
    so the next pool registered at the same address does not fail as already registered."""
    if io not in backend.io_backends or (io == "kernel" and not backend.kernel_reads_registered_memory):
        pytest.skip(f"{backend.name} has no {io} path over registered memory")
    dev = pk.DeviceKVPool(2, 64, 4, 2, 24, 16, dtype=torch.bfloat16)
    for _ in range(3):
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io, host_memory="registered")
        host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(8, device=dev.device))
        del host
        gc.collect()
        assert sorted(recorded["unregister"]) == sorted(a for a, _ in recorded["register"])


def test_close_unregisters_and_frees_while_the_pool_object_lives(backend, recorded):
    """Registered memory: close() unregisters every piece and lets go of the mapping even
    though the engine still holds the pool object."""
    if "direct" not in backend.io_backends:
        pytest.skip(f"{backend.name} has no direct path over registered memory")
    dev = pk.DeviceKVPool(2, 64, 4, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first", io_backend="direct", host_memory="registered")
    host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(8, device=dev.device))
    buffers = [weakref.ref(host.k_buffer), weakref.ref(host.v_buffer)]
    host.close()
    gc.collect()
    assert sorted(recorded["unregister"]) == sorted(a for a, _ in recorded["register"])
    assert all(ref() is None for ref in buffers), "close() left the registered mapping alive behind the pool object"
