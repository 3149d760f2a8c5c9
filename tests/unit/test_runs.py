"""Host runs -> copies (runs.py) and the staged mover that executes them, without a GPU:
run detection, the 2-D copy of each layout, chunking and the staging bound; the staged
path on a simulated GPU (the real kernel arguments, executed by the kernel model) and
against a fake HIP runtime (which calls, in which order); the auto rule."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import replace

import numpy as np
import pytest
import torch
from fake_runtimes import CUDART_SYMBOLS, FAKE_STREAM, HIP_SYMBOLS, FakeLib, fake_rocm_backend
from kvspec import bits, host_row, page_tokens, randomize

import portable_kv as pk
from portable_kv import backends
from portable_kv.backends import cuda, rocm
from portable_kv.backends.runtime import MEMCPY_DEFAULT, DeviceError
from portable_kv.io import auto, context, staged
from portable_kv.io import kernel_args as ka
from portable_kv.io import staged_plan as runs
from portable_kv.io.streams import InlineStreams
from portable_kv.layout import host_shape
from portable_kv.transfer import tensor_pair

STREAM = FAKE_STREAM
L, H, KD, VD, ITEM = 8, 4, 192, 128, 2  # MiMo-V2's K 192 / V 128, 4 heads, bf16
K_TOKEN, V_TOKEN = H * KD * ITEM, H * VD * ITEM


def pairs(layout: str, page_size: int, pages: int = 64):
    """K and V of a host pool in `layout`, and a one-page device pool per layer."""
    device = [[torch.empty(page_size, H, d, dtype=torch.bfloat16) for _ in range(L)] for d in (KD, VD)]
    return tuple(tensor_pair(torch.empty(host_shape(layout, L, pages, page_size, H, d), dtype=torch.bfloat16), device[n], layout, page_size)
                 for n, d in enumerate((KD, VD)))


def page_slots(pages, page_size: int) -> np.ndarray:
    return page_tokens(torch.tensor(pages), page_size).numpy()


def plan(layout: str, page_size: int, host_idx: np.ndarray, layers: range, slot_bytes: int = 32 << 20):
    return runs.build(host_idx, pairs(layout, page_size), layout, page_size, layers, L, slot_bytes)


# -- runs and copies -------------------------------------------------------------------------


def test_runs_break_where_tokens_jump_at_chunks_and_registrations():
    idx = np.array([4, 5, 6, 7, 8, 20, 21, 3])
    starts, lengths = runs.host_runs(idx, np.array([0, 8]))
    assert starts.tolist() == [0, 5, 7] and lengths.tolist() == [5, 2, 1]
    starts, lengths = runs.host_runs(idx, np.array([0, 4, 8]))
    assert starts.tolist() == [0, 4, 5, 7] and lengths.tolist() == [4, 1, 2, 1]
    starts, lengths = runs.host_runs(idx, np.array([0, 3, 6, 8]))
    assert starts.tolist() == [0, 3, 5, 6, 7] and lengths.tolist() == [3, 2, 1, 1, 1]
    starts, lengths = runs.host_runs(idx, np.array([0, 8]), registration_tokens=(6,))
    assert starts.tolist() == [0, 2, 5, 7]


def test_page_first_direct_per_layer_run_is_one_row_per_page():
    P = 16
    staged_plan = plan("page_first_direct", P, page_slots([3, 4, 5, 6, 40], P), range(2, 3))
    k, v = staged_plan.copies
    page_bytes = L * P * K_TOKEN
    assert k.width.tolist() == [P * K_TOKEN] * 2 and k.height.tolist() == [4, 1]
    assert k.host_pitch[0] == page_bytes and k.staging_pitch[0] == P * K_TOKEN
    assert k.host.tolist() == [3 * page_bytes, 40 * page_bytes]  # the layer term is added per call
    assert k.staging.tolist() == [0, 4 * P * K_TOKEN]
    assert v.width[0] == P * V_TOKEN and staged_plan.offsets[1] % runs.STAGING_ALIGN == 0
    assert staged_plan.staging[0].layer == 0, "one staged layer: the kernel's absolute layer lands on it"


def test_whole_pages_over_all_layers_are_one_flat_copy():
    P = 16
    for layout in ("page_first_direct", "page_head"):
        k, _ = plan(layout, P, page_slots([3, 4, 5, 9], P), range(L)).copies
        assert k.height.tolist() == [1, 1] and k.width.tolist() == [3 * L * P * K_TOKEN, L * P * K_TOKEN]


def test_layer_first_all_layers_is_one_row_per_layer():
    P = 4
    k, _ = plan("layer_first", P, np.arange(8, 8 + 10), range(L)).copies
    assert len(k) == 1 and k.width[0] == 10 * K_TOKEN and k.height[0] == L
    assert k.host_pitch[0] == 64 * P * K_TOKEN and k.staging_pitch[0] == runs.chunk_tokens(10, (K_TOKEN + V_TOKEN) * L, P, 32 << 20) * K_TOKEN


def test_page_first_per_layer_is_one_row_per_token_and_all_layers_one_copy():
    P = 1
    k, _ = plan("page_first", P, np.arange(5, 5 + 12), range(3, 4)).copies
    assert (k.width[0], k.height[0], k.host_pitch[0], k.staging_pitch[0]) == (K_TOKEN, 12, L * K_TOKEN, K_TOKEN)
    k, _ = plan("page_first", P, np.arange(5, 5 + 12), range(L)).copies
    assert (k.width[0], k.height[0]) == (12 * L * K_TOKEN, 1)


def test_page_head_per_layer_rows_are_one_head_row():
    """What the link rule refuses: 384-byte rows, one 2-D copy per page and head... or fewer where they continue."""
    P = 4
    staged_plan = plan("page_head", P, page_slots([2, 3], P), range(1, 2))
    k, _ = staged_plan.copies
    assert set(k.width.tolist()) == {KD * ITEM} and k.height.sum() * k.width[0] == 2 * P * K_TOKEN
    assert not staged.LINK_RULE.carries(staged_plan) and staged.EVERY_SCHEDULE.carries(staged_plan)


def test_pitches_past_the_device_maximum_become_rows_of_their_own(monkeypatch):
    monkeypatch.setattr(runs, "MAX_PITCH", 1000)
    k, _ = plan("layer_first", 4, np.arange(8, 18), range(L)).copies
    assert len(k) == L and set(k.height.tolist()) == {1}
    assert np.diff(k.host).tolist() == [64 * 4 * K_TOKEN] * (L - 1)


def test_k_and_v_are_folded_each_by_its_own_strides():
    """page_head with one layer: one K head makes K's pages adjacent, two V heads keep V's apart."""
    P = 2
    host = [torch.empty(host_shape("page_head", 1, 4, P, heads, 1), dtype=torch.float16) for heads in (1, 2)]
    device = [[torch.empty(8, heads, 1, dtype=torch.float16)] for heads in (1, 2)]
    both = tuple(tensor_pair(h, d, "page_head", P) for h, d in zip(host, device))
    k, v = runs.build(np.arange(4), both, "page_head", P, range(0, 1), 1, 1 << 20).copies
    assert (k.width[0], k.height[0]) == (8, 1) and (v.width[0], v.height[0]) == (16, 1)


def test_page_layouts_need_whole_pages_and_layers_one_or_all():
    P = 4
    assert plan("page_first_direct", P, np.array([1, 2, 3, 4]), range(0, 1)) is None  # not page aligned
    assert plan("page_first_direct", P, page_slots([1], P), range(2, 5)) is None
    assert plan("layer_first", P, np.array([1, 2, 3, 4]), range(0, 1)) is not None


# -- chunks and the staging bound --------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunks_are_whole_pages_within_a_slot(page_size):
    token_bytes = (K_TOKEN + V_TOKEN) * L
    for tokens in (page_size, 1000 * page_size):
        for slot in (token_bytes * page_size, 1 << 20, 32 << 20):
            chunk = runs.chunk_tokens(tokens, token_bytes, page_size, slot)
            fits = slot // (token_bytes * page_size) * page_size  # whole pages a slot holds
            assert chunk % page_size == 0 and chunk * token_bytes <= slot and (chunk == 0) == (fits == 0)
            if chunk:
                assert -(-tokens // chunk) <= max(runs.PIPELINE_CHUNKS, -(-tokens // fits))
    assert runs.chunk_tokens(100, token_bytes, page_size, token_bytes * page_size - 1) == 0


def test_a_plan_fits_its_slot_and_cuts_runs_at_chunks():
    P = 16
    idx = page_slots(range(10, 74), P)  # one run of 64 pages
    slot = 3 * L * P * (K_TOKEN + V_TOKEN) + runs.STAGING_ALIGN
    staged_plan = plan("page_first_direct", P, idx, range(L), slot)
    assert staged_plan.slot_bytes <= slot and staged_plan.chunk_tokens == 3 * P
    assert len(staged_plan.chunks) == 22 and [len(c) for c in staged_plan.chunks][-1] == P
    k, _ = staged_plan.copies
    assert len(k) == 22 and k.chunk_ends.tolist() == list(range(1, 23))
    assert plan("page_first_direct", P, idx, range(L), L * P * (K_TOKEN + V_TOKEN) - 1) is None


@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunks_taper_to_a_small_tail_no_faster_than_the_kernel_keeps_up(page_size, to_device):
    """A load's chunks shrink toward its end (a backup's grow from its start) by no more than
    TAPER a step, down to about TAIL_BYTES: the kernel of the last chunk alone is the tail,
    and no copy waits for a slot.  Every chunk starts on a page, and a slot holds its pages."""
    token_bytes = (K_TOKEN + V_TOKEN)  # one layer: a per-layer load
    page_bytes = token_bytes * page_size
    for total, odd in ((100e6, 0), (800e6, 0), (3e6, 0), (page_bytes, 0), (100e6, page_size // 2), (3e6, page_size - 1)):
        tokens = max(page_size, int(total // page_bytes) * page_size) + odd  # odd: a token layout's last part page
        for slot in (32 << 20, 4 << 20, page_bytes):
            bounds = runs.chunk_bounds(tokens, token_bytes, page_size, slot, to_device)
            sizes = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == tokens and (sizes > 0).all()
            assert (bounds[:-1] % page_size == 0).all(), "every chunk starts on a page"
            assert (-(-sizes // page_size) * page_size * token_bytes <= slot).all(), "a slot holds each chunk's pages"
            order = sizes if to_device else sizes[::-1]  # in the order the pipeline drains them
            full = runs.chunk_tokens(tokens, token_bytes, page_size, slot)
            tail = max(page_size, -(-(runs.TAIL_BYTES // token_bytes) // page_size) * page_size)
            if tokens >= 4 * full and full > 2 * tail:
                assert order[-1] <= tail + page_size, "the tail is one small chunk"
                shrink = order[1:] / order[:-1]
                assert (shrink >= runs.TAPER - page_size / order[1:]).all(), "no chunk less than TAPER of the one before"


# -- the staged mover on a simulated GPU and against a fake HIP runtime -------------------------


def filled_pools(layout: str = "page_first_direct", io: str = "staged", P: int = 4, layers: int = 3):
    dev = pk.DeviceKVPool(layers, 16 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend=io)
    gen = torch.Generator().manual_seed(5)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


def test_staged_on_the_simulated_gpu_runs_the_kernel_arguments_and_2d_copies(simulated, monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(8 << 10))  # several chunks, both slots
    for layout in pk.LAYOUTS:
        dev, host = filled_pools(layout)
        host_idx, dev_idx = page_tokens(torch.tensor([3, 4, 5, 6, 11]), 4), page_tokens(torch.tensor([9, 0, 2, 7, 1]), 4)
        simulated.runtime.launches.clear()
        simulated.runtime.copies_2d.clear()
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        for layer in range(3):
            expect_k = bits(dev.k_buffer[layer][dev_idx])
            dev.k_buffer[layer].zero_()
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
            assert torch.equal(bits(dev.k_buffer[layer][dev_idx]), expect_k), f"{layout} layer {layer}"
        assert simulated.runtime.copies_2d, "the host side moved by 2-D copies"
        assert {grid for _, grid, _ in simulated.runtime.launches} <= set(range(1, context.STAGING_BLOCKS + 1))
        host.close()


@pytest.fixture
def fake_rocm(monkeypatch, tmp_path):
    backend, _, _, lib = fake_rocm_backend(monkeypatch, tmp_path)
    monkeypatch.setitem(backends._instances, "rocm", backend)
    monkeypatch.setattr(rocm.RocmBackend, "unavailable_reason", classmethod(lambda cls: None))
    before = backends.current().name
    backends.use("rocm")
    yield backend, lib
    backends.use(before)


def test_rocm_staged_issues_2d_copies_then_the_kernel_and_mirrored(fake_rocm, monkeypatch):
    backend, lib = fake_rocm
    P = 16
    slot = 2 * P * (4 * 192 + 4 * 128) * 2 + runs.STAGING_ALIGN  # K and V of two pages of one layer: two chunks below
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * slot))
    dev = pk.DeviceKVPool(4, 256, P, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="staged")
    # Both index tensors kept: a launch (and the plan) lives while its indices do; its
    # arguments are read back below.
    host_idx, dev_idx = page_tokens(torch.tensor([2, 3, 4, 8]), P), page_tokens(torch.tensor([9, 1, 5, 6]), P)
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 2)
    calls = [name for name, _ in lib.calls if name != "hipSetDevice"]  # the thread's device, bound once
    # Chunk 0: pages 2-3, one copy each of K and V; chunk 1: pages 4 and 8, two each.
    assert calls == ["hipMemcpy2DAsync"] * 2 + ["hipModuleLaunchKernel"] + ["hipMemcpy2DAsync"] * 4 + ["hipModuleLaunchKernel"]
    copies = [args for name, args in lib.calls if name == "hipMemcpy2DAsync"]
    page = 4 * P * 4 * 192 * 2  # K bytes of one page, all layers
    k_first = copies[0]
    dst, dpitch, src, spitch, width, height, kind, stream = k_first
    assert src == host.k_buffer.data_ptr() + 2 * page + 2 * P * 4 * 192 * 2, "pages 2-3 of layer 2"
    assert (width, height, spitch, dpitch, kind, stream) == (P * 4 * 192 * 2, 2, page, P * 4 * 192 * 2, MEMCPY_DEFAULT, STREAM)
    launch = [args for name, args in lib.calls if name == "hipModuleLaunchKernel"][0]
    args = ka.CopyArgs.from_address(ctypes.c_void_p.from_address(launch[9]).value)
    assert launch[1] <= context.STAGING_BLOCKS and launch[8] == STREAM
    assert (args.tokens, args.layer_begin, args.to_device, args.job[0].host_layer, args.job[0].host_base) == (2 * P, 2, 1, 0, dst)
    assert args.stream_device == 1, "the staged kernel streams its device-side writes"
    lib.calls.clear()
    host.backup_from_device_per_layer(dev, host_idx, dev_idx, 1)
    assert [name for name, _ in lib.calls] == ["hipModuleLaunchKernel"] + ["hipMemcpy2DAsync"] * 2 + ["hipModuleLaunchKernel"] + ["hipMemcpy2DAsync"] * 4
    host.close()


def test_rocm_staged_batches_the_copies_of_long_rows(fake_rocm):
    """A layer_first host's per-layer run of 4096 tokens is one row a chunk (~1.5 MiB of K,
    ~1 MiB of V): each chunk's copies go as one hipMemcpyBatchAsync of its K and V rows,
    then the kernel."""
    _, lib = fake_rocm
    P = 16
    dev = pk.DeviceKVPool(2, 4096, P, 4, 192, 128, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="staged")
    host_idx, dev_idx = torch.arange(4096), page_tokens(torch.randperm(256), P)
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)
    calls = [(name, args) for name, args in lib.calls if name != "hipSetDevice"]
    names = [name for name, _ in calls]
    chunks = names.count("hipModuleLaunchKernel")
    assert chunks > 1 and names == ["hipMemcpyBatchAsync", "hipModuleLaunchKernel"] * chunks
    assert all(args[3] == 2 and args[-1] == STREAM for name, args in calls if name == "hipMemcpyBatchAsync"), "K's row and V's, on the stream"
    host.close()


def test_rocm_moves_an_mla_pool_as_one_buffer_on_every_path(fake_rocm, monkeypatch):
    """DeepSeek-V3's latent (576 bf16 a token): kernel io, one launch whose second job holds no
    vector; direct io, one batched call of a copy per page of the layer (a page_first_direct
    host keeps a layer's pages apart); staged io, one 2-D copy of each run of host pages a
    chunk, then the kernel."""
    _, lib = fake_rocm
    P, D = 16, 576
    row = D * 2
    dev = pk.MLADevicePool(4, 256, P, D, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    host_idx, dev_idx = page_tokens(torch.tensor([2, 3, 4, 8]), P), page_tokens(torch.tensor([9, 1, 5, 6]), P)
    page = 4 * P * row  # one host page, all layers
    for io in ("kernel", "direct", "staged"):
        monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * (2 * P * row)))  # a slot: two pages of one layer
        host = pk.MLAHostPool(dev, layout="page_first_direct", io_backend=io)
        lib.calls.clear()
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 2)
        calls = [(name, args) for name, args in lib.calls if name != "hipSetDevice"]
        names = [name for name, _ in calls]
        if io == "kernel":
            assert names == ["hipModuleLaunchKernel"]
            args = ka.CopyArgs.from_address(ctypes.c_void_p.from_address(calls[0][1][9]).value)
            assert args.job[0].chunk_bytes == row and args.job[0].host_base == host.kv_buffer.data_ptr()
            assert args.job[1].vec_begin == args.total_vecs == 4 * P * row // 16
        elif io == "direct":
            (name, batch), = calls
            assert name == "hipMemcpyBatchAsync" and batch[3] == 4
        else:
            # Chunk 0: pages 2-3, one 2-D copy; chunk 1: pages 4 and 8, one each.
            assert names == ["hipMemcpy2DAsync", "hipModuleLaunchKernel", "hipMemcpy2DAsync", "hipMemcpy2DAsync", "hipModuleLaunchKernel"]
            dst, dpitch, src, spitch, width, height, kind, stream = calls[0][1]
            assert src == host.kv_buffer.data_ptr() + 2 * page + 2 * P * row and (width, height, spitch) == (P * row, 2, page)
        host.close()


def staging_auto_pool() -> tuple:
    """A small layer_first pool on auto io whose rule, scaled down, stages its loads."""
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="auto")
    mover = host._mover("auto")
    mover.movers.pop("bulk")  # auto's staging rule, as on a backend without the bulk path
    mover.rule = replace(staged.LINK_RULE, min_row_bytes=128, min_copy_bytes=4 * P * 2 * 24 * 2, batch_row_bytes=1024)
    return dev, idx, host, mover


def test_auto_loads_through_the_kernel_path_while_a_staged_backup_runs(cpu_backend, monkeypatch):
    """A load that auto would stage takes the kernel path while the pool's latest staged
    backup has not completed (its event not done), and stages again once it has."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)

    class Streams(InlineStreams):  # a GPU's events, whose completion the test decides
        running = False

        def event(self) -> object:
            return object()

        def done(self, event: object) -> bool:
            return not self.running

    dev, idx, host, mover = staging_auto_pool()
    streams = mover.movers["staged"].streams = Streams(lambda: 0)
    host.load_to_device_per_layer(dev, idx, idx, 1)
    assert mover.last_choice == "staged", "no backup yet"
    streams.running = True
    host.backup_from_device_all_layer(dev, idx, idx)
    assert mover.last_choice == "staged"
    host.load_to_device_per_layer(dev, idx, idx, 1)
    assert mover.last_choice == "kernel", "the backup still runs"
    streams.running = False
    host.load_to_device_per_layer(dev, idx, idx, 1)
    assert mover.last_choice == "staged", "the backup is done"
    host.close()


def test_indices_the_pool_may_not_read_stay_unread_and_auto_takes_the_kernel_path(cpu_backend, monkeypatch):
    """A pool that must not read GPU-resident indices on the host (SGLang's kernel io passes
    both on the GPU, its load stream held behind the model's) validates what is on the CPU,
    reads nothing else, and `auto` then takes the kernel path, the one that plans nothing
    from their values. Meta tensors stand in for GPU-resident ones: reading one fails."""
    from portable_kv import validation
    from portable_kv.indices import IndexPair
    from portable_kv.validation import IndexValidator

    checked = validation.index_tensor
    monkeypatch.setattr(validation, "index_tensor", lambda name, value: value if value.is_meta else checked(name, value))
    validator = IndexValidator(host_tokens=64, page_size=4, layout="layer_first", validate=True)
    on_gpu = torch.arange(8, device="meta")
    with pytest.raises(NotImplementedError):
        validator(on_gpu, on_gpu, 64, True)  # read on the host: what the pool asked not to do
    validator.read_gpu_indices = False
    for host_idx, dev_idx in ((on_gpu, on_gpu), (torch.arange(8), on_gpu), (on_gpu, torch.arange(8))):
        assert validator(host_idx, dev_idx, 64, True).host_readable is False
    with pytest.raises(ValueError, match="host_indices"):
        validator(torch.arange(60, 68), on_gpu, 64, True)  # CPU-resident ones are still checked
    with pytest.raises(ValueError, match="device_indices"):
        validator(on_gpu, torch.arange(60, 68), 64, True)
    assert validator(torch.arange(8), torch.arange(8), 64, True).host_readable is True

    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    dev, idx, host, mover = staging_auto_pool()
    host.load_to_device_per_layer(dev, idx, idx, 1)
    assert mover.last_choice == "staged", "rows long enough to stage, indices readable"
    validate = IndexValidator.__call__

    def unreadable(self, *args):
        pair = validate(self, *args)
        return IndexPair(*pair._given, pair.snapshots, host_readable=False)

    monkeypatch.setattr(IndexValidator, "__call__", unreadable)
    # The CPU's kernel path reads them (it is the oracle); auto's plans must not.
    monkeypatch.setattr(auto, "run_offsets", lambda *args: pytest.fail("auto planned from indices it was told not to read"))
    monkeypatch.setattr(mover.movers["staged"], "prepared", lambda *args: pytest.fail("auto planned staging from them"))
    host.load_to_device_per_layer(dev, idx.clone(), idx.clone(), 1)
    assert mover.last_choice == "kernel"
    host.close()


class LoggedStreams(InlineStreams):
    """A GPU's streams as names and its events as objects: every record and wait logged."""

    def __init__(self) -> None:
        super().__init__(lambda: 0)
        self.stream, self.log = "engine", []

    def current(self) -> str:
        return self.stream

    def side(self, current: str) -> tuple[str, str]:
        return f"copies after {current}", f"kernels after {current}"

    @staticmethod
    def using(stream: str) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def event(self) -> object:
        return object()

    def handle(self, stream: str) -> int:
        return hash(stream)

    def record(self, event: object, stream: str) -> None:
        self.log.append(("record", event, stream))

    def wait(self, stream: str, event: object) -> None:
        self.log.append(("wait", stream, event))


def test_a_staged_load_waits_for_its_stream_where_a_backup_was_issued_since(cpu_backend, monkeypatch):
    """A staged load's copies wait for the current stream on the first load, after any backup
    of the pool (on any io path), on another stream, and when told to; a load behind
    another load copies at once (its scatters, on a kernel stream of their own, still
    follow the current stream).  Chunks alternate between the slots across calls too, so
    a load's first copy never waits for the slot of the load before it's last scatter."""
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="staged")
    mover = host._mover("staged")
    mover.staging_bytes = 2 * 5 * P * 2 * (24 + 16) * 2 + 1024  # 5 pages a slot: 7 chunks a load
    streams = mover.streams = LoggedStreams()
    mover._start = streams.event()
    slots_used = []
    real_copy = mover._copy
    monkeypatch.setattr(mover, "_copy", lambda t, p, c, slot, s: slots_used.append(slot) or real_copy(t, p, c, slot, s))

    def waited_for_stream(call) -> bool:
        streams.log.clear()
        call()
        current = streams.stream
        assert ("record", mover._start, current) in streams.log and ("wait", f"kernels after {current}", mover._start) in streams.log, \
            "the scatters always follow the current stream's earlier work"
        assert streams.log[-1][:2] == ("wait", current), "the current stream's next work follows the last scatter"
        return ("wait", f"copies after {current}", mover._start) in streams.log

    assert waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 0)), "the first load"
    chunks = len(slots_used)
    assert chunks % 2 == 1, "an odd chunk count, so that the next load starts on the other slot"
    assert not waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 1)), "a load behind a load"
    assert all(a is not b for a, b in zip(slots_used, slots_used[1:])), "slots alternate across the two calls"
    host.backup_from_device_per_layer(dev, idx, idx, 1, io_backend="kernel")
    assert waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 0)), "a backup was issued since"
    assert not waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 1))
    streams.stream = "another"
    assert waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 1)), "another stream"
    mover.wait_each_load = True
    assert waited_for_stream(lambda: host.load_to_device_per_layer(dev, idx, idx, 1)), "told to wait each load"
    host.close()


