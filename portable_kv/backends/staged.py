"""The `staged` io path (copy engines on the host side, the copy kernel in device memory)
and the `auto` io path (a choice per call between kernel, direct and staged).

SM-issued traffic to host memory crosses PCIe in 128-byte TLPs, which bounds the
kernel path near 93% of the link; the copy engines reach the ceiling, but only
when fed few, large copies.  The host pool owns its placement, so a transfer's
host side is a few runs of consecutive pages, each one 1-D or 2-D copy
(`runs.py`); where those copies' rows average 1 MiB or more (a layer_first host's
per-layer runs, any page layout's all-layer runs) a chunk's rows go as 1-D copies in
one batched call, which the copy engines run with less time between copies than
separate 2-D copies.  The device side (token slots scattered over the engine's pool)
is gathered into, or scattered from, a staging miniature of the host pool in
device memory by the same copy kernel (`kv_copy.h`, or the Triton one), given
staging-local token indices and a block quota of 8.  Chunks alternate between
two staging slots so that copy and kernel overlap:

    load:   copy stream    [copy 0 -> A][copy 1 -> B][copy 2 -> A]...
            kernel stream  .............[scatter A ][scatter B ]...
    backup: kernel stream  [gather -> A][gather -> B][gather -> A]...
            copy stream    .............[copy A    ][copy B    ]...

Both are side streams of the engine's current stream.  Events order each slot's
writer after its last reader, the kernels after everything already on the
current stream, and the current stream after the last kernel (load) or copy
(backup).  A backup's copies follow its gathers; a load's copies start after
everything already on the current stream, except where no backup of the pool
was issued since the mover's last load on that stream waited so: then they need
only their slot, and a load issued behind another (an engine's per-layer loads)
copies while the one before it scatters its last chunk.  The slots alternate
across calls too.  A transfer that staging does not carry well (short runs,
tiny rows, a bad index) goes to the kernel path.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .. import config
from ..cache import IdentityCache
from ..layout import chunking
from ..plan import CopyBatch, IndexPair, TensorPair, Transfer, run_offsets, tensor_pair
from ..runs import Copies, StagedPlan, miniature, plan
from .base import BadIndexFlag, Mover, MoverFactory
from .kernel_args import BLOCK, JobTemplate, PreparedLaunch

# Blocks of the kernel between staging and the KV buffers (PORTABLE_KV_STAGING_BLOCKS):
# it works in HBM, where 8 blocks of 512 threads keep ~256 KB in flight, several times
# what one copy engine drains from PCIe; the model keeps the other SMs.
STAGING_BLOCKS = int(config.STAGING_BLOCKS.default or 8)
PLANS_KEPT = 8  # staged plans per pool: a load's and a backup's indices, a few of each
BATCHES_KEPT = 1024  # a plan's batched copies per (chunk, slot, layer): 61 layers of a 8-chunk load
TEMPLATES_KEPT = 16
LAUNCHES_KEPT = 128  # a prepared launch per chunk (a backup of a large pool has ~30), for a few plans
# Under this many bytes a call is latency: the kernel path's one launch is the cheapest.
AUTO_MIN_BYTES = 4 << 20
# Batched copies this large on average keep the direct path at the link (its descriptors,
# unlike separate copies, follow one another with no gap); smaller ones cost host time.
DIRECT_MIN_COPY_BYTES = 512 << 10

def staging_blocks() -> int:
    """The staged kernel's block quota: PORTABLE_KV_STAGING_BLOCKS, else STAGING_BLOCKS."""
    return config.STAGING_BLOCKS.integer(minimum=1) or STAGING_BLOCKS


Memcpy2D = Callable[[int, int, int, int, int, int, int], None]  # dst, dst_pitch, src, src_pitch, width, height, stream
MemcpyBatch = Callable[[CopyBatch, int], None]  # 1-D copies, stream


