"""The io paths a backend offers, and which path a delegating path (`auto`, `staged`) took.

The paths are read from the backend (`backend.io_backends`), so a path a backend adds
is measured without a change here.  Which path was taken: from the pool's counters
(`host.stats()`: per delegating io path, the paths taken with the reason), counted over
a span of calls.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..backends.base import Backend


def io_paths(backend: Backend) -> tuple[str, ...]:
    """Every io path `backend` offers, in its order."""
    return tuple(backend.io_backends)


def auto_choices(stats: dict[str, Any], io: str = "auto") -> Counter[str]:
    """Calls per path `io` took, from a `host.stats()` dict (docs/API.md: "paths", per
    delegating io path, per path taken, its calls and the latest call's reason)."""
    taken = (stats.get("paths") or {}).get(io) or {}
    return Counter({path: int(entry["calls"]) for path, entry in taken.items()})


class AutoWatch:
    """Which paths `host`'s calls of `io` took from now until `took()`; the spans the bench
    watches carry calls of one direction only, so the pool's counters, kept over both, tell them."""

    def __init__(self, host: Any, io: str = "auto") -> None:
        self.host, self.io = host, io
        self.before = auto_choices(host.stats(), io)

    def took(self) -> str:
        """The path taken, or "path xN, path xM" where more than one; "" where no call went through `io`."""
        calls = auto_choices(self.host.stats(), self.io) - self.before
        if len(calls) == 1:
            return next(iter(calls))
        return ", ".join(f"{path} x{n}" for path, n in calls.most_common())

    def reasons(self) -> dict[str, str]:
        """Per path taken in the span, the reason the pool gives for its latest such call."""
        stats = self.host.stats()
        taken = (stats.get("paths") or {}).get(self.io) or {}
        calls = auto_choices(stats, self.io) - self.before
        return {path: taken[path].get("reason", "") for path in calls}
