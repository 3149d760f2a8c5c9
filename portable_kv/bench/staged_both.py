"""The staged section's load and backup at once: one thread and two, on two streams."""

from __future__ import annotations

import threading

import torch

import portable_kv as pk

from .measure import Clock, gbps
from .rows import Row
from .sections import percent, with_clock
from .workload import Workload


def both_ways(clock: Clock, w: Workload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, name: str, where: str,
              backup_io: str | None = None, backup_first: bool = False) -> Row:
    """A per-layer load of one half of the pages and a per-layer backup of the other, on two
    streams; the load through `io`, the backup through `backup_io` (default: the same),
    the load issued first unless `backup_first`."""
    load_idx, backup_idx = w.halves()
    backup_io = backup_io or io
    side = torch.cuda.Stream()

    def load() -> None:
        host.load_to_device_per_layer(w.dev, *load_idx, 0, io_backend=io)

    def backup() -> None:
        with torch.cuda.stream(side):
            host.backup_from_device_per_layer(w.dev, *backup_idx, 1, io_backend=backup_io)

    def run() -> None:
        side.wait_stream(torch.cuda.current_stream())
        for call in (backup, load) if backup_first else (load, backup):
            call()
        torch.cuda.current_stream().wait_stream(side)

    seconds, host_s = clock.time(run, reps)
    rate = gbps(2 * load_idx[0].numel() * w.token_layer_bytes, seconds)
    order = ", the backup issued first" if backup_first else ""
    return Row("staged", f"{name} load {io} + backup {backup_io} at once{order}, {where}", "both", w.page_size, rate,
               percent(rate, ceil, "both"), host_s * 1e6, extra=with_clock(clock))


def both_ways_threads(clock: Clock, w: Workload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, name: str,
                      where: str) -> Row:
    """both_ways with the load and the backup issued from two threads, each on its own
    stream, as an engine's load and write threads issue them (SGLang's cache controller):
    one call's host time no longer delays the other's start."""
    load_idx, backup_idx = w.halves()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    calls = (lambda: host.load_to_device_per_layer(w.dev, *load_idx, 0, io_backend=io),
             lambda: host.backup_from_device_per_layer(w.dev, *backup_idx, 1, io_backend=io))
    # Both threads start a call together; the caller goes on once both have issued theirs.
    go = [threading.Barrier(3, timeout=60) for _ in range(2)]
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        with torch.cuda.stream(streams[n]):
            try:
                while True:
                    go[0].wait()
                    try:
                        calls[n]()
                    except BaseException as exc:  # noqa: BLE001 -- raised again by the caller
                        errors.append(exc)
                    go[1].wait()
            except threading.BrokenBarrierError:  # the caller is done (or gave up waiting)
                return

    def run() -> None:
        current = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(current)
        go[0].wait()
        go[1].wait()
        if errors:
            raise errors[0]
        for stream in streams:
            current.wait_stream(stream)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        seconds, host_s = clock.time(run, reps)
    finally:
        for barrier in go:
            barrier.abort()  # waiting threads wake with BrokenBarrierError and end
        for thread in threads:
            thread.join(timeout=10)
    rate = gbps(2 * load_idx[0].numel() * w.token_layer_bytes, seconds)
    return Row("staged", f"{name} load {io} + backup {io} at once from two threads, {where}", "both", w.page_size, rate,
               percent(rate, ceil, "both"), host_s * 1e6)