@dataclass(frozen=True)
class StagingRule:
    """When staging carries a transfer well.  Copies: each separate copy costs the copy
    engine 2-3 us on the H200 (docs/PERFORMANCE.md), so copies averaging 2 MiB (38 us at
    55 GB/s) lose ~7%, where the kernel path holds 91-94%: below that, staging cannot win.
    Rows: 1 KiB rows kept the engine at 54.4 GB/s on the H200; page_head's per-layer rows
    are one head's 256-384 bytes."""

    min_row_bytes: int = 1024
    min_copy_bytes: int = 2 << 20
    # Rows of this many bytes on average go as 1-D copies, a chunk's in one batched call
    # (cudaMemcpyBatchAsync / hipMemcpyBatchAsync), not as separate 2-D copies: on the H200
    # a layer_first load's 36 copies (2.8 MB each) moved 97.5-98.2% of the ceiling so,
    # against 94.4-95.3% as 2-D copies; a page_first_direct load's 96 KB page rows 88.9%
    # against 92.9% (tools/copy_engine_probe.py --descriptors-only, docs/PERFORMANCE.md).
    batch_row_bytes: int = 1 << 20
    # Which transfers `auto` may stage: loads whose copies go as 2-D copies (a
    # page_first_direct host's), loads whose copies are batched, backups.  Measured on the
    # H200 against the kernel path in one run (bench --section staged, allocator pages
    # after churn, pages of 64 / 16 / 1, back to back): 2-D loads 91.5 / 89.1 / 91.4%
    # against 90.8 / 91.1 / 91.3%; batched loads (layer_first) 94.6 / 94.7 / 94.1% against
    # 91.6 / 91.8 / 91.3%; backups 96.8-98.0% against 93.3-93.7%, with 8 SMs against 16.
    auto_loads: bool = True
    auto_batched_loads: bool = True
    auto_backups: bool = True

    def carries(self, staged: StagedPlan) -> bool:
        return staged.copy_count == 0 or (staged.min_width >= self.min_row_bytes and staged.mean_copy_bytes >= self.min_copy_bytes)

    def auto_stages(self, to_device: bool, batched: bool) -> bool:
        if not to_device:
            return self.auto_backups
        return self.auto_batched_loads if batched else self.auto_loads

    def batches(self, staged: StagedPlan) -> bool:
        rows = sum(int(c.height.sum()) for c in staged.copies)
        return rows > 0 and sum(c.bytes for c in staged.copies) >= rows * self.batch_row_bytes


LINK_RULE = StagingRule(auto_loads=False)
# The CPU backend models the path to run its planning in CI: it stages whatever staging can carry.
EVERY_PLAN = StagingRule(0, 0)


def host_memcpy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """A 2-D copy on the CPU, row by row (the CPU backend's copy engine)."""
    for row in range(height):
        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)


def host_memcpy_batch(batch: CopyBatch, stream: int) -> None:
    """1-D copies on the CPU, one by one (the CPU backend's batched copy)."""
    for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
        ctypes.memmove(dst, src, size)


class DeviceStreams:
    """The device's streams as raw handles, its events through the vendor runtime (`runtime`:
    cuda.py's or rocm.py's, ctypes calls of ~1 us).  The side streams, one pair per thread
    and current stream (a load and a backup that the engine puts on two streams stay two),
    are two torch streams taken one after the other from torch's pool, which the driver
    put on different hardware queues: two streams on one queue run in issue order, and a
    pipeline whose copies and kernels shared one ran them one after the other (34 GB/s
    against 53 on the H200, in ~1 bench row of 8 with the copies on a side stream and the
    kernels on the engine's)."""

    def __init__(self, device: torch.device, runtime: Any) -> None:
        self.device, self.runtime = device, runtime
        self._local = threading.local()

    def current(self) -> int:
        return self.runtime.current_stream()

    def side(self, current: int) -> tuple[int, int]:
        """(copy stream, kernel stream) beside `current`."""
        by_stream = getattr(self._local, "side", None)
        if by_stream is None:
            by_stream = self._local.side = {}
            self._local.streams = {}  # handle -> torch stream, for using() and to keep each alive
        pair = by_stream.get(current)
        if pair is None:
            made = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
            self._local.streams.update({s.cuda_stream: s for s in made})
            pair = by_stream[current] = (made[0].cuda_stream, made[1].cuda_stream)
        return pair

    def using(self, stream: int) -> Any:
        """A context in which `stream` (a side stream of this thread's) is torch's current stream."""
        return torch.cuda.stream(self._local.streams[stream])

    def event(self) -> RuntimeEvent:
        return RuntimeEvent(self.runtime)

    @staticmethod
    def handle(stream: int) -> int:
        return stream

    def record(self, event: RuntimeEvent, stream: int) -> None:
        self.runtime.event_record(event.handle, stream)

    def wait(self, stream: int, event: RuntimeEvent) -> None:
        self.runtime.stream_wait_event(stream, event.handle)

    def synchronize(self, event: RuntimeEvent) -> None:
        self.runtime.event_synchronize(event.handle)

    def done(self, event: RuntimeEvent) -> bool:
        return self.runtime.event_done(event.handle)


