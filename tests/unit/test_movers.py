"""The io paths' movers, on every backend that runs without a GPU (the cpu oracle, the
simulated C kernel, Triton where it runs), through the pools that hold them: what they move
for index views and for unchecked indices outside the pools, the copies the direct path
sends, the dtypes they take, the io paths a backend offers, and that they keep no pool alive."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch
from fake_gpu import SimulatedGpuBackend, SimulatedRuntime
from kvspec import bits, host_row, page_tokens, randomize

import portable_kv as pk
from portable_kv import backends
from portable_kv.backends import base, cpu
from portable_kv.backends import triton as triton_backend
from portable_kv.config import IO_PATHS
from portable_kv.layout import LAYOUTS

P, LAYERS, TOKENS = 4, 2, 32
OUTSIDE = "outside the pools"
BACKENDS = ["cpu", "simulated"] + (["triton"] if backends.unavailable_reason("triton") is None else [])
CASES = [(name, io) for name in BACKENDS for io in ("kernel", "direct")]


@pytest.fixture
def bind(monkeypatch):
    """Bind a backend by name for the test (the simulated GPU registered as conftest's
    `simulated` does), then the one bound before."""
    before = backends.current().name
    monkeypatch.setitem(backends._REGISTRY, "simulated", "fake_gpu:SimulatedGpuBackend")
    backends._instances.pop("simulated", None)
    yield backends.use
    backends.use(before)
    backends._instances.pop("simulated", None)


def pools(layout: str, io: str, validate: bool = False, dtype: torch.dtype = torch.float16):
    """A device pool of K (2 x 8) and V (2 x 4) and its host pool of twice the tokens, every
    buffer filled with distinct bit patterns."""
    dev = pk.DeviceKVPool(LAYERS, TOKENS, P, 2, 8, 4, dtype=dtype)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend=io, validate=validate)
    gen = torch.Generator().manual_seed(2)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


def expect_loaded(dev, host, layout, host_idx, dev_idx, layers):
    for layer in layers:
        for h, d in zip(host_idx, dev_idx):
            for buffer, per_layer in ((host.k_buffer, dev.k_buffer), (host.v_buffer, dev.v_buffer)):
                assert torch.equal(bits(per_layer[layer][d]), bits(host_row(buffer, layout, P, h, layer))), f"token {h} -> {d}, layer {layer}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,io", CASES)
def test_index_views_move_what_their_values_say(bind, name, io, layout):
    """Strided, stride-0, offset and int32 views: the kernels read indices by address.
    validate=False: the views need not be whole pages of a page layout."""
    bind(name)
    dev, host = pools(layout, io)
    storage = torch.arange(100, dtype=torch.int64)
    views = [
        (storage[40:64:3], torch.arange(0, 16, 2)),  # strided, with a storage offset
        (torch.tensor([9]).expand(4), storage[20:24]),  # stride 0: one host token into four slots
        (storage[50:56].to(torch.int32), storage[2:14][::2].to(torch.int32)),  # int32, strided
    ]
    for host_view, dev_view in views:
        assert not (host_view.is_contiguous() and dev_view.is_contiguous() and host_view.dtype == torch.int64)
        host.load_to_device_all_layer(dev, host_view, dev_view.to(dev.device))
        host.backend.synchronize()
        expect_loaded(dev, host, layout, host_view.tolist(), dev_view.tolist(), range(LAYERS))
    row = host.stats()["load"][io]
    token_bytes = 2 * (8 + 4) * 2
    assert (row["calls"], row["bytes"]) == (3, sum(v.numel() for v, _ in views) * LAYERS * token_bytes)
    host.close()


@pytest.mark.parametrize("name,io", CASES)
@pytest.mark.parametrize("bad", ["past the host pool", "past the device pool", "negative"])
def test_unchecked_indices_outside_the_pools_are_skipped_and_flagged(bind, name, io, bad):
    """validate=False: a bad token moves nothing anywhere, the rest of the call moves,
    and the next call raises; the one after goes through."""
    bind(name)
    dev, host = pools("page_first", io)
    host_idx, dev_idx = [3, 4, 5], [0, 1, 2]
    if bad == "past the host pool":
        host_idx[1] = host.size + 100_000
    elif bad == "past the device pool":
        dev_idx[1] = TOKENS + 100_000
    else:
        host_idx[1] = -1
    before_host = [host.k_buffer.clone(), host.v_buffer.clone()]
    before_device = [[t.clone() for t in per_layer] for per_layer in (dev.k_buffer, dev.v_buffer)]
    good = [0, 2]
    indices = torch.tensor(host_idx), torch.tensor(dev_idx).to(dev.device)
    host.backup_from_device_all_layer(dev, *indices)  # a backup: host memory is written
    host.backend.synchronize()
    expect_loaded(dev, host, "page_first", [host_idx[i] for i in good], [dev_idx[i] for i in good], range(LAYERS))
    for buffer, before in zip((host.k_buffer, host.v_buffer), before_host):
        changed = [t for t in range(host.size) if t not in [host_idx[i] for i in good] and not torch.equal(bits(buffer[t]), bits(before[t]))]
        assert not changed, f"host tokens {changed} changed"
    with pytest.raises(RuntimeError, match=OUTSIDE):
        host.load_to_device_all_layer(dev, *indices)
    assert host.stats()["last_error"].startswith("RuntimeError: portable_kv: an earlier transfer met token indices outside the pools")
    for per_layer in (dev.k_buffer, dev.v_buffer):
        for layer in range(LAYERS):
            per_layer[layer][[dev_idx[i] for i in good]] = 0
    zeroed = [[t.clone() for t in per_layer] for per_layer in (dev.k_buffer, dev.v_buffer)]
    host.load_to_device_all_layer(dev, *indices)  # the flag was reset: this one moves
    host.backend.synchronize()
    for per_layer, before, originals in zip((dev.k_buffer, dev.v_buffer), zeroed, before_device):
        for layer in range(LAYERS):
            expected = before[layer].clone()
            expected[[dev_idx[i] for i in good]] = originals[layer][[dev_idx[i] for i in good]]
            assert torch.equal(bits(per_layer[layer]), bits(expected)), "a load wrote outside its valid slots"
    one = torch.tensor([3]), torch.tensor([0]).to(dev.device)
    with pytest.raises(RuntimeError, match=OUTSIDE):
        host.load_to_device_per_layer(dev, *one, 0)
    host.load_to_device_per_layer(dev, *one, 0)
    assert host.stats()["load"][io]["calls"] == 2, "the calls that raised moved nothing"
    host.close()


def test_the_direct_path_leaves_out_tokens_outside_either_pool(simulated, monkeypatch):
    """validate=False on the direct path: tokens outside a pool are left out of the copies the
    copy engines get, the rest merge into runs (tokens 0 and 1 are consecutive on both sides:
    one copy per buffer and layer), and the next call raises."""
    sent = []
    batch_call = SimulatedRuntime.batch_call
    monkeypatch.setattr(SimulatedRuntime, "batch_call", lambda self, batch, stream: sent.append(batch) or batch_call(self, batch, stream))
    dev, host = pools("layer_first", "direct")
    host.load_to_device_all_layer(dev, torch.tensor([0, 1, host.size, -3, 4]), torch.tensor([0, 1, 2, 3, TOKENS]))
    assert sum(len(batch) for batch in sent) == 2 * LAYERS
    assert sorted(b for batch in sent for b in batch.sizes.tolist()) == sorted([2 * 2 * 8 * 2, 2 * 2 * 4 * 2] * LAYERS)
    expect_loaded(dev, host, "layer_first", [0, 1], [0, 1], range(LAYERS))
    with pytest.raises(RuntimeError, match=OUTSIDE):
        host.load_to_device_all_layer(dev, torch.tensor([0, 1]), torch.tensor([0, 1]))
    host.close()


@pytest.mark.parametrize("row_dim, calls", [(4096, 1), (16, 4)], ids=["long copies: one call", "short copies: four streams"])
def test_direct_sends_long_copies_as_one_call_and_spreads_short_ones(simulated, monkeypatch, row_dim, calls):
    """Copies of 1 MiB and more on average go out as one batched call on NVIDIA's runtime (the
    simulated GPU's, as cuda's); short ones over the engine's 4 streams; both bit-exact."""
    made = []
    batch_call = type(simulated.runtime).batch_call
    monkeypatch.setattr(type(simulated.runtime), "batch_call", lambda self, batch, stream: made.append(len(batch)) or batch_call(self, batch, stream))
    P = 64
    dev = pk.MLADevicePool(1, 64 * P, P, row_dim, dtype=torch.float32)  # a page of a layer: 1 MiB at 4096 floats, 4 KiB at 16
    host = pk.MLAHostPool(dev, layout="page_first_direct", io_backend="direct")
    randomize(dev.kv_buffer[0], torch.Generator().manual_seed(2))
    host_pages, dev_pages = torch.tensor([3, 9, 1, 20, 7, 12, 30, 5]), torch.tensor([8, 2, 40, 11, 0, 33, 6, 17])
    host.backup_from_device_all_layer(dev, page_tokens(host_pages, P), page_tokens(dev_pages, P))
    assert len(made) == calls and sum(made) == 8
    for h, d in zip(host_pages.tolist(), dev_pages.tolist()):
        assert torch.equal(bits(host.kv_buffer[h, 0]), bits(dev.kv_buffer[0][d * P:(d + 1) * P]))  # (page, layer, P, 1, dim)
    host.close()


