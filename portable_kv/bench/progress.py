"""What a run is doing, on stderr: one line a step, and for counted work how far it is and the time left."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """`progress(msg)` says what starts; a section that knows its work says so with `expect(n)`
    and reports each unit with `done(msg)`, which adds the count and an estimate of the time
    left (from the time per unit so far: units differ, so it is a guide, not a promise)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.total = self.count = 0
        self.started = 0.0

    def __call__(self, msg: str) -> None:
        print(f"[bench] {msg}", file=self.stream or sys.stderr, flush=True)

    def expect(self, units: int) -> None:
        if not self.total - self.count:  # a new stretch of counted work: its own clock
            self.total = self.count = 0
            self.started = time.perf_counter()
        self.total += units

    def done(self, msg: str, units: int = 1) -> None:
        self.count += units
        total = max(self.total, self.count)
        left = (time.perf_counter() - self.started) / self.count * (total - self.count)
        self(f"{self.count}/{total}, ~{duration(left)} left: {msg}")