@pytest.mark.parametrize("io", ["staged", "auto"])
def test_loads_and_backups_of_the_same_indices_keep_their_plans_side_by_side(cpu_backend, monkeypatch, io):
    """A load, a backup and a per-layer load of the same indices each plan once (a plan costs
    ~10 ms of host time on a 100 MB transfer), however they alternate."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    made = []
    real_plan = runs.build
    monkeypatch.setattr(runs, "build", lambda *a, **k: made.append(a[-1]) or real_plan(*a, **k))
    P = 4
    dev = pk.DeviceKVPool(3, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend=io)
    if io == "auto":
        host._mover("auto").movers.pop("bulk")  # auto's staged plans, as on a backend without the bulk path
    for _ in range(3):
        host.load_to_device_all_layer(dev, idx, idx)
        host.backup_from_device_all_layer(dev, idx, idx)
        host.load_to_device_per_layer(dev, idx, idx, 1)
    assert sorted(made) == [False, True, True], "one plan each: all-layer load, backup, per-layer load"
    host.close()


def test_cuda_and_hip_events_are_twins():
    """The staged path's events through each vendor's runtime: the same calls, the same
    arguments, not-ready (600 on both) read as not done, other codes raised by name."""
    for runtime, prefix in ((cuda.CudaRuntime(lib=FakeLib(13000, CUDART_SYMBOLS)), "cuda"),
                            (rocm.HipRuntime(lib=FakeLib(70200000, HIP_SYMBOLS)), "hip")):
        runtime.event_create()
        runtime.event_record(0xE0, STREAM)
        runtime.stream_wait_event(STREAM + 1, 0xE0)
        runtime.event_synchronize(0xE0)
        assert runtime.event_done(0xE0)
        runtime.event_destroy(0xE0)
        assert runtime.lib.calls == [(prefix + "EventCreateWithFlags", [("byref", "c_void_p"), 2]), (prefix + "EventRecord", [0xE0, STREAM]),
                                     (prefix + "StreamWaitEvent", [STREAM + 1, 0xE0, 0]), (prefix + "EventSynchronize", [0xE0]),
                                     (prefix + "EventQuery", [0xE0]), (prefix + "EventDestroy", [0xE0])]
        runtime.lib.failing[prefix + "EventQuery"] = 600
        assert not runtime.event_done(0xE0)
        runtime.lib.failing[prefix + "EventQuery"] = 700
        with pytest.raises(DeviceError, match=prefix + "EventQuery"):
            runtime.event_done(0xE0)


def test_cuda_and_hip_2d_copies_are_twins():
    for runtime, name in ((cuda.CudaRuntime(lib=FakeLib(13000, CUDART_SYMBOLS)), "cudaMemcpy2DAsync"),
                          (rocm.HipRuntime(lib=FakeLib(70200000, HIP_SYMBOLS)), "hipMemcpy2DAsync")):
        runtime.memcpy_2d(1 << 30, 4096, 1 << 20, 1536, 1536, 7, STREAM)
        assert runtime.lib.calls == [(name, [1 << 30, 4096, 1 << 20, 1536, 1536, 7, MEMCPY_DEFAULT, STREAM])]


# -- the auto rule ----------------------------------------------------------------------------


@pytest.fixture
def cpu_backend():
    before = backends.current().name
    yield backends.use("cpu")
    backends.use(before)


# The last column: where the backend offers the bulk path, which takes every transfer that
# direct's few long copies do not.
@pytest.mark.parametrize("layout,host_pages,device_pages,chosen,beside_bulk", [
    ("layer_first", range(0, 32), range(0, 32), "direct", "direct"),  # runs on both sides: straight copy engines
    ("page_first_direct", range(0, 32), range(0, 32), "staged", "bulk"),  # its pages are apart on the host: direct copies one each
    ("page_first_direct", range(0, 32), list(range(31, -1, -1)), "staged", "bulk"),  # a run on the host, scattered on the device
    ("page_first_direct", list(range(0, 64, 2)), range(0, 32), "kernel", "bulk"),  # single pages on the host: short copies
])
@pytest.mark.parametrize("bulk", [False, True])
def test_auto_picks_by_the_plan(cpu_backend, monkeypatch, layout, host_pages, device_pages, chosen, beside_bulk, bulk):
    if bulk:
        chosen = beside_bulk
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout=layout, io_backend="auto")
    gen = torch.Generator().manual_seed(2)
    for t in dev.k_buffer + dev.v_buffer:
        randomize(t, gen)
    mover = host._mover("auto")
    if not bulk:
        mover.movers.pop("bulk")
    # The link rule scaled to this pool's 192-byte K rows: 4 pages a copy.
    mover.rule = staged.StagingRule(min_row_bytes=128, min_copy_bytes=4 * P * 2 * 24 * 2)
    monkeypatch.setattr(auto, "DIRECT_MIN_COPY_BYTES", mover.rule.min_copy_bytes)
    used = []
    for name, sub in mover.movers.items():
        monkeypatch.setattr(sub, "move", lambda t, name=name, move=sub.move: (used.append(name), move(t)))
    host_idx, dev_idx = page_tokens(torch.tensor(list(host_pages)), P), page_tokens(torch.tensor(list(device_pages)), P)
    host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    assert used == [chosen]
    for layer in range(2):
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            assert torch.equal(bits(host_row(host.k_buffer, layout, P, h, layer)), bits(dev.k_buffer[layer][d]))
    host.close()


def test_auto_stages_only_the_transfers_its_rule_allows(cpu_backend, monkeypatch):
    """The GPUs' rule stages backups, and loads only where their copies are batched
    (measured: staged loads as 2-D copies did not beat the kernel path; batched ones and
    staged backups did)."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    rule = staged.LINK_RULE
    assert rule.auto_stages(False, False) and rule.auto_stages(True, True) and not rule.auto_stages(True, False)
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    # Rows of 192 bytes (a page_first_direct page of one layer): 2-D copies.  A layer_first
    # host's per-layer run is one row of 32 pages: batched, at rows of 1 KiB scaled down.
    for layout, loads in (("page_first_direct", "kernel"), ("layer_first", "staged")):
        host = pk.AsymmetricHostPool(dev, layout=layout, io_backend="auto")
        mover = host._mover("auto")
        mover.movers.pop("bulk")  # as on a backend without the bulk path
        mover.rule = replace(rule, min_row_bytes=128, min_copy_bytes=4 * P * 2 * 24 * 2, batch_row_bytes=1024)
        host.backup_from_device_all_layer(dev, idx, idx)
        assert mover.last_choice == "staged" and mover.movers["staged"].last_path == "staged"
        host.load_to_device_per_layer(dev, idx, idx, 1)
        assert mover.last_choice == loads, layout
        host.close()


