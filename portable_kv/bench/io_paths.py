"""The io paths a backend offers, and which path `auto` took.

The paths are read from the backend (`backend.io_backends`), so a path a backend adds
is measured without a change here.  Which path auto took: from the pool's own counters
where it keeps them (`host.stats()`: per direction and path, calls, bytes and seconds,
and the paths auto took with the reason), counted over a span of calls; where a pool
has no counters, from auto's mover, which remembers its latest call's choice only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..backends.base import Backend


def io_paths(backend: Backend) -> tuple[str, ...]:
    """Every io path `backend` offers, in its order."""
    return tuple(backend.io_backends)


def auto_choices(stats: dict[str, Any]) -> Counter[str]:
    """Calls per path auto took, from a `host.stats()` dict (docs/API.md: "paths", per
    delegating io path, per path taken, its calls and the latest call's reason)."""
    taken = (stats.get("paths") or {}).get("auto") or {}
    return Counter({path: int(entry["calls"]) for path, entry in taken.items()})


class AutoWatch:
    """Which paths `host`'s auto calls took from now until `took()`; the spans the bench watches
    carry calls of one direction only, so the pool's counters, kept over both, tell them."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.stats = getattr(host, "stats", None)
        self.before = auto_choices(self.stats()) if self.stats is not None else None

    def took(self) -> str:
        """The path taken, or "path xN, path xM" where auto chose more than one; "" where no call went through auto."""
        if self.before is None:
            return latest_choice(self.host)
        calls = auto_choices(self.stats()) - self.before
        if len(calls) == 1:
            return next(iter(calls))
        return ", ".join(f"{path} x{n}" for path, n in calls.most_common())

    def reasons(self) -> dict[str, str]:
        """Per path auto took in the span, the reason the pool gives for its latest such call."""
        if self.before is None:
            return {}
        taken = (self.stats().get("paths") or {}).get("auto") or {}
        calls = auto_choices(self.stats()) - self.before
        return {path: taken[path].get("reason", "") for path in calls}


def latest_choice(host: Any) -> str:
    """The path of `host`'s latest call through auto, where the pool keeps no counters."""
    return host._mover("auto").last_choice  # noqa: SLF001 -- no public record of auto's choice in this pool
