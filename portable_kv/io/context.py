"""What one host pool's io paths share: its movers (one of each path, made at first use),
one bad-index flag, and the record of what they did.

A path that delegates (auto to kernel, bulk, direct and staged; staged and bulk to
kernel) is handed the pool's own movers of those paths, not new ones: staging memory
is allocated once per pool whichever path asked for it, and auto sees the staged
backups a caller issued through `staged` as well as its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..stats import PoolStats
from .mover import BadIndexFlag, Mover, share_flag


class IoContext:
    """One host pool's movers, bad-index flag and stats."""

    def __init__(self, device: torch.device, make: Callable[[str, IoContext], Mover]) -> None:
        self.bad_index = BadIndexFlag(device)
        self.stats = PoolStats()
        self.movers: dict[str, Mover] = {}
        self._make = make  # the backend's factory: an io name and this context to a new mover

    def mover(self, io: str) -> Mover:
        """The pool's mover of `io`, made at first use."""
        mover = self.movers.get(io)
        if mover is None:
            mover = self._make(io, self)
            share_flag(self.bad_index, mover)
            self.movers[io] = mover
        return mover

    def close(self) -> None:
        """Drop what every mover keeps (staging, launches, side streams); the context may be used again."""
        for mover in self.movers.values():
            mover.close()
        self.movers.clear()
