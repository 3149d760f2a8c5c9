"""Streams and events: how the direct and staged paths order their work around the
engine's current stream.

A stream is held one way, as its raw handle: the handle is what a vendor call
takes, and a side stream's torch object is kept only to keep it alive and to
make it torch's current stream (`using`) for work that torch enqueues.  Events
are the vendor runtime's own, a ctypes call costing a fraction of torch's Event
from Python: a staged chunk records and waits on four (docs/DESIGN.md).

Side streams come per thread and per current stream: a load and a backup that an
engine puts on two streams stay on two.  They are taken one after the other
from torch's pool, which puts consecutive streams on different hardware queues:
two streams on one queue run in issue order, so a copy stream and a kernel
stream sharing one would take turns.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


class EventRuntime(Protocol):
    """What a vendor runtime gives streams: its current stream and its events (runtime.py)."""

    device: torch.device

    def current_stream(self) -> int: ...
    def event_create(self) -> int: ...
    def event_record(self, event: int, stream: int) -> None: ...
    def stream_wait_event(self, stream: int, event: int) -> None: ...
    def event_synchronize(self, event: int) -> None: ...
    def event_done(self, event: int) -> bool: ...
    def event_destroy(self, event: int) -> None: ...
    def event_elapsed(self, start: int, end: int) -> float: ...


class Event:
    """A vendor runtime event, destroyed when the object goes."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self, runtime: EventRuntime, timing: bool = False) -> None:
        self.handle = runtime.event_create(timing)
        weakref.finalize(self, runtime.event_destroy, self.handle)


class DeviceStreams:
    """A GPU's streams as raw handles, ordered by the vendor runtime's events."""

    def __init__(self, runtime: EventRuntime) -> None:
        self.runtime, self.device = runtime, runtime.device
        self._local = threading.local()

    def current(self) -> int:
        return self.runtime.current_stream()

    def side(self, current: int, count: int = 2) -> tuple[int, ...]:
        """`count` side streams of this thread beside `current`, the same ones each call."""
        local = self._local
        beside = getattr(local, "beside", None)
        if beside is None:
            beside = local.beside = {}
            local.streams = {}  # handle -> torch stream, for using() and to keep each alive
        handles = beside.setdefault(current, [])
        while len(handles) < count:
            stream = torch.cuda.Stream(self.device)
            local.streams[stream.cuda_stream] = stream
            handles.append(stream.cuda_stream)
        return tuple(handles[:count])

    def using(self, stream: int) -> Any:
        """A context in which `stream` (a side stream of this thread's) is torch's current stream."""
        return torch.cuda.stream(self._local.streams[stream])

    def event(self, timing: bool = False) -> Event:
        """A new event; `timing`: one that `elapsed` can read (recording it costs a little more)."""
        return Event(self.runtime, timing)

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds of device time between two completed timing events."""
        return self.runtime.event_elapsed(start.handle, end.handle)

    @staticmethod
    def handle(stream: int) -> int:
        return stream

    def record(self, event: Event, stream: int) -> None:
        self.runtime.event_record(event.handle, stream)

    def wait(self, stream: int, event: Event) -> None:
        self.runtime.stream_wait_event(stream, event.handle)

    def synchronize(self, event: Event) -> None:
        self.runtime.event_synchronize(event.handle)

    def done(self, event: Event) -> bool:
        return self.runtime.event_done(event.handle)

    def fork(self, current: int, sides: Sequence[int]) -> None:
        """Order `sides` after everything already on `current`."""
        start = self._events(1)[0]
        self.record(start, current)
        for side in sides:
            self.wait(side, start)

    def join(self, current: int, sides: Sequence[int]) -> None:
        """Order `current`'s next work after everything enqueued on `sides`."""
        for side, end in zip(sides, self._events(1 + len(sides))[1:]):
            self.record(end, side)
            self.wait(current, end)

    def _events(self, count: int) -> list[Event]:
        # Per thread: another thread's record between this one's record and wait would
        # order this thread's streams after the wrong work.
        events = getattr(self._local, "events", None)
        if events is None:
            events = self._local.events = []
        while len(events) < count:
            events.append(self.event())
        return events


class InlineStreams:
    """Where every call completes before it returns (the CPU, a simulated GPU): one
    stream, whose handle `handle` gives, and nothing to order."""

    def __init__(self, handle: Callable[[], int]) -> None:
        self._handle = handle

    def current(self) -> int:
        return self._handle()

    def side(self, current: int, count: int = 2) -> tuple[int, ...]:
        return (current,) * count

    @staticmethod
    def using(stream: int) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    @staticmethod
    def event(timing: bool = False) -> list[float] | None:
        """None; a timing event is the host clock at its record, as every call completes before it returns."""
        return [0.0] if timing else None

    @staticmethod
    def elapsed(start: list[float], end: list[float]) -> float:
        return end[0] - start[0]

    def handle(self, stream: int) -> int:
        return self._handle()

    @staticmethod
    def record(event: list[float] | None, stream: int) -> None:
        if event is not None:
            event[0] = time.perf_counter()

    @staticmethod
    def wait(stream: int, event: None) -> None:
        return None

    @staticmethod
    def synchronize(event: None) -> None:
        return None

    @staticmethod
    def done(event: None) -> bool:
        return True

    @staticmethod
    def fork(current: int, sides: Sequence[int]) -> None:
        return None

    @staticmethod
    def join(current: int, sides: Sequence[int]) -> None:
        return None


Streams = DeviceStreams | InlineStreams


class MadeOn:
    """Device data a launch made on one stream (index copies, piece lists): another stream
    waits for it once, before its first use there."""

    __slots__ = ("_streams", "_event", "seen")

    def __init__(self, streams: Streams, stream: Any) -> None:
        self._streams, self._event, self.seen = streams, streams.event(), {stream}  # seen: the streams ordered so far
        streams.record(self._event, stream)

    def order(self, stream: Any) -> None:
        if stream not in self.seen:
            self._streams.wait(stream, self._event)
            self.seen.add(stream)
