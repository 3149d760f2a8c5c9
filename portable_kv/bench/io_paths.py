"""The io paths a backend offers, and which path `auto` took.

The paths are read from the backend (`backend.io_backends`), so a path a backend adds
is measured without a change here.  Which path auto took: from the pool's own counters
where it keeps them (`host.stats()`: per direction and path, calls, bytes and seconds,
and auto's choices), counted over a span of calls; where a pool has no counters, from
auto's mover, which remembers its latest call's choice only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..backends.base import Backend


def io_paths(backend: Backend) -> tuple[str, ...]:
    """Every io path `backend` offers, in its order."""
    return tuple(backend.io_backends)


def auto_choices(stats: dict[str, Any], direction: str) -> Counter[str]:
    """Calls per path auto chose in `direction`, from a `host.stats()` dict: auto's entry per
    direction, a path's value its calls or a dict with its "calls" (a "choices" level tolerated)."""
    auto = stats.get("auto") or {}
    auto = auto.get("choices", auto)
    found = auto.get(direction) or {}
    return Counter({path: int(n["calls"] if isinstance(n, dict) else n) for path, n in found.items()})


class AutoWatch:
    """Which paths `host`'s auto calls in `direction` took from now until `took()`."""

    def __init__(self, host: Any, direction: str = "h2d") -> None:
        self.host, self.direction = host, direction
        self.stats = getattr(host, "stats", None)
        self.before = auto_choices(self.stats(), direction) if self.stats is not None else None

    def took(self) -> str:
        """The path taken, or "path xN, path xM" where auto chose more than one; "" where no call went through auto."""
        if self.before is None:
            return latest_choice(self.host)
        calls = auto_choices(self.stats(), self.direction) - self.before
        if len(calls) == 1:
            return next(iter(calls))
        return ", ".join(f"{path} x{n}" for path, n in calls.most_common())


def latest_choice(host: Any) -> str:
    """The path of `host`'s latest call through auto, where the pool keeps no counters."""
    return host._mover("auto").last_choice  # noqa: SLF001 -- no public record of auto's choice in this pool
