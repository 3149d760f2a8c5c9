"""The Mover interface, on every backend that runs without a GPU (the cpu oracle,
the simulated C kernel, Triton where it runs): what a mover moves for index views,
out-of-range indices and dtypes, and that it keeps no host pool alive."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch
from fake_gpu import SimulatedGpuBackend, SimulatedRuntime
from kvspec import bits, host_row

import portable_kv as pk
from portable_kv import backends
from portable_kv.backends import base, cpu
from portable_kv.backends import triton as triton_backend
from portable_kv.indices import IndexPair
from portable_kv.io.direct import copy_batch
from portable_kv.layout import LAYOUTS
from portable_kv.transfer import Transfer, tensor_pair

P, LAYERS, TOKENS, HOST_TOKENS = 4, 2, 32, 64
OUTSIDE = "outside the pools"


def make_backend(name: str) -> base.Backend:
    return SimulatedGpuBackend() if name == "simulated" else backends.get(name)


BACKENDS = ["cpu", "simulated"] + (["triton"] if backends.unavailable_reason("triton") is None else [])
CASES = [(name, io) for name in BACKENDS for io in ("kernel", "direct")]


def buffers(backend: base.Backend, layout: str, dtype: torch.dtype = torch.float16):
    """Host K/V in `layout` and device K/V per layer, filled with distinct bit patterns."""
    gen = torch.Generator().manual_seed(2)
    shapes = {"layer_first": (LAYERS, HOST_TOKENS), "page_first": (HOST_TOKENS, LAYERS),
              "page_first_direct": (HOST_TOKENS // P, LAYERS, P), "page_head": (HOST_TOKENS // P, 2, P, LAYERS)}
    k_shape = shapes[layout] + ((2, 8) if layout != "page_head" else (8,))
    v_shape = shapes[layout] + ((2, 4) if layout != "page_head" else (4,))
    # Page-locked where the backend pins (Triton on a GPU reads host memory only if it is).
    host = [torch.randint(-2**15, 2**15, s, dtype=torch.int16, generator=gen).view(dtype) for s in (k_shape, v_shape)]
    if backend.pins_memory:
        host = [t.pin_memory() for t in host]
    device = [[torch.randint(-2**15, 2**15, (TOKENS, 2, d), dtype=torch.int16, generator=gen).view(dtype).to(backend.device)
               for _ in range(LAYERS)] for d in (8, 4)]
    pairs = (tensor_pair(host[0], device[0], layout, P), tensor_pair(host[1], device[1], layout, P))
    return host, device, pairs


def expect_loaded(host, device, layout, host_idx, dev_idx, layers):
    for layer in layers:
        for h, d in zip(host_idx, dev_idx):
            for buffer, per_layer in zip(host, device):
                assert torch.equal(bits(per_layer[layer][d]), bits(host_row(buffer, layout, P, h, layer))), f"token {h} -> {d}, layer {layer}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,io", CASES)
def test_index_views_move_what_their_values_say(name, io, layout):
    """Strided, stride-0, offset and int32 views: the kernels read indices by address."""
    backend = make_backend(name)
    host, device, pairs = buffers(backend, layout)
    storage = torch.arange(100, dtype=torch.int64)
    views = [
        (storage[40:64:3], torch.arange(0, 16, 2)),  # strided, with a storage offset
        (torch.tensor([9]).expand(4), storage[20:24]),  # stride 0: one host token into four slots
        (storage[50:56].to(torch.int32), storage[2:14][::2].to(torch.int32)),  # int32, strided
    ]
    mover = backend.mover(io)
    for host_view, dev_view in views:
        assert not (host_view.is_contiguous() and dev_view.is_contiguous() and host_view.dtype == torch.int64)
        mover.move(Transfer(True, pairs, IndexPair(host_view, dev_view.to(backend.device)), range(LAYERS), P))
        backend.synchronize()
        expect_loaded(host, device, layout, host_view.tolist(), dev_view.tolist(), range(LAYERS))


@pytest.mark.parametrize("name,io", CASES)
@pytest.mark.parametrize("bad", ["past the host pool", "past the device pool", "negative"])
def test_unchecked_indices_outside_the_pools_are_skipped_and_flagged(name, io, bad):
    """validate=False: a bad token moves nothing anywhere, the rest of the call moves,
    and the next call raises; the one after goes through."""
    backend = make_backend(name)
    host, device, pairs = buffers(backend, "page_first")
    host_idx, dev_idx = [3, 4, 5], [0, 1, 2]
    if bad == "past the host pool":
        host_idx[1] = HOST_TOKENS + 100_000
    elif bad == "past the device pool":
        dev_idx[1] = TOKENS + 100_000
    else:
        host_idx[1] = -1
    before_host = [t.clone() for t in host]
    before_device = [[t.clone() for t in per_layer] for per_layer in device]
    good = [0, 2]
    mover = backend.mover(io)
    indices = IndexPair(torch.tensor(host_idx), torch.tensor(dev_idx).to(backend.device))
    mover.move(Transfer(False, pairs, indices, range(LAYERS), P))  # a backup: host memory is written
    backend.synchronize()
    for layer in range(LAYERS):
        for buffer, per_layer in zip(host, device):
            for i in good:
                assert torch.equal(bits(host_row(buffer, "page_first", P, host_idx[i], layer)), bits(per_layer[layer][dev_idx[i]]))
    for buffer, before in zip(host, before_host):
        changed = [t for t in range(HOST_TOKENS) if t not in [host_idx[i] for i in good] and not torch.equal(bits(buffer[t]), bits(before[t]))]
        assert not changed, f"host tokens {changed} changed"
    with pytest.raises(RuntimeError, match=OUTSIDE):
        mover.move(Transfer(True, pairs, indices, range(LAYERS), P))
    for per_layer in device:
        for layer in range(LAYERS):
            per_layer[layer][[dev_idx[i] for i in good if dev_idx[i] < TOKENS]] = 0
    zeroed = [[t.clone() for t in per_layer] for per_layer in device]
    mover.move(Transfer(True, pairs, indices, range(LAYERS), P))  # the flag was reset: this one moves
    backend.synchronize()
    for per_layer, before, originals in zip(device, zeroed, before_device):
        for layer in range(LAYERS):
            expected = before[layer].clone()
            expected[[dev_idx[i] for i in good]] = originals[layer][[dev_idx[i] for i in good]]
            assert torch.equal(bits(per_layer[layer]), bits(expected)), "a load wrote outside its valid slots"
    with pytest.raises(RuntimeError, match=OUTSIDE):
        mover.move(Transfer(True, pairs, IndexPair(torch.tensor([3]), torch.tensor([0]).to(backend.device)), range(1), P))
    mover.move(Transfer(True, pairs, IndexPair(torch.tensor([3]), torch.tensor([0]).to(backend.device)), range(1), P))


def test_the_plan_leaves_out_tokens_outside_either_pool():
    backend = make_backend("cpu")
    _, device, pairs = buffers(backend, "layer_first")
    indices = IndexPair(torch.tensor([0, 1, HOST_TOKENS, -3, 4]), torch.tensor([0, 1, 2, 3, TOKENS]))
    batch = copy_batch(Transfer(True, pairs, indices, range(LAYERS), P))
    assert batch.skipped
    # Tokens 0 and 1 are consecutive on both sides: one run per (tensor, layer).
    assert len(batch) == 2 * LAYERS
    ok = copy_batch(Transfer(True, pairs, IndexPair(torch.tensor([0, 1]), torch.tensor([0, 1])), range(LAYERS), P))
    assert not ok.skipped and sorted(ok.dst.tolist()) == sorted(batch.dst.tolist())


@pytest.mark.parametrize("name", BACKENDS)
def test_movers_keep_no_host_pool_alive(name):
    """After close() and the last reference, the host buffers are freed."""
    backend = make_backend(name)
    host, device, pairs = buffers(backend, "page_first_direct")
    alive = [weakref.ref(t) for t in host]
    for io in backend.io_backends:
        mover = backend.mover(io)
        mover.move(Transfer(True, pairs, IndexPair(torch.arange(8), torch.arange(8).to(backend.device)), range(LAYERS), P))
        mover.move(Transfer(False, pairs, IndexPair(torch.arange(8, 16), torch.arange(8).to(backend.device)), range(1), P))
        backend.synchronize()
        mover.close()
        mover.close()  # idempotent
    del host, pairs
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True], "a mover or backend cache keeps a host buffer alive"


def test_dropped_pools_release_their_host_buffers():
    """24 pools made, used and dropped in a loop: none stays alive."""
    backend = SimulatedGpuBackend()
    before = backends.current().name
    backends._instances["simulated"] = backend
    backends._REGISTRY["simulated"] = "fake_gpu:SimulatedGpuBackend"
    try:
        backends.use("simulated")
        dev = pk.DeviceKVPool(2, 64, P, 2, 8, 4, dtype=torch.float16)
        alive = []
        for n in range(24):
            pool = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="kernel")
            pool.load_to_device_per_layer(dev, torch.arange(8), torch.arange(8, 16), n % 2)
            alive.append(weakref.ref(pool.k_buffer))
            if n % 2:
                pool.close()
            del pool
        gc.collect()
        assert sum(ref() is not None for ref in alive) == 0
    finally:
        backends.use(before)
        backends._instances.pop("simulated", None)
        backends._REGISTRY.pop("simulated", None)


@pytest.mark.parametrize("name", BACKENDS)
def test_dtypes_the_movers_take(name):
    backend = make_backend(name)
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn):
        backend.check_dtype(dtype)
    for dtype in (torch.complex64, torch.complex128, torch.complex32):
        with pytest.raises(TypeError, match=r"^dtype: .*got torch\.complex"):
            backend.check_dtype(dtype)


def test_a_complex_device_pool_is_refused_before_it_allocates():
    with pytest.raises(TypeError, match="^dtype: .*complex"):
        pk.DeviceKVPool(1, 32, P, 1, 8, 8, dtype=torch.complex64)


@pytest.mark.parametrize("name", BACKENDS)
def test_each_call_gives_a_new_mover_of_the_named_path(name):
    backend = make_backend(name)
    for io in backend.io_backends:
        first, second = backend.mover(io), backend.mover(io)
        assert first is not second and first.io == io == second.io
    with pytest.raises(ValueError, match=rf"io_backend: backend .* offers {', '.join(backend.io_backends)}, got 'dma2'"):
        backend.mover("dma2")


def test_another_io_path_is_one_more_factory():
    class ReplayMover(cpu.IndexingMover):
        io = "replay"

    class ReplayCpu(cpu.CpuBackend):
        def movers(self, context=None):
            return super().movers(context) | {"replay": ReplayMover}

    backend = ReplayCpu()
    assert backend.io_backends == cpu.CpuBackend().io_backends + ("replay",)
    assert isinstance(backend.mover("replay"), ReplayMover) and backend.mover("kernel").io == "kernel"


def test_triton_registers_host_memory_through_its_vendor_runtime(monkeypatch):
    """On a GPU, Triton page-locks through the runtime it holds; under the interpreter it needs nothing."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_backend.TritonBackend().register_host(4096, 8192) == 4096
    runtime = SimulatedRuntime()
    monkeypatch.setattr(triton_backend, "vendor_runtime", lambda vendor, device: runtime)
    backend = triton_backend.TritonBackend()
    backend.register_host(1 << 20, 4096)
    assert runtime.registered == [(1 << 20, 4096)]
    backend.unregister_host(1 << 20)
    assert runtime.registered == []
    assert backend.movers()["direct"] == runtime.direct_mover
    assert not backend.kernel_reads_registered_memory


