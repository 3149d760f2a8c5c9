"""The staged io path without a GPU: on the simulated GPU (the real kernel arguments, run by
the kernel model, and 2-D copies), against a fake HIP runtime (which calls, in which order,
with what), and its stream ordering through streams that log; the vendor runtimes' events
and 2-D copies as twins; the io settings a pool reads once."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from fake_runtimes import CUDART_SYMBOLS, FAKE_STREAM, HIP_SYMBOLS, FakeLib
from kvspec import bits, page_tokens, randomize

import portable_kv as pk
from portable_kv.backends import cuda, rocm
from portable_kv.backends.runtime import MEMCPY_DEFAULT, DeviceError
from portable_kv.io import context
from portable_kv.io import kernel_args as ka
from portable_kv.io import staging_schedule as schedule
from portable_kv.io.streams import InlineStreams

STREAM = FAKE_STREAM


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
def fake_rocm(fake_rocm_bound):
    return fake_rocm_bound


def test_rocm_staged_issues_2d_copies_then_the_kernel_and_mirrored(fake_rocm, monkeypatch):
    backend, lib = fake_rocm
    P = 16
    slot = 2 * P * (4 * 192 + 4 * 128) * 2 + schedule.STAGING_ALIGN  # K and V of two pages of one layer: two chunks below
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


def test_a_staged_load_waits_for_its_stream_where_a_backup_was_issued_since(cpu_backend, monkeypatch):
    """A staged load's copies wait for the current stream on the first load, after any backup
    of the pool (on any io path), on another stream, and when told to; a load behind
    another load copies at once (its scatters, on a kernel stream of their own, still
    follow the current stream).  Chunks alternate between the slots across calls too, so
    a load's first copy never waits for the slot of the load before it's last scatter."""
    P = 4
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(2 * 5 * P * 2 * (24 + 16) * 2 + 1024))  # 5 pages a slot: 7 chunks a load
    dev = pk.DeviceKVPool(2, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    idx = page_tokens(torch.arange(32), P)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="staged")
    # The CPU orders no streams: the pool's calls (which take the current stream from its io
    # context) and its staged mover are given streams that log, as a GPU's would order its
    # work, before the first call makes the slots (and their events) on them.
    mover = host._io_context.mover("staged")
    streams = mover.streams = host._io_context.streams = LoggedStreams()

    def call(transfer) -> tuple[bool, list[object]]:
        """Whether the copies waited for the current stream, and the slot each chunk's copy waited for."""
        streams.log.clear()
        transfer()
        current, copies, kernels = streams.stream, f"copies after {streams.stream}", f"kernels after {streams.stream}"
        start = next(event for op, event, stream in streams.log if op == "record" and stream == current)
        assert ("wait", kernels, start) in streams.log, "the scatters always follow the current stream's earlier work"
        assert streams.log[-1][:2] == ("wait", current), "the current stream's next work follows the last scatter"
        slots = [event for op, stream, event in streams.log if op == "wait" and stream == copies and event is not start]
        return ("wait", copies, start) in streams.log, slots

    waited, first = call(lambda: host.load_to_device_per_layer(dev, idx, idx, 0))
    assert waited, "the first load"
    assert len(first) % 2 == 1 and len(set(first)) == 2, "an odd chunk count over two slots, so that the next load starts on the other"
    waited, second = call(lambda: host.load_to_device_per_layer(dev, idx, idx, 1))
    assert not waited, "a load behind a load"
    slots = first + second
    assert all(a is not b for a, b in zip(slots, slots[1:])), "slots alternate across the two calls"
    host.backup_from_device_per_layer(dev, idx, idx, 1, io_backend="kernel")
    assert call(lambda: host.load_to_device_per_layer(dev, idx, idx, 0))[0], "a backup was issued since"
    assert not call(lambda: host.load_to_device_per_layer(dev, idx, idx, 1))[0]
    streams.stream = "another"
    assert call(lambda: host.load_to_device_per_layer(dev, idx, idx, 1))[0], "another stream"
    mover.wait_each_load = True  # the A/B switch the bench sets
    assert call(lambda: host.load_to_device_per_layer(dev, idx, idx, 1))[0], "told to wait each load"
    assert host.stats()["paths"]["staged"] == {"staged": {"calls": 6, "reason": ""}}, "every load staged"
    host.close()


def test_a_pool_keeps_the_io_settings_read_when_it_was_built(simulated, monkeypatch):
    """Staging size and blocks are read once, when the pool is built: its staged path, first
    used after the environment changed, still takes the pool's values (one chunk, the
    staging kernel at 3 blocks); a pool built then takes the new ones (many chunks)."""
    P = 4
    dev = pk.DeviceKVPool(2, 64 * P, P, 2, 128, 128, dtype=torch.bfloat16)  # 1 KiB a token and layer
    idx = torch.arange(64 * P)  # 256 KiB a layer: 16384 vectors, work for 8 blocks
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(64 << 20))
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "3")
    built = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="kernel")
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", str(64 << 10))
    monkeypatch.setenv("PORTABLE_KV_STAGING_BLOCKS", "7")
    later = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="kernel")
    launches = simulated.runtime.launches
    try:
        for pool, chunks, grids in ((built, 1, {3}), (later, None, None)):
            launches.clear()
            pool.load_to_device_per_layer(dev, idx, idx, 1, io_backend="staged")
            assert pool.stats()["paths"]["staged"]["staged"]["calls"] == 1
            if chunks is not None:
                assert len(launches) == chunks and {grid for _, grid, _ in launches} == grids
            else:
                assert len(launches) > 4, "32 KiB slots: many chunks"
    finally:
        built.close()
        later.close()


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