def test_auto_takes_bulk_where_offered_and_its_plan_carries_the_transfer(cpu_backend, monkeypatch):
    """Beside the model the bulk path costs a few blocks and one launch a call: auto prefers it to
    staging and to the kernel path, and says why; rows not 16-byte aligned go to the kernel path."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    P = 4
    for v_dim, chosen in ((16, "bulk"), (3, "kernel")):
        dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, v_dim, dtype=torch.bfloat16)
        idx = page_tokens(torch.randperm(32), P)
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="auto")
        mover = host._mover("auto")
        host.backup_from_device_all_layer(dev, page_tokens(torch.arange(32), P), idx)
        assert mover.last_choice == chosen, v_dim
        assert ("few blocks" in mover.last_reason) if chosen == "bulk" else ("short runs" in mover.last_reason)
        host.close()


def test_a_pools_paths_share_one_mover_of_each_path(cpu_backend):
    """auto, staged and bulk of one pool delegate to that pool's own movers: one staging
    allocation and one record of staged backups per pool, whichever path issued them."""
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="auto")
    auto_mover = host._mover("auto")
    assert auto_mover.movers["staged"] is host._mover("staged") and auto_mover.movers["kernel"] is host._mover("kernel")
    assert host._mover("staged").fallback is host._mover("kernel")
    assert auto_mover.movers["bulk"] is host._mover("bulk")
    flags = {id(m.bad_index) for m in host._movers.values()}
    assert len(flags) == 1, "one bad-index flag per pool"
    host.close()
    assert host._movers == {}


def test_a_pool_keeps_the_io_settings_read_when_it_was_built(cpu_backend, monkeypatch):
    """Staging size and blocks are read once, into the pool's io context: a path first used
    after the environment changed still takes the pool's values; a new pool takes the new ones."""
    P = 4
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(1 << 20))
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "3")
    built = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="kernel")
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 << 20))
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "5")
    later = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="kernel")
    try:
        assert built._mover("staged").staging_bytes == 1 << 20 and built._mover("auto").movers["staged"].staging_bytes == 1 << 20
        assert later._mover("staged").staging_bytes == 2 << 20
        assert (built._io_context.settings.staging_blocks, later._io_context.settings.staging_blocks) == (3, 5)
    finally:
        built.close()
        later.close()


def test_the_simulated_gpus_staging_kernel_takes_the_pools_blocks(simulated, monkeypatch):
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "3")
    dev = pk.DeviceKVPool(2, 32 * 4, 4, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="staged")
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "7")
    try:
        assert host._mover("staged").kernel.block_quota == 3
    finally:
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
