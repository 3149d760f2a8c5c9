"""Direct io's copies enqueued by a thread of their own (`PORTABLE_KV_DIRECT_ENQUEUE=worker`).

A direct load of 600 pages costs its caller 1-2 ms of driver calls, one descriptor a
page, and an engine enqueues every layer's load before its forward pass: the forward
starts that much later.  Here the call does three cheap things on its stream and
returns: it records an event where the copies may start, enqueues a wait until a
64-bit counter in device memory reaches the call's number, and queues the copies for
a worker thread.  The worker makes its stream wait for the event, enqueues the
copies, and has its stream write the call's number after them.  The caller's stream
thus orders everything after the copies, as a direct call's contract asks, although
the copies were enqueued after the call returned.

One worker per caller stream, so that a load stream and a backup stream stay two
streams of copies.  A worker's failure is raised by the next call; the counter is
written even then, so that no stream waits forever.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from .engine import CopyBatch, CopyEngine
from .streams import Streams

IN_FLIGHT = 128  # calls a worker may be behind its callers (an engine queues every layer's load at once)
SLOT_WAIT_S = 60.0  # a caller waits this long for a worker that is IN_FLIGHT calls behind
START_WAIT_S = 30.0  # and this long for a new worker's stream

Enqueue = Callable[[CopyEngine, Streams, CopyBatch, int], None]


class EnqueueWorker:
    """The thread that enqueues one caller stream's direct copies."""

    def __init__(self, engine: CopyEngine, streams: Streams, enqueue: Enqueue) -> None:
        self.engine, self.streams, self._enqueue = engine, streams, enqueue
        # Device memory: both the write and the wait are the GPU's own, no host round trip.
        self.counter = torch.zeros(1, dtype=torch.int64, device=engine.device)
        self.submitted = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # a call's number, its wait and its place in the queue go together
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(IN_FLIGHT):
            self._slots.put(streams.event())
        self._ready = threading.Event()
        self._stream = 0
        self.thread = threading.Thread(target=self._run, name="portable_kv direct enqueue", daemon=True)
        self.thread.start()
        if not self._ready.wait(START_WAIT_S) or self.error is not None:
            self.stop()
            raise RuntimeError(f"portable_kv: the direct enqueue thread did not start: {self.error!r}")

    def submit(self, batch: CopyBatch, current: int) -> None:
        """Order `current` after `batch`'s copies, which the worker enqueues."""
        self.raise_error()
        try:
            event = self._slots.get(timeout=SLOT_WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"portable_kv: the direct enqueue thread is {IN_FLIGHT} calls behind for {SLOT_WAIT_S:.0f} s") from None
        with self._lock:
            try:
                self.streams.record(event, current)
                self.engine.stream_wait_value(current, self.counter.data_ptr(), self.submitted + 1)
            except BaseException:
                self._slots.put(event)
                raise
            self.submitted += 1
            self._jobs.put((batch, event, self.submitted))

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(f"portable_kv: an earlier direct transfer failed when its copies were enqueued: {error}") from error

    def stop(self) -> None:
        """Let the worker finish what it was given, then end it."""
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join(timeout=SLOT_WAIT_S)

    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            self._stream = self.streams.side(0, 1)[0]  # this thread's own stream
        except BaseException as error:  # reported by the constructor
            self.error = error
            return
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            batch, event, number = job
            try:
                self.streams.wait(self._stream, event)
                self._enqueue(self.engine, self.streams, batch, self._stream)
            except BaseException as error:
                self.error = self.error or error
            finally:
                self._slots.put(event)  # recorded again only after this wait was enqueued
                try:
                    self.engine.stream_write_value(self._stream, self.counter.data_ptr(), number)
                except BaseException as error:
                    self.error = self.error or error
