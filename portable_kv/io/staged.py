"""The `staged` io path: copy engines on the host side, the copy kernel in device memory.

SM-issued traffic to host memory crosses PCIe in 128-byte TLPs, which bounds the
kernel path below the link's ceiling; the copy engines reach it, but only when fed
few, large copies.  The host pool owns its placement, so a transfer's host side is
a few runs of consecutive pages, each one 1-D or 2-D copy (staged_plan.py).  The
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
from typing import Any

from ..transfer import Transfer
from . import staged_plan
from .engine import CopyEngine
from .mover import Mover, MoverFactory, share_flag
from .staged_plan import EVERY_PLAN, LINK_RULE, StagingRule
from .staging import Prepared, Slot

LAUNCHES_KEPT = 128  # the staging kernel's prepared launches: one per chunk (a large backup has ~30), a few plans
_NO_PLAN: Any = object()  # a kept answer: staging cannot carry this transfer


class StagedMover(Mover):
    """Host runs as 1-D/2-D copies on the copy engines, the device side through staging
    slots by the copy kernel (`kernel`: a kernel mover of the backend's, given staging
    pairs), chunks pipelined over two slots per direction.

    Falls back to the kernel path (`fallback`) where its rule says staging does not carry
    a transfer well, where staging cannot carry it at all (indices not whole pages in a
    page layout, a slot too small for one page), and where an index is outside a pool.
    Staging memory: `staging_bytes` per direction (the pool's PORTABLE_KV_STAGING_BYTES), two slots
    each, allocated at first use, released by close()."""

    io = "staged"

    def __init__(self, engine: CopyEngine, kernel: Mover, fallback: MoverFactory, staging_bytes: int) -> None:
        super().__init__(engine.device)
        self.device, self.engine = engine.device, engine
        # Staging indices are inside the pools by construction: the kernel keeps a flag of
        # its own, which no earlier call's skipped token can set under a running pipeline.
        self.kernel, self.fallback = kernel, fallback()
        self.parts = (self.fallback,)
        share_flag(self.bad_index, *self.parts)
        self.memcpy_2d, self.memcpy_batch = engine.memcpy_2d, engine.memcpy_batch
        self.streams = engine.streams()
        # On a CPU device the path is a model, run call by call, staging whatever it can.
        self.rule: StagingRule = EVERY_PLAN if self.device.type == "cpu" else LINK_RULE
        self.staging_bytes = staging_bytes  # 0: staging's own default
        self._slots: dict[bool, list[Slot]] = {}
        self._turn = {True: 0, False: 0}  # the slot each direction's next chunk takes
        # (pool backups, current stream, copy stream) when a load's copies last waited for
        # the current stream; None: the next load waits.  wait_each_load: always wait (A/B).
        self._ordered: tuple[int, int, int] | None = None
        self.wait_each_load = False
        self._start = self.streams.event()
        self._lock = threading.Lock()
        self.last_path = ""  # "staged" or "kernel" (the fallback): the latest call's, for benchmarks
        self.last_reason = ""
        self._backup_done: Any = None  # an event recorded after this pool's latest staged backup

    def prepared(self, transfer: Transfer) -> Prepared | None:
        """The staged plan of `transfer`, kept with its indices for its pools, or None where
        staging cannot carry it.  A load and a backup, one layer and all of them, are kept
        side by side: each plan costs milliseconds of host time on a large transfer."""
        def build() -> Any:
            first = transfer.pairs[0]  # every buffer has the same tokens and layers
            host_np, _, skipped = transfer.indices.inside(first.strides.tokens, first.device[0].shape[0])
            plan = None if skipped else staged_plan.build(host_np, transfer.pairs, first.layout, transfer.page_size, transfer.layers,
                                                          len(first.device), self.staging_bytes // 2, transfer.to_device)
            return _NO_PLAN if plan is None else Prepared(plan, transfer)

        layers = transfer.layers
        key = ("staged", transfer.to_device, len(layers) == 1)
        stamp = (len(layers), layers.start if len(layers) > 1 else 0, self.staging_bytes)
        prepared = transfer.indices.known((transfer.pairs,), key, build, stamp)
        return None if prepared is _NO_PLAN else prepared

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        prepared = self.prepared(transfer)
        if prepared is None or not prepared.carried_by(self.rule):
            self.last_path = "kernel"
            self.last_reason = "staging cannot carry it" if prepared is None else "runs too short for the copy engines"
            self.fallback.move(transfer)
            return
        self.last_path, self.last_reason = "staged", ""
        with self._lock:
            self._pipeline(transfer, prepared, self._slots_for(transfer.to_device, prepared.plan.slot_bytes))
            if not transfer.to_device:
                if self._backup_done is None:
                    self._backup_done = self.streams.event()
                self.streams.record(self._backup_done, self.streams.current())

    def backup_running(self) -> bool:
        """Whether this pool's latest staged backup is still running."""
        return self._backup_done is not None and not self.streams.done(self._backup_done)

    def _slots_for(self, to_device: bool, nbytes: int) -> list[Slot]:
        """A direction's two slots of at least `nbytes`: made at first use, remade for a larger plan."""
        slots = self._slots.get(to_device)
        if slots is None or slots[0].buffer.numel() < nbytes:
            for slot in slots or ():  # a larger plan: the old buffers go once their last reader is done
                self.streams.synchronize(slot.free)
            slots = self._slots[to_device] = [Slot(self.device, nbytes, self.streams) for _ in range(2)]
        return slots

    def _pipeline(self, transfer: Transfer, prepared: Prepared, slots: list[Slot]) -> None:
        """Every chunk through the slots in turn: a load copies into a slot, then scatters
        from it; a backup gathers into a slot, then copies from it."""
        streams, load = self.streams, transfer.to_device
        current = streams.current()
        chunks, turn = len(prepared.plan.chunks), self._turn[load]
        # Side streams where chunks pipeline, and where batched copies would otherwise go on
        # the legacy default stream, which the batched calls refuse.
        apart = chunks > 1 or (prepared.batched_by(self.rule) and streams.handle(current) == 0)
        copier, worker = streams.side(current) if apart else (current, current)
        if apart:
            self._order_after(current, transfer, copier, worker)

        def copy(c: int, slot: Slot) -> None:
            self._copy(transfer, prepared, c, slot, streams.handle(copier))

        def kernel(c: int, slot: Slot) -> None:
            self._kernel(transfer, prepared, c, slot)

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

    def _order_after(self, current: Any, transfer: Transfer, copier: Any, worker: Any) -> None:
        """The kernels touch the KV buffers after everything already on the current stream.
        A backup's copies follow its kernels.  A load's copies read host memory, which only
        this pool's backups write from a GPU stream (storage tiers and flat pages write it
        from the CPU, before the call): they wait for the current stream only where a backup
        was issued since the last load that waited so, on these streams."""
        streams = self.streams
        streams.record(self._start, current)
        streams.wait(worker, self._start)
        if transfer.to_device:
            ordered = (transfer.host_writes, streams.handle(current), streams.handle(copier))
            if ordered != self._ordered or self.wait_each_load:
                streams.wait(copier, self._start)
                self._ordered = ordered

    def _copy(self, transfer: Transfer, prepared: Prepared, chunk: int, slot: Slot, stream: int) -> None:
        """The host-side copies of one chunk of every buffer, between the host pool and `slot`:
        one batched call of their rows where the rule batches the plan, else 2-D copies."""
        if prepared.batched_by(self.rule):
            self.memcpy_batch(prepared.batch(chunk, slot, transfer), stream)
            return
        memcpy_2d, to_device = self.memcpy_2d, transfer.to_device
        for pair, offset, (host, staging_off, width, height, host_pitch, staging_pitch), ends in zip(
                transfer.pairs, prepared.plan.offsets, prepared.copies, prepared.ends):
            host_base = pair.host.data_ptr() + transfer.layers.start * pair.strides.layer
            staging_base = slot.address + offset
            for i in range(ends[chunk], ends[chunk + 1]):
                if to_device:
                    memcpy_2d(staging_base + staging_off[i], staging_pitch[i], host_base + host[i], host_pitch[i], width[i], height[i], stream)
                else:
                    memcpy_2d(host_base + host[i], host_pitch[i], staging_base + staging_off[i], staging_pitch[i], width[i], height[i], stream)

    def _kernel(self, transfer: Transfer, prepared: Prepared, chunk: int, slot: Slot) -> None:
        """The copy kernel between `slot` and the KV buffers, for one chunk, on the current
        stream (the kernel stream, where the chunks pipeline)."""
        reads_strides, layers = self.kernel.reads_strides, transfer.layers
        pairs = prepared.pairs(slot, transfer, reads_strides)
        if not reads_strides:  # its miniature holds the staged layers only
            pairs = tuple(replace(p, device=p.device[layers.start:layers.stop]) for p in pairs)
            layers = range(len(layers))
        self.kernel.move(Transfer(transfer.to_device, pairs, prepared.indices[chunk], layers, transfer.page_size))

    def close(self) -> None:
        self._slots.clear()
        self._ordered = None
        self._backup_done = None
        self.kernel.close()
        self.fallback.close()
