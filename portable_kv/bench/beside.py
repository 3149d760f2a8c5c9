"""Loads beside compute: the bench's bf16 matmul loop on the current stream, per-layer loads on a side stream.

One draw measures the loop alone, then runs it again with loads on the side stream,
interleaved (a load, then its share of the matmuls, as an engine runs layer by layer)
or all queued first; it reports the loads' rate over their span, the matmuls' cost
against the loop alone just before (the clocks drift over a run), how much of the
loads' span the matmuls covered, and the caller's time per load call (the matmuls
enqueued after a call wait for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .measure import Clock, gbps

SIZE, MATMULS = 8192, 40
LINK_GUESS = 50e9  # bytes/s: enough loads that they outlast the loop


class MatmulLoop:
    """MATMULS bf16 SIZE^3 matmuls on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(SIZE, SIZE, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(SIZE, SIZE, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)

    def run(self, count: int = MATMULS) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.c)

    def tflops(self, seconds: float) -> float:
        return 2 * SIZE**3 * MATMULS / seconds / 1e12

    def draw(self, clock: Clock, load: Callable[[int], None], call_bytes: int, side: torch.cuda.Stream,
             loads_first: bool = False) -> dict[str, float]:
        """One draw: `load(i)` issues load i (on the current stream, which is `side` then) and
        moves `call_bytes`."""
        alone, _ = clock.time(self.run, 1, warmup=1)
        calls = max(4, int(alone / (call_bytes / LINK_GUESS)) + 2)
        t_start, t_end, m_start, m_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        side.wait_stream(torch.cuda.current_stream())
        t_start.record(side)
        host_s = 0.0

        def issue(i: int) -> None:
            nonlocal host_s
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                load(i)
            host_s += time.perf_counter() - t0

        if loads_first:
            for i in range(calls):
                issue(i)
            m_start.record()
            self.run()
        else:
            m_start.record()
            for i in range(calls):
                issue(i)
                self.run(MATMULS * (i + 1) // calls - MATMULS * i // calls)
        m_end.record()
        t_end.record(side)
        torch.cuda.synchronize()
        busy, moved = m_start.elapsed_time(m_end) / 1e3, t_start.elapsed_time(t_end) / 1e3
        # How much of the loads' span the matmuls covered: a rate measured mostly outside
        # the compute says little about interference.
        overlap = max(0.0, min(t_start.elapsed_time(m_end) / 1e3, moved) - max(t_start.elapsed_time(m_start) / 1e3, 0.0))
        return {"gbps": gbps(calls * call_bytes, moved), "matmul_slowdown_pct": 100 * (busy / alone - 1),
                "host_us": host_s / calls * 1e6, "overlap_pct": 100 * overlap / moved, "matmul_alone_ms": alone * 1e3, "loads": calls}