def test_directs_short_copies_follow_dma_streams_set_between_calls(simulated, monkeypatch):
    """`dma_streams` is assignable between calls: a plan's next call spreads its short copies
    over the streams set now, not those of its first call."""
    made = []
    batch_call = type(simulated.runtime).batch_call
    monkeypatch.setattr(type(simulated.runtime), "batch_call", lambda self, batch, stream: made.append(len(batch)) or batch_call(self, batch, stream))
    monkeypatch.setattr(simulated, "dma_streams", simulated.dma_streams)  # restored after the test
    P = 64
    dev = pk.MLADevicePool(1, 64 * P, P, 16, dtype=torch.float32)  # 4 KiB a page: short copies
    host = pk.MLAHostPool(dev, layout="page_first_direct", io_backend="direct")
    plan = host.prepare(dev, page_tokens(torch.tensor([3, 9, 1, 20, 7, 12, 30, 5]), P), page_tokens(torch.tensor([8, 2, 40, 11, 0, 33, 6, 17]), P))
    simulated.dma_streams = 4
    plan.backup()
    assert len(made) == 4 and sum(made) == 8
    made.clear()
    simulated.dma_streams = 2
    plan.backup()
    assert len(made) == 2 and sum(made) == 8
    host.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_movers_keep_no_host_pool_alive(bind, name):
    """A pool used on every io path its backend offers, by plans and the per-call API, then
    closed and dropped with its plans: its host buffers are freed."""
    backend = bind(name)
    dev = pk.DeviceKVPool(LAYERS, TOKENS, P, 2, 8, 4, dtype=torch.float16)
    alive = []
    for io in backend.io_backends:
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io)
        plan = host.prepare(dev, torch.arange(8), torch.arange(8).to(dev.device))
        plan.load_all()
        plan.backup(1)
        host.backup_from_device_per_layer(dev, torch.arange(8, 16), torch.arange(8).to(dev.device), 0)
        backend.synchronize()
        alive += [weakref.ref(host.k_buffer), weakref.ref(host.v_buffer)]
        host.close()
        host.close()  # idempotent
        del host, plan
    gc.collect()
    assert [ref() is None for ref in alive] == [True] * len(alive), "a mover, plan or backend cache keeps a host buffer alive"


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
def test_dtypes_the_movers_take(bind, name):
    backend = bind(name)
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn):
        backend.check_dtype(dtype)
    for dtype in (torch.complex64, torch.complex128, torch.complex32):
        with pytest.raises(TypeError, match=r"^dtype: .*got torch\.complex"):
            backend.check_dtype(dtype)