class RuntimeEvent:
    """A vendor runtime event, destroyed when the object goes."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self, runtime: Any) -> None:
        self.handle = runtime.event_create()
        weakref.finalize(self, runtime.event_destroy, self.handle)


class InlineStreams:
    """Where every call completes before it returns (the CPU, a simulated GPU): one
    stream, whose handle the runtime names, and no events."""

    def __init__(self, handle: Callable[[], int]) -> None:
        self._handle = handle

    def current(self) -> None:
        return None

    def side(self, current: None) -> tuple[None, None]:
        return None, None

    @staticmethod
    def using(stream: None) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def event(self) -> None:
        return None

    def handle(self, stream: None) -> int:
        return self._handle()

    @staticmethod
    def record(event: None, stream: None) -> None:
        return None

    @staticmethod
    def wait(stream: None, event: None) -> None:
        return None

    @staticmethod
    def synchronize(event: None) -> None:
        return None

    @staticmethod
    def done(event: None) -> bool:
        return True


Streams = DeviceStreams | InlineStreams
_generations = itertools.count(1)


class Slot:
    """One staging buffer and its events: `filled` after its writer, `free` after its reader."""

    def __init__(self, device: torch.device, nbytes: int, streams: Streams) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.address = self.buffer.data_ptr()
        self.filled, self.free = streams.event(), streams.event()
        self.generation = next(_generations)  # the staging views made for this buffer carry it


class Prepared:
    """A staged plan with what each call reuses: the copies as lists, each chunk's
    staging-local indices, and each slot's staging tensor pairs."""

    def __init__(self, staged: StagedPlan, transfer: Transfer) -> None:
        self.plan = staged
        fields = ("host", "staging", "width", "height", "host_pitch", "staging_pitch")
        self.copies = tuple(tuple(getattr(c, f).tolist() for f in fields) for c in staged.copies)
        self.ends = tuple([0, *c.chunk_ends.tolist()] for c in staged.copies)
        k = transfer.pairs[0]
        device = torch.from_numpy(transfer.indices.inside(k.strides.tokens, k.device[0].shape[0])[1])
        self.indices = tuple(IndexPair(torch.arange(len(c), dtype=torch.int64), device[c.start:c.stop]) for c in staged.chunks)
        self._pairs: dict[int, tuple[TensorPair, TensorPair]] = {}
        self._carried: dict[StagingRule, bool] = {}
        self._batched: dict[StagingRule, bool] = {}
        self._rows: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...] | None = None
        self._batches: dict[tuple[int, int, int], CopyBatch] = {}

    def carried_by(self, rule: StagingRule) -> bool:
        """`rule.carries(self.plan)`, answered once per rule: its numpy reductions cost
        ~30 us, which a call would spend before its first copy is enqueued."""
        carried = self._carried.get(rule)
        if carried is None:
            carried = self._carried[rule] = rule.carries(self.plan)
        return carried

    def batched_by(self, rule: StagingRule) -> bool:
        """`rule.batches(self.plan)`, answered once per rule."""
        batched = self._batched.get(rule)
        if batched is None:
            batched = self._batched[rule] = rule.batches(self.plan)
        return batched

    def rows(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows of `chunk`'s 2-D copies as 1-D copies, K's then V's: (0 for K and 1
        for V, host offset without the layer term, offset in the tensor's staging, bytes)."""
        if self._rows is None:
            made = []
            for c in range(len(self.plan.chunks)):
                parts = [_rows_of(copies, ends[c], ends[c + 1]) for copies, ends in zip(self.plan.copies, self.ends)]
                made.append((np.repeat(np.arange(2), [p[0].size for p in parts]),
                             *(np.concatenate([p[n] for p in parts]) for n in range(3))))
            self._rows = tuple(made)
        return self._rows[chunk]

    def batch(self, chunk: int, slot: Slot, transfer: Transfer) -> CopyBatch:
        """`chunk`'s rows as one batch of 1-D copies between the host pool and `slot`, for
        the transfer's first layer: made once per (chunk, slot, layer), so that a call
        enqueues them without the ~20 us of numpy that building them takes per chunk."""
        key = (chunk, slot.generation, transfer.layers.start)
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= BATCHES_KEPT:
                self._batches.clear()
            which, host, staging, sizes = self.rows(chunk)
            layer = transfer.layers.start
            host_bases = np.array([p.host.data_ptr() + layer * p.strides.layer for p in transfer.pairs], np.int64)
            staging_bases = np.array([slot.address + offset for offset in self.plan.offsets], np.int64)
            host, staging = (host + host_bases[which]).astype(np.uint64), (staging + staging_bases[which]).astype(np.uint64)
            sizes = sizes.astype(np.uint64)
            batch = CopyBatch(staging, host, sizes) if transfer.to_device else CopyBatch(host, staging, sizes)
            self._batches[key] = batch
        return batch

    def pairs(self, slot: Slot, transfer: Transfer, indexing: bool) -> tuple[TensorPair, TensorPair]:
        """K and V of `slot` as the copy kernel's "host" side: the staging miniatures.

        A kernel takes strides and a base address: a flat tensor, with the layer stride
        0 where one layer is staged, so that its absolute layer index lands on it.  The
        CPU oracle indexes a layout-shaped tensor of the staged layers only (`indexing`)."""
        pairs = self._pairs.get(slot.generation)
        if pairs is None:
            pages, layers = self.plan.chunk_tokens // transfer.page_size, self.plan.layers
            made = []
            for pair, strides, offset in zip(transfer.pairs, self.plan.staging, self.plan.offsets):
                storage = slot.buffer[offset:]
                if indexing:
                    head_dim = strides.row_bytes // pair.host.element_size()
                    tensor = miniature(pair.layout, layers, layers, pages, transfer.page_size, strides.heads, head_dim, pair.host.dtype, storage)
                    made.append(tensor_pair(tensor, pair.device, pair.layout, transfer.page_size))
                else:
                    tensor = storage[: self.plan.chunk_tokens * layers * pair.device_token_bytes].view(pair.host.dtype)
                    made.append(replace(pair, host=tensor, strides=strides, chunks=chunking(strides), registration_tokens=0))
            pairs = self._pairs[slot.generation] = (made[0], made[1])
        return pairs


def _rows_of(copies: Copies, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(host offsets, staging offsets, bytes) of every row of copies [begin, end)."""
    heights = copies.height[begin:end]
    which = np.repeat(np.arange(begin, end), heights)
    row = np.arange(which.size) - np.repeat(np.cumsum(heights) - heights, heights)
    return (copies.host[which] + row * copies.host_pitch[which], copies.staging[which] + row * copies.staging_pitch[which],
            copies.width[which])


class KernelGather(Mover):
    """The C copy kernel between a staging slot and the KV buffers, on the current stream
    (the staged mover's kernel stream),
    at the staging block quota, its device-side writes streamed (`stream_device`: cached
    ones slowed the next copies into staging, kv_copy.h); a prepared launch per (slot,
    chunk) is kept."""

    io = "kernel"

    def __init__(self, backend: Any, block_quota: int | None = None, stream_device: bool = True) -> None:
        super().__init__(backend.device)
        self.backend = backend
        self.block_quota = block_quota or staging_blocks()
        self.stream_device = stream_device
        self._templates: IdentityCache[JobTemplate] = IdentityCache(TEMPLATES_KEPT)
        self._launches: IdentityCache[PreparedLaunch] = IdentityCache(LAUNCHES_KEPT)

    def move(self, transfer: Transfer) -> None:
        backend = self.backend
        runtime = backend.runtime
        runtime.bind_thread()
        stream = runtime.current_stream()
        key = (transfer.pairs, transfer.indices)
        stamp = (transfer.to_device, len(transfer.layers), self.block_quota, stream, self.stream_device)
        launch = self._launches.lookup(key, stamp)
        if launch is None:
            template = self._templates.get(transfer.pairs, lambda: JobTemplate(transfer.pairs, [backend.layer_table(p.device) for p in transfer.pairs]))
            launch = PreparedLaunch(transfer, template, self.bad_index.address, self.block_quota, stream, self.stream_device)
            launch.kernel = backend.kernels()[launch.width]
            self._launches.store(key, launch, stamp)
        launch.args.layer_begin = transfer.layers.start
        runtime.launch(launch.kernel, launch.grid, BLOCK, launch.params, stream)

    def close(self) -> None:
        self._templates.clear()
        self._launches.clear()


def share_flag(flag: BadIndexFlag, *movers: Mover) -> None:
    """One bad-index flag for a mover and the movers it delegates to: whichever skipped
    a token, the pool's next call raises."""
    for mover in movers:
        mover.bad_index = flag
        share_flag(flag, *getattr(mover, "parts", ()))


_NO_PLAN: Any = object()  # a kept answer: staging cannot carry this transfer
# Part of a kept plan's (or choice's) key: a load and a backup of the same indices, or
# one layer and all of them, are kept side by side, not in turn (each plan costs ~10 ms).
_KINDS = {(to_device, one_layer): object() for to_device in (True, False) for one_layer in (True, False)}


def _kind(transfer: Transfer) -> object:
    return _KINDS[transfer.to_device, len(transfer.layers) == 1]


class StagedMover(Mover):
    """Host runs as 1-D/2-D copies on the copy engines, the device side through staging
    slots by the copy kernel, chunks pipelined over two slots per direction.

    Falls back to the kernel path where its `rule` says staging does not carry a
    transfer well, where staging cannot carry it at all (indices not whole pages in a
    page layout, a slot too small for one page), and where an index is outside a pool.
    Staging memory: `staging_bytes` per direction (PORTABLE_KV_STAGING_BYTES), two
    slots each, allocated at first use, released by close()."""

    io = "staged"

    def __init__(self, device: torch.device, gather: Mover, fallback: MoverFactory, memcpy_2d: Memcpy2D, memcpy_batch: MemcpyBatch,
                 streams: Streams, rule: StagingRule, indexing_gather: bool) -> None:
        super().__init__(device)
        self.device = device
        self.gather, self.fallback = gather, fallback()
        self.parts = (self.gather, self.fallback)
        share_flag(self.bad_index, *self.parts)
        self.memcpy_2d, self.memcpy_batch = memcpy_2d, memcpy_batch
        self.streams = streams
        self.rule = rule
        self.indexing_gather = indexing_gather
        self.staging_bytes: int = config.STAGING_BYTES.integer(minimum=1) or 0
        self._plans: IdentityCache[Any] = IdentityCache(PLANS_KEPT)
        self._slots: dict[bool, list[Slot]] = {}
        self._turn = {True: 0, False: 0}  # the slot each direction's next chunk takes
        # (pool backups, current stream, copy stream) when a load's copies last waited for
        # the current stream; None: the next load waits.  wait_each_load: always wait (A/B).
        self._ordered: tuple[int, int, int] | None = None
        self.wait_each_load = False
        self._start = streams.event()
        self._lock = threading.Lock()
        self.last_path = ""  # "staged" or "kernel" (the fallback): the latest call's, for benchmarks

    def plan(self, transfer: Transfer) -> Prepared | None:
        """The staged plan of `transfer` (kept for its pools and indices), or None where staging cannot carry it."""
        key = (transfer.pairs, transfer.indices, _kind(transfer))
        stamp = (transfer.to_device, len(transfer.layers), transfer.layers.start if len(transfer.layers) > 1 else 0, self.staging_bytes)
        prepared = self._plans.lookup(key, stamp)
        if prepared is None:
            k = transfer.pairs[0]
            host_np, _, skipped = transfer.indices.inside(k.strides.tokens, k.device[0].shape[0])
            staged = None if skipped else plan(host_np, transfer.pairs, k.layout, transfer.page_size, transfer.layers, len(k.device),
                                               self.staging_bytes // 2, transfer.to_device)
            prepared = self._plans.store(key, _NO_PLAN if staged is None else Prepared(staged, transfer), stamp)
        return None if prepared is _NO_PLAN else prepared

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        prepared = self.plan(transfer)
        if prepared is None or not prepared.carried_by(self.rule):
            self.last_path = "kernel"
            self.fallback.move(transfer)
            return
        self.last_path = "staged"
        with self._lock:
            slots = self._slots_for(transfer.to_device, prepared.plan.slot_bytes)
            if transfer.to_device:
                self._load(transfer, prepared, slots)
            else:
                self._backup(transfer, prepared, slots)

    def _slots_for(self, to_device: bool, nbytes: int) -> list[Slot]:
        slots = self._slots.get(to_device)
        if slots is None or slots[0].buffer.numel() < nbytes:
            for slot in slots or ():  # a larger plan: the old buffers go once their last reader is done
                self.streams.synchronize(slot.free)
            slots = self._slots[to_device] = [Slot(self.device, nbytes, self.streams) for _ in range(2)]
        return slots

    def _apart(self, prepared: Prepared, current: Any) -> bool:
        """Whether the copies and kernels go on side streams: where chunks pipeline, and where
        batched copies would go on the legacy default stream, which the batched calls refuse."""
        return len(prepared.plan.chunks) > 1 or (prepared.batched_by(self.rule) and self.streams.handle(current) == 0)

    def _load(self, transfer: Transfer, prepared: Prepared, slots: list[Slot]) -> None:
        streams = self.streams
        current = streams.current()
        chunks, turn = len(prepared.plan.chunks), self._turn[True]
        apart = self._apart(prepared, current)
        copier, worker = streams.side(current) if apart else (current, current)
        if apart:
            # The scatters write the KV buffers after everything already on the current
            # stream.  The copies read host memory, which only this pool's backups write from
            # a GPU stream (storage tiers and flat pages write it from the CPU, before the
            # call): they wait for the current stream only where a backup was issued since
            # the last load that waited so, on these streams.  The slots are ordered by
            # their events.
            streams.record(self._start, current)
            streams.wait(worker, self._start)
            ordered = (transfer.host_writes, streams.handle(current), streams.handle(copier))
            if ordered != self._ordered or self.wait_each_load:
                streams.wait(copier, self._start)
                self._ordered = ordered
        with streams.using(worker) if apart else contextlib.nullcontext():
            for c in range(chunks):
                slot = slots[(turn + c) % 2]
                streams.wait(copier, slot.free)
                self._copy(transfer, prepared, c, slot, streams.handle(copier))
                if apart:
                    streams.record(slot.filled, copier)
                    streams.wait(worker, slot.filled)
                self._gather(transfer, prepared, c, slot)
                streams.record(slot.free, worker)
        self._turn[True] = (turn + chunks) % 2
        if apart:  # the current stream's next work sees the KV buffers written
            streams.wait(current, slots[(turn + chunks - 1) % 2].free)

    def _backup(self, transfer: Transfer, prepared: Prepared, slots: list[Slot]) -> None:
        streams = self.streams
        current = streams.current()
        chunks, turn = len(prepared.plan.chunks), self._turn[False]
        apart = self._apart(prepared, current)
        copier, worker = streams.side(current) if apart else (current, current)
        if apart:  # the gathers read the KV buffers after everything already on the current stream
            streams.record(self._start, current)
            streams.wait(worker, self._start)
        with streams.using(worker) if apart else contextlib.nullcontext():
            for c in range(chunks):
                slot = slots[(turn + c) % 2]
                streams.wait(worker, slot.free)
                self._gather(transfer, prepared, c, slot)
                if apart:
                    streams.record(slot.filled, worker)
                    streams.wait(copier, slot.filled)
                self._copy(transfer, prepared, c, slot, streams.handle(copier))
                streams.record(slot.free, copier)
        self._turn[False] = (turn + chunks) % 2
        if apart:  # the current stream's next work sees the host pool written
            streams.wait(current, slots[(turn + chunks - 1) % 2].free)

    def _gather(self, transfer: Transfer, prepared: Prepared, chunk: int, slot: Slot) -> None:
        """The copy kernel between the KV buffers and `slot`, for one chunk, on the current stream
        (the kernel stream, where the chunks pipeline)."""
        pairs, layers = prepared.pairs(slot, transfer, self.indexing_gather), transfer.layers
        if self.indexing_gather:  # its miniature holds the staged layers only
            pairs = tuple(replace(p, device=p.device[layers.start:layers.stop]) for p in pairs)
            layers = range(len(layers))
        self.gather.move(Transfer(transfer.to_device, pairs, prepared.indices[chunk], layers, transfer.page_size))

    def _copy(self, transfer: Transfer, prepared: Prepared, chunk: int, slot: Slot, stream: int) -> None:
        """The host-side copies of one chunk of K and V, between the host pool and `slot`:
        one batched call of their rows where the rule batches the plan, else 2-D copies."""
        if prepared.batched_by(self.rule):
            self.memcpy_batch(prepared.batch(chunk, slot, transfer), stream)
            return
        memcpy_2d, to_device = self.memcpy_2d, transfer.to_device
        for pair, offset, (host, staging, width, height, host_pitch, staging_pitch), ends in zip(
                transfer.pairs, prepared.plan.offsets, prepared.copies, prepared.ends):
            host_base = pair.host.data_ptr() + transfer.layers.start * pair.strides.layer
            staging_base = slot.address + offset
            for i in range(ends[chunk], ends[chunk + 1]):
                if to_device:
                    memcpy_2d(staging_base + staging[i], staging_pitch[i], host_base + host[i], host_pitch[i], width[i], height[i], stream)
                else:
                    memcpy_2d(host_base + host[i], host_pitch[i], staging_base + staging[i], staging_pitch[i], width[i], height[i], stream)

    def close(self) -> None:
        self._plans.clear()
        self._slots.clear()
        self._ordered = None
        for part in self.parts:
            part.close()


class AutoMover(Mover):
    """Picks the io path per call from the transfer's plan, and keeps the choice for its
    pools and indices.  The rule (H200 numbers: docs/PERFORMANCE.md):

    1. under AUTO_MIN_BYTES (4 MiB): `kernel`; a call that small is latency, and the
       kernel path is one launch;
    2. the direct plan's copies (runs consecutive on both sides) average at least
       DIRECT_MIN_COPY_BYTES (512 KiB): `direct`, the copy engines straight between the
       pools, no SM and no staging;
    3. where the staged plan's copies (runs consecutive on the host) average at least
       `rule.min_copy_bytes` (2 MiB), its rows are at least `rule.min_row_bytes` (1 KiB),
       and `rule.auto_stages` the transfer (on GPUs: backups, and loads whose copies go
       as one batched call a chunk, see StagingRule): `staged`;
    4. otherwise `kernel`: short host runs would cost the copy engines 2-3 us a copy,
       where the kernel path holds 91-94% at any placement.

    One choice is made per call, not kept: a load that would stage takes `kernel` while
    a staged backup of the same pool still runs (both at once: 63-66 GB/s so, 52-54
    with both staged).
    """

    io = "auto"

    def __init__(self, device: torch.device, kernel: MoverFactory, direct: MoverFactory, staged: StagedMover,
                 rule: StagingRule = LINK_RULE) -> None:
        super().__init__(device)
        self.movers = {"kernel": kernel(), "direct": direct(), "staged": staged}
        self.parts = tuple(self.movers.values())
        share_flag(self.bad_index, *self.parts)
        self.rule = rule
        self._choices: IdentityCache[str] = IdentityCache(PLANS_KEPT)
        self._backup_done: Any = None  # an event recorded after this pool's latest staged backup
        self.last_choice = ""  # the path of the latest call, for benchmarks and diagnostics

    def choice(self, transfer: Transfer) -> str:
        """The io path this mover takes for `transfer`: "kernel", "direct" or "staged"."""
        key = (transfer.pairs, transfer.indices, _kind(transfer))
        stamp = (transfer.to_device, len(transfer.layers), self.movers["staged"].staging_bytes, self.rule)
        chosen = self._choices.lookup(key, stamp)
        if chosen is None:
            chosen = self._choices.store(key, self._choose(transfer), stamp)
        return chosen

    def _choose(self, transfer: Transfer) -> str:
        if transfer.bytes < AUTO_MIN_BYTES:
            return "kernel"
        descriptors = nbytes = 0
        for pair in transfer.pairs:
            sizes = run_offsets(transfer.indices, pair, transfer.page_size)[2]
            descriptors, nbytes = descriptors + sizes.size, nbytes + int(sizes.sum())
        if descriptors and nbytes / descriptors >= DIRECT_MIN_COPY_BYTES:
            return "direct"
        prepared = self.movers["staged"].plan(transfer)
        if (prepared is not None and prepared.carried_by(self.rule)
                and self.rule.auto_stages(transfer.to_device, prepared.batched_by(self.rule))):
            return "staged"
        return "kernel"

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        chosen = self.choice(transfer)
        if chosen == "staged" and transfer.to_device and self._backup_running():
            chosen = "kernel"
        self.last_choice = chosen
        self.movers[chosen].move(transfer)
        if chosen == "staged" and not transfer.to_device:
            streams = self.movers["staged"].streams
            if self._backup_done is None:
                self._backup_done = streams.event()
            streams.record(self._backup_done, streams.current())

    def _backup_running(self) -> bool:
        """Whether this pool's latest staged backup is still running: a staged load beside
        it leaves both at 52-54 GB/s, a kernel-path load beside it 63-66 (H200), so a load
        that would stage takes the kernel path meanwhile."""
        return self._backup_done is not None and not self.movers["staged"].streams.done(self._backup_done)

    def close(self) -> None:
        self._choices.clear()
        self._backup_done = None
        for mover in self.parts:
            mover.close()


def staged_movers(device: torch.device, kernel: MoverFactory, direct: MoverFactory, gather: MoverFactory, memcpy_2d: Memcpy2D,
                  memcpy_batch: MemcpyBatch, stream_handle: Callable[[], int], indexing_gather: bool = False,
                  runtime: Any = None) -> dict[str, MoverFactory]:
    """The `staged` and `auto` entries of a backend's movers(), from its own parts: the
    kernel and direct factories, the gather (a kernel-path mover given staging pairs;
    `indexing_gather`: the CPU oracle, which indexes layout-shaped tensors), the 2-D
    copy, the batched 1-D copy, the current stream's handle and, on a GPU, the vendor
    runtime whose events order the streams.  On a CPU device the path is a model, run
    call by call, staging whatever staging can carry."""
    cpu = device.type == "cpu"
    if not cpu and runtime is None:
        raise ValueError(f"staged_movers: a GPU device ({device}) needs its vendor runtime for events")

    def staged() -> StagedMover:
        streams = InlineStreams(stream_handle) if cpu else DeviceStreams(device, runtime)
        return StagedMover(device, gather(), kernel, memcpy_2d, memcpy_batch, streams, EVERY_PLAN if cpu else LINK_RULE, indexing_gather)

    return {"staged": staged, "auto": lambda: AutoMover(device, kernel, direct, staged())}


__all__ = ["AutoMover", "KernelGather", "StagedMover", "StagingRule", "host_memcpy_2d", "host_memcpy_batch", "staged_movers"]
