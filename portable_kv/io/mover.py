"""The one interface every io path implements (Mover), and the flag they raise through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..config import IO_PATHS
from ..transfer import Transfer

__all__ = ["IO_PATHS", "BadIndexFlag", "Mover", "MoverFactory", "share_flag"]


class BadIndexFlag:
    """Set when a mover skips a token whose index is outside its pool.

    It lives in page-locked, mapped host memory on a GPU, so a kernel sets it and
    the host reads it without synchronising; the next call turns it into an error.
    """

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
        self._view = self.tensor.numpy()

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def set(self) -> None:
        self._view[0] = 1

    def check(self) -> None:
        if self._view[0]:
            self._view[0] = 0
            raise RuntimeError(
                "portable_kv: an earlier transfer met token indices outside the pools and skipped them "
                "(nothing outside the pools was written); validate indices, or keep validate=True"
            )


class Mover(ABC):
    """One io path of one host pool: enqueues validated transfers on the current stream.

    A mover is owned by one host pool; everything it keeps for that pool (prepared
    launches, job templates, staging memory, side streams) goes with it, or with close()."""

    io: str  # one of IO_PATHS
    # How it reads a host buffer: by its strides and base address (the copy kernels), or by
    # indexing its layout-shaped tensor (the CPU oracle); the staged path shapes its staging
    # miniatures to match.
    reads_strides: bool = True

    def __init__(self, device: torch.device) -> None:
        self.bad_index = BadIndexFlag(device)

    @abstractmethod
    def move(self, transfer: Transfer) -> None:
        """Enqueue one validated transfer; raises first if an earlier transfer skipped a bad index."""

    @abstractmethod
    def close(self) -> None:
        """Drop every per-pool cache (idempotent); the mover may be used again after."""


MoverFactory = Callable[[], Mover]


def share_flag(flag: BadIndexFlag, *movers: Mover) -> None:
    """One bad-index flag for a mover and the movers it delegates to: whichever skipped
    a token, the pool's next call raises."""
    for mover in movers:
        mover.bad_index = flag
        share_flag(flag, *getattr(mover, "parts", ()))
