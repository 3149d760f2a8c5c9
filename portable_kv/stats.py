"""What a host pool did: calls, bytes and the caller's time per direction and io path, the
path a delegating io path (auto, bulk, staged) took and why, and the last error.

One record per pool, updated by every transfer call; `host.stats()` returns a copy as
plain dicts (docs/API.md, "What a pool did").  Times are the caller's: how long the
call held the thread that made it (enqueueing), not the GPU's time, which would need
an event per call.
"""

from __future__ import annotations

import copy
from typing import Any

DIRECTIONS = {True: "load", False: "backup"}


class PoolStats:
    """Counters of one host pool; cheap enough for every per-layer call."""

    def __init__(self) -> None:
        self._moved: dict[str, dict[str, list[float]]] = {"load": {}, "backup": {}}
        self._taken: dict[str, dict[str, dict[str, Any]]] = {}
        self.last_error: str | None = None

    def record(self, to_device: bool, io: str, nbytes: int, seconds: float, taken: str | None = None, reason: str = "") -> None:
        row = self._moved[DIRECTIONS[to_device]].get(io)
        if row is None:
            row = self._moved[DIRECTIONS[to_device]][io] = [0, 0, 0.0]
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds
        if taken is not None and taken != io:
            paths = self._taken.setdefault(io, {})
            entry = paths.get(taken)
            if entry is None:
                entry = paths[taken] = {"calls": 0, "reason": ""}
            entry["calls"] += 1
            entry["reason"] = reason

    def error(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"

    def as_dict(self) -> dict[str, Any]:
        moved = {direction: {io: {"calls": int(c), "bytes": int(b), "seconds": s} for io, (c, b, s) in paths.items()}
                 for direction, paths in self._moved.items()}
        return {**moved, "paths": copy.deepcopy(self._taken), "last_error": self.last_error}