def test_a_complex_device_pool_is_refused_before_it_allocates():
    with pytest.raises(TypeError, match="^dtype: .*complex"):
        pk.DeviceKVPool(1, 32, P, 1, 8, 8, dtype=torch.complex64)


@pytest.mark.parametrize("name", BACKENDS)
def test_an_io_path_is_refused_by_name_where_it_is_unknown_or_not_offered(bind, name, monkeypatch):
    backend = bind(name)
    dev = pk.DeviceKVPool(LAYERS, TOKENS, P, 2, 8, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"^io_backend: expected one of {', '.join(IO_PATHS)}, got 'dma2'"):
        pk.AsymmetricHostPool(dev, io_backend="dma2")
    host = pk.AsymmetricHostPool(dev, io_backend=backend.io_backends[0])
    with pytest.raises(ValueError, match="^io_backend: expected one of"):
        host.load_to_device_per_layer(dev, torch.arange(P), torch.arange(P), 0, io_backend="dma2")
    assert host.stats()["last_error"].startswith("ValueError: io_backend")
    monkeypatch.setattr(type(backend), "offers_bulk", property(lambda self: False))
    with pytest.raises(ValueError, match=rf"^io_backend: backend {name!r} offers kernel, direct, staged, auto, got 'bulk'"):
        host.load_to_device_per_layer(dev, torch.arange(P), torch.arange(P), 0, io_backend="bulk")
    host.close()


def test_a_backends_kernel_mover_serves_every_path_that_hands_transfers_to_the_kernel_path(bind, monkeypatch):
    """A backend is a few factories: a kernel mover of its own takes kernel io, auto's small
    transfers and what the bulk and staged paths hand on, as stats() says."""
    class ReplayLaunch(cpu.IndexingLaunch):
        path = "replay"
        reason = "the replay backend's kernel path"

    class ReplayMover(cpu.IndexingMover):
        def build(self, transfer):
            return ReplayLaunch(transfer)

    class ReplayCpu(cpu.CpuBackend):
        def kernel_mover(self):
            return ReplayMover()

    monkeypatch.setitem(backends._instances, "cpu", ReplayCpu())
    bind("cpu")
    dev, host = pools("page_first_direct", "kernel", validate=False)
    idx = page_tokens(torch.tensor([3, 1]), P)
    host.load_to_device_per_layer(dev, idx, idx, 1)
    host.load_to_device_per_layer(dev, idx, idx, 0, io_backend="auto")
    host.load_to_device_per_layer(dev, torch.tensor([5, host.size]), torch.tensor([5, 6]), 0, io_backend="staged")  # one token outside: not staged
    expect_loaded(dev, host, "page_first_direct", idx.tolist(), idx.tolist(), range(LAYERS))
    paths = host.stats()["paths"]
    assert paths["kernel"] == {"replay": {"calls": 1, "reason": "the replay backend's kernel path"}}
    assert list(paths["auto"]) == ["replay"] and "latency" in paths["auto"]["replay"]["reason"]
    assert paths["staged"] == {"replay": {"calls": 1, "reason": "staging cannot carry it"}}
    host.close()


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
    assert backend.copier is runtime, "direct and staged io copy through the vendor runtime"
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

