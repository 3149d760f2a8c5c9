"""What one host pool's io paths share: its movers (one of each path, made at first use),
its one bad-index flag, the io settings read when the pool was built, the backups it has
issued, the calls still in flight, and the record of what they did.

A path that delegates (auto to kernel, bulk, direct and staged; staged and bulk to
kernel) is handed the pool's own movers of those paths, not new ones: staging memory
is allocated once per pool whichever path asked for it, and auto sees the staged
backups a caller issued through `staged` as well as its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import config
from ..stats import PoolStats, StatsRow
from .mover import BadIndexFlag, Mover
from .streams import Streams

# Blocks of the kernel between staging and the KV buffers (PORTABLE_KV_STAGING_BLOCKS): it
# works in device memory, where a few blocks keep several times what one copy engine
# drains from PCIe in flight; the model keeps the other SMs.
STAGING_BLOCKS = int(config.STAGING_BLOCKS.default or 8)


@dataclass(frozen=True)
class IoSettings:
    """The settings a pool's movers use, read once: a pool keeps what was set when it was
    built, whatever the environment says by the time a path is first used."""

    staging_bytes: int  # PORTABLE_KV_STAGING_BYTES; 0: staging's own default
    staging_blocks: int  # PORTABLE_KV_STAGING_BLOCKS, else STAGING_BLOCKS

    @classmethod
    def read(cls) -> IoSettings:
        return cls(staging_bytes=config.STAGING_BYTES.integer(minimum=1) or 0,
                   staging_blocks=config.STAGING_BLOCKS.integer(minimum=1) or STAGING_BLOCKS)


class CallTiming:
    """A start and an end event of one call; `generation` moves on each reuse, so that a
    `Landed` made for an earlier use knows that use completed (a pair is reused only then)."""

    __slots__ = ("start", "end", "generation")

    def __init__(self, streams: Streams) -> None:
        self.start, self.end, self.generation = streams.event(timing=True), streams.event(timing=True), 0


class Landed:
    """What `plan.ready(layer_id)` returns: completes when that call of the plan has landed."""

    __slots__ = ("_streams", "_timing", "_generation")

    def __init__(self, streams: Streams, timing: CallTiming | None, generation: int) -> None:
        self._streams, self._timing, self._generation = streams, timing, generation

    def _pending(self) -> bool:
        return self._timing is not None and self._timing.generation == self._generation

    def query(self) -> bool:
        """Whether the call has landed."""
        return not self._pending() or self._streams.done(self._timing.end)

    def synchronize(self) -> None:
        """Block the calling thread until the call has landed."""
        if self._pending():
            self._streams.synchronize(self._timing.end)

    def wait(self, stream: Any = None) -> None:
        """Order `stream`'s next work (a torch stream; None: the current one) after the call."""
        if self._pending():
            handle = self._streams.current() if stream is None else stream.cuda_stream
            self._streams.wait(handle, self._timing.end)


# Event pairs made at once where none is free: reading back costs a query a call, so it is
# done when the free pairs run out (and at stats()), for every completed call at once.
TIMINGS_MADE = 32


class InFlight:
    """A pool's calls whose device time is not read yet: each call's events are read back
    once they complete (when the free pairs run out, and at stats()), then reused."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self._pending: deque[tuple[CallTiming, StatsRow]] = deque()
        self._free: list[CallTiming] = []
        self._lock = threading.Lock()  # two threads' calls must not read back one call twice

    def begin(self, stream: Any) -> CallTiming:
        timing = self._free.pop() if self._free else self._refill()
        self.streams.record(timing.start, stream)
        return timing

    def _refill(self) -> CallTiming:
        self.read_back()
        if not self._free:
            self._free.extend(CallTiming(self.streams) for _ in range(TIMINGS_MADE))
        return self._free.pop()

    def end(self, timing: CallTiming, stream: Any, row: StatsRow) -> None:
        self.streams.record(timing.end, stream)
        self._pending.append((timing, row))

    def read_back(self) -> None:
        """Add the device time of every completed call, oldest first, to its row."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            streams, pending = self.streams, self._pending
            while pending and streams.done(pending[0][0].end):
                timing, row = pending.popleft()
                row.device_seconds += streams.elapsed(timing.start, timing.end)
                row.device_calls += 1
                timing.generation += 1
                self._free.append(timing)
        finally:
            self._lock.release()


class IoContext:
    """One host pool's movers, bad-index flag, io settings, backups issued, calls in flight and stats."""

    def __init__(self, device: torch.device, make: Callable[[str, IoContext], Mover], streams: Streams) -> None:
        self.settings = IoSettings.read()
        self.bad_index = BadIndexFlag(device)
        self.stats = PoolStats()
        self.in_flight = InFlight(streams)
        self.streams = streams
        self.movers: dict[str, Mover] = {}
        # Backups of this host pool issued so far, on any stream and io path: a staged load
        # whose count has not moved since its last wait for the current stream need not
        # wait for that stream again (io/staged.py).
        self.host_writes = 0
        self._make = make  # the backend's: an io name and this context to a new mover

    def mover(self, io: str) -> Mover:
        """The pool's mover of `io`, made at first use."""
        mover = self.movers.get(io)
        if mover is None:
            mover = self.movers[io] = self._make(io, self)
        return mover

    def close(self) -> None:
        """Drop what every mover holds (staging, side streams); the context may be used again."""
        for mover in self.movers.values():
            mover.close()
        self.movers.clear()
