"""What one host pool's io paths share: its movers (one of each path, made at first use),
one bad-index flag, the io settings read when the pool was built, and the record of what
they did.

A path that delegates (auto to kernel, bulk, direct and staged; staged and bulk to
kernel) is handed the pool's own movers of those paths, not new ones: staging memory
is allocated once per pool whichever path asked for it, and auto sees the staged
backups a caller issued through `staged` as well as its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import config
from ..stats import PoolStats
from .mover import BadIndexFlag, Mover, share_flag

# Blocks of the kernel between staging and the KV buffers (PORTABLE_KV_STAGING_BLOCKS): it
# works in device memory, where a few blocks keep several times what one copy engine
# drains from PCIe in flight; the model keeps the other SMs.
STAGING_BLOCKS = int(config.STAGING_BLOCKS.default or 8)


@dataclass(frozen=True)
class IoSettings:
    """The settings a pool's movers use, read once: a pool keeps what was set when it was
    built, whatever the environment says by the time a path is first used."""

    staging_bytes: int  # PORTABLE_KV_STAGING_BYTES; 0: staging's own default
    staging_blocks: int  # PORTABLE_KV_STAGING_BLOCKS, else STAGING_BLOCKS

    @classmethod
    def read(cls) -> IoSettings:
        return cls(staging_bytes=config.STAGING_BYTES.integer(minimum=1) or 0,
                   staging_blocks=config.STAGING_BLOCKS.integer(minimum=1) or STAGING_BLOCKS)


class IoContext:
    """One host pool's movers, bad-index flag, io settings and stats."""

    def __init__(self, device: torch.device, make: Callable[[str, IoContext], Mover]) -> None:
        self.settings = IoSettings.read()
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