def test_no_backend_imports_the_registry():
    """The registry imports backends, never the reverse: no loop, hidden or not."""
    for path in Path(base.__file__).parent.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported = (node.module or "") if node.level else node.module
                assert not (node.level == 1 and not node.module), f"{path.name} imports the registry (from . import ...)"
                assert imported != "portable_kv.backends", f"{path.name} imports the registry"


@pytest.mark.parametrize("io", ["kernel", "staged"])
def test_a_dropped_device_pool_is_not_kept_by_the_kernel_movers(simulated, io):
    """The simulated GPU runs the C kernel's launch path: its prepared launches, job
    templates and staged plans refer to an engine's device pool weakly."""
    old, new = (pk.DeviceKVPool(2, 64, 4, 2, 8, 8, dtype=torch.float16) for _ in range(2))
    host = pk.AsymmetricHostPool(old, host_to_device_ratio=1, layout="page_first_direct", io_backend=io)
    idx = torch.arange(0, 8)
    host.load_to_device_all_layer(old, idx, idx)
    host.load_to_device_all_layer(new, idx, idx)
    dropped = [weakref.ref(t) for t in old.k_buffer + old.v_buffer]
    del old
    gc.collect()
    assert all(ref() is None for ref in dropped), "a mover keeps a dropped device pool's buffers alive"
    host.close()

