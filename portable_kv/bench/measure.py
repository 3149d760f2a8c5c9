"""Timing: CUDA/HIP events on a GPU, the wall clock on the CPU; medians, never means."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

# A warm-up call slower than this is a pathological pair (direct io of 384-byte
# rows takes seconds a call): fewer repetitions keep a run within its stated time.
SLOW_CALL_S = 0.25


class Clock:
    """Device time with events on a GPU (torch's cuda namespace serves ROCm too), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"
        # The SM clock (MHz) while the last timed calls ran, or None where the management
        # library (NVML, amdsmi) is absent.  Rows of the staged path carry it: its kernel in
        # device memory is bound per SM, so a GPU left at its idle clock by DMA-only rows
        # before it moves half as much (docs/PERFORMANCE.md).
        self.sm_mhz: int | None = None
        self._clock_readable = self.gpu

    def time(self, fn: Callable[[], None], reps: int, warmup: int = 2) -> tuple[float, float]:
        """Median seconds per call on the device, and median host seconds to enqueue a call."""
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        self.sync()
        if (time.perf_counter() - t0) / max(1, warmup) > SLOW_CALL_S:
            reps = min(reps, 3)
        device, host, mhz = [], [], []
        for _ in range(reps):
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            if self.gpu:
                end.record()
                mhz.append(self._sm_clock())  # read while the calls run, after both events are enqueued
                end.synchronize()
                device.append(start.elapsed_time(end) / 1e3)
            else:
                device.append(host[-1])
        known = [m for m in mhz if m is not None]
        self.sm_mhz = int(statistics.median(known)) if known else None
        return statistics.median(device), statistics.median(host)

    def _sm_clock(self) -> int | None:
        if not self._clock_readable:
            return None
        try:
            return int(torch.cuda.clock_rate())
        except Exception:  # noqa: BLE001 -- no NVML / amdsmi here: the rows go without the clock
            self._clock_readable = False
            return None

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def host_us(self, fn: Callable[[], None], calls: int = 3000, sync_every: int = 100) -> float:
        """Median host microseconds of a call issued back to back, as an engine issues per-layer loads.
        A synchronise every `sync_every` calls keeps the launch queue from filling (then a call
        would wait for the GPU); the first tenth of the calls warm caches and are dropped."""
        times = []
        for i in range(calls):
            if i % sync_every == 0:
                self.sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        self.sync()
        return statistics.median(times[calls // 10:]) * 1e6


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


@contextlib.contextmanager
def one_thread_on_cpu(gpu: bool) -> Iterator[None]:
    """Torch on one thread where a section's scaled model runs on the CPU: its matmuls are too
    small to split, and OpenMP's hand-offs cost more than the work (one 32x256x1088 matmul:
    0.4 ms on one thread, 19 ms on two of a busy 2-core runner)."""
    threads = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
