"""What a host pool did: calls, bytes, the caller's time and the device's time per direction
and io path, the path a delegating io path (auto, bulk, staged) took and why, and the last error.

One record per pool, updated by every transfer call; `host.stats()` returns a copy as
plain dicts (docs/API.md, "What a pool did").  The caller's time is how long a call held
the thread that made it (enqueueing); the device's time is read back from each call's
events once the call has completed, so `device_calls` may trail `calls` while calls run.
"""

from __future__ import annotations

import copy
from typing import Any

DIRECTIONS = {True: "load", False: "backup"}
# io paths that hand a transfer to another: each call's path is recorded, the same one too.
DELEGATING = ("auto", "bulk", "staged")


class StatsRow:
    """One direction and io path's counters."""

    __slots__ = ("calls", "bytes", "seconds", "device_seconds", "device_calls")

    def __init__(self) -> None:
        self.calls = self.bytes = self.device_calls = 0
        self.seconds = self.device_seconds = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds,
                "device_seconds": self.device_seconds, "device_calls": self.device_calls}


class PoolStats:
    """Counters of one host pool; cheap enough for every per-layer call."""

    def __init__(self) -> None:
        self._moved: dict[str, dict[str, StatsRow]] = {"load": {}, "backup": {}}
        self._taken: dict[str, dict[str, dict[str, Any]]] = {}
        self.last_error: str | None = None

    def row(self, to_device: bool, io: str) -> StatsRow:
        rows = self._moved[DIRECTIONS[to_device]]
        row = rows.get(io)
        if row is None:
            row = rows[io] = StatsRow()
        return row

    def taken(self, io: str, path: str, reason: str) -> None:
        """A call of `io` went by `path`, for `reason`."""
        paths = self._taken.setdefault(io, {})
        entry = paths.get(path)
        if entry is None:
            entry = paths[path] = {"calls": 0, "reason": ""}
        entry["calls"] += 1
        entry["reason"] = reason

    def error(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"

    def as_dict(self) -> dict[str, Any]:
        moved = {direction: {io: row.as_dict() for io, row in rows.items()} for direction, rows in self._moved.items()}
        return {**moved, "paths": copy.deepcopy(self._taken), "last_error": self.last_error}
