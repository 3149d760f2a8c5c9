"""The `staged` io path: copy engines on the host side, the copy kernel in device memory.

SM-issued traffic to host memory crosses PCIe in 128-byte TLPs, which bounds the
kernel path below the link's ceiling; the copy engines reach it, but only when fed
few, large copies.  The host pool owns its placement, so a transfer's host side is
a few runs of consecutive pages, each one 1-D or 2-D copy (staging_schedule.py).  The
device side (token slots scattered over the engine's pool) is gathered into, or
scattered from, a staging miniature of the host pool in device memory by the copy
kernel, given staging-local indices.  Chunks alternate between two staging slots
so that copy and kernel overlap:

    load:   copy stream    [copy 0 -> A][copy 1 -> B][copy 2 -> A]...
            kernel stream  .............[scatter A ][scatter B ]...
    backup: kernel stream  [gather -> A][gather -> B][gather -> A]...
            copy stream    .............[copy A    ][copy B    ]...

Both are side streams of the engine's current stream (streams.py).  Events order
each slot's writer after its last reader, the kernels after everything already on
the current stream, and the current stream after the last kernel (load) or copy
(backup).  A backup's copies follow its gathers; a load's copies start after
everything already on the current stream, except where no backup of the pool was
issued since the mover's last load on that stream waited so: then they need only
their slot, and a load issued behind another (an engine's per-layer loads) copies
while the one before it scatters its last chunk.  The slots alternate across calls
too.  A transfer that staging does not carry well (short runs, tiny rows, a bad
index) goes to the kernel path.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..transfer import Transfer
from . import staging_schedule
from .copier import Copier
from .mover import BadIndexFlag, Launch, Mover
from .staging import Slot, StagedCopies
from .staging_schedule import EVERY_SCHEDULE, LINK_RULE, StagingRule

if TYPE_CHECKING:
    from .context import IoContext


class StagedLaunch(Launch):
    """A transfer's staging schedule with what each call reuses (staging.StagedCopies), and the
    staging kernel's launch of each chunk and slot, built at first use."""

    path = "staged"

    def __init__(self, mover: StagedMover, transfer: Transfer, copies: StagedCopies) -> None:
        self.mover, self.transfer, self.copies = mover, transfer, copies
        self.batched = copies.batched_by(mover.rule)
        self._kernels: dict[tuple[int, int, int], Launch] = {}

    def run(self, layers: range, stream: int | None) -> None:
        mover = self.mover
        with mover.lock:
            slots = mover.slots_for(self.transfer.to_device, self.copies.schedule.slot_bytes)
            mover.pipeline(self, layers, stream, slots)

    def chunk_kernel(self, chunk: int, slot: Slot, layers: range) -> tuple[Launch, range]:
        """The staging kernel's launch between `slot` and the KV buffers for one chunk, and the
        layers it is given (the CPU oracle's miniature holds the staged layers only)."""
        kernel, transfer = self.mover.kernel, self.transfer
        reads_strides = kernel.reads_strides
        key = (chunk, slot.generation, 0 if reads_strides else layers.start)
        launch = self._kernels.get(key)
        if launch is None:
            pairs = self.copies.pairs(slot, transfer, reads_strides)
            span = layers
            if not reads_strides:
                pairs = tuple(replace(p, device=p.device[layers.start:layers.stop]) for p in pairs)
                span = range(len(layers))
            staged = Transfer(transfer.to_device, pairs, self.copies.indices[chunk], span, transfer.page_size, self.mover.flag)
            launch = self._kernels[key] = kernel.build(staged)
        return launch, (layers if reads_strides else range(len(layers)))


class StagedMover(Mover):
    """Host runs as 1-D/2-D copies on the copy engines, the device side through staging
    slots by the copy kernel (`kernel`: a kernel mover of the backend's, given staging
    pairs), chunks pipelined over two slots per direction.

    Hands a transfer to the kernel path (`fallback`) where its rule says staging does not
    carry it well, where staging cannot carry it at all (indices not whole pages in a page
    layout, a slot too small for one page), and where an index is outside a pool.
    Staging memory: `staging_bytes` per direction (the pool's PORTABLE_KV_STAGING_BYTES), two
    slots each, allocated at first use, released by close()."""

    io = "staged"

    def __init__(self, copier: Copier, kernel: Mover, fallback: Mover, context: IoContext) -> None:
        self.device, self.copier, self.context = copier.device, copier, context
        self.kernel, self.fallback = kernel, fallback
        # Staging indices are inside the pools by construction: the staging kernel keeps a
        # flag of its own, which no earlier call's skipped token can set under a running pipeline.
        self.flag = BadIndexFlag(self.device)
        self.memcpy_2d, self.memcpy_batch = copier.memcpy_2d, copier.memcpy_batch
        self.streams = copier.streams()
        # On a CPU device the path is a model, run call by call, staging whatever it can.
        self.rule: StagingRule = EVERY_SCHEDULE if self.device.type == "cpu" else LINK_RULE
        self.staging_bytes = context.settings.staging_bytes  # 0: staging's own default
        self._slots: dict[bool, list[Slot]] = {}
        self._turn = {True: 0, False: 0}  # the slot each direction's next chunk takes
        # (pool backups, current stream, copy stream) when a load's copies last waited for
        # the current stream; None: the next load waits.  wait_each_load: always wait (A/B).
        self._ordered: tuple[int, int, int] | None = None
        self.wait_each_load = False
        self._start = self.streams.event()
        self.lock = threading.Lock()
        self._backup_done: Any = None  # an event recorded after this pool's latest staged backup

    def copies(self, transfer: Transfer) -> StagedCopies | None:
        """The staging schedule of `transfer` with what each call reuses, or None where staging
        cannot carry it."""
        first = transfer.pairs[0]  # every buffer has the same tokens and layers
        host_np, _, skipped = transfer.indices.inside(first.strides.tokens, first.device[0].shape[0])
        if skipped:
            return None
        schedule = staging_schedule.build(host_np, transfer.pairs, first.layout, transfer.page_size, transfer.layers,
                                          len(first.device), self.staging_bytes // 2, transfer.to_device)
        return None if schedule is None else StagedCopies(schedule, transfer)

    def build(self, transfer: Transfer) -> Launch:
        copies = self.copies(transfer)
        if copies is None or not copies.carried_by(self.rule):
            launch = self.fallback.build(transfer)
            launch.reason = "staging cannot carry it" if copies is None else "runs too short for the copy engines"
            return launch
        return StagedLaunch(self, transfer, copies)

    def backup_running(self) -> bool:
        """Whether this pool's latest staged backup is still running."""
        return self._backup_done is not None and not self.streams.done(self._backup_done)

    def slots_for(self, to_device: bool, nbytes: int) -> list[Slot]:
        """A direction's two slots of at least `nbytes`: made at first use, remade for a larger schedule."""
        slots = self._slots.get(to_device)
        if slots is None or slots[0].buffer.numel() < nbytes:
            for slot in slots or ():  # a larger schedule: the old buffers go once their last reader is done
                self.streams.synchronize(slot.free)
            slots = self._slots[to_device] = [Slot(self.device, nbytes, self.streams) for _ in range(2)]
        return slots

    def pipeline(self, launch: StagedLaunch, layers: range, current: Any, slots: list[Slot]) -> None:
        """Every chunk through the slots in turn: a load copies into a slot, then scatters
        from it; a backup gathers into a slot, then copies from it."""
        streams, transfer, copies = self.streams, launch.transfer, launch.copies
        load = transfer.to_device
        chunks, turn = len(copies.schedule.chunks), self._turn[load]
        # Side streams where chunks pipeline, and where batched copies would otherwise go on
        # the legacy default stream, which the batched calls refuse.
        apart = chunks > 1 or (launch.batched and streams.handle(current) == 0)
        copier, worker = streams.side(current) if apart else (current, current)
        if apart:
            self._order_after(current, load, copier, worker)

        def copy(c: int, slot: Slot) -> None:
            self._copy(launch, layers, c, slot, streams.handle(copier))

        def kernel(c: int, slot: Slot) -> None:
            chunk_launch, span = launch.chunk_kernel(c, slot, layers)
            chunk_launch.run(span, streams.handle(worker))

        (writer, write), (reader, read) = ((copier, copy), (worker, kernel)) if load else ((worker, kernel), (copier, copy))
        with streams.using(worker) if apart else contextlib.nullcontext():
            for c in range(chunks):
                slot = slots[(turn + c) % 2]
                streams.wait(writer, slot.free)
                write(c, slot)
                if apart:
                    streams.record(slot.filled, writer)
                    streams.wait(reader, slot.filled)
                read(c, slot)
                streams.record(slot.free, reader)
        self._turn[load] = (turn + chunks) % 2
        if apart:  # the current stream's next work sees the KV buffers (load) or the host pool (backup) written
            streams.wait(current, slots[(turn + chunks - 1) % 2].free)
        if not load:
            if self._backup_done is None:
                self._backup_done = streams.event()
            streams.record(self._backup_done, current)

    def _order_after(self, current: Any, load: bool, copier: Any, worker: Any) -> None:
        """The kernels touch the KV buffers after everything already on the current stream.
        A backup's copies follow its kernels.  A load's copies read host memory, which only
        this pool's backups write from a GPU stream (storage tiers and flat pages write it
        from the CPU, before the call): they wait for the current stream only where a backup
        was issued since the last load that waited so, on these streams."""
        streams = self.streams
        streams.record(self._start, current)
        streams.wait(worker, self._start)
        if load:
            ordered = (self.context.host_writes, streams.handle(current), streams.handle(copier))
            if ordered != self._ordered or self.wait_each_load:
                streams.wait(copier, self._start)
                self._ordered = ordered

    def _copy(self, launch: StagedLaunch, layers: range, chunk: int, slot: Slot, stream: int) -> None:
        """The host-side copies of one chunk of every buffer, between the host pool and `slot`:
        one batched call of their rows where the rule batches the schedule, else 2-D copies."""
        transfer, copies = launch.transfer, launch.copies
        if launch.batched:
            self.memcpy_batch(copies.batch(chunk, slot, transfer, layers.start), stream)
            return
        memcpy_2d, to_device = self.memcpy_2d, transfer.to_device
        for pair, offset, (host, staging_off, width, height, host_pitch, staging_pitch), ends in zip(
                transfer.pairs, copies.schedule.offsets, copies.copies, copies.ends):
            host_base = pair.host.data_ptr() + layers.start * pair.strides.layer
            staging_base = slot.address + offset
            for i in range(ends[chunk], ends[chunk + 1]):
                if to_device:
                    memcpy_2d(staging_base + staging_off[i], staging_pitch[i], host_base + host[i], host_pitch[i], width[i], height[i], stream)
                else:
                    memcpy_2d(host_base + host[i], host_pitch[i], staging_base + staging_off[i], staging_pitch[i], width[i], height[i], stream)

    def close(self) -> None:
        self._slots.clear()
        self._ordered = None
        self._backup_done = None
