"""The interface every io path implements: a mover turns a transfer into a launch once, and
the plan that owns the launch runs it on each call (plan.py).

A mover is a strategy: it keeps nothing about a transfer.  What a call needs again (kernel
arguments, a bulk piece list, copy descriptors, a staging schedule) is built into the
`Launch` it returns, which the transfer's plan keeps; the launch says which path it takes
and why, where that is not the path asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..config import IO_PATHS
from ..transfer import BadIndexFlag, Transfer

__all__ = ["IO_PATHS", "BadIndexFlag", "Launch", "Mover"]


class Launch(ABC):
    """One transfer on one io path, direction and layer span, ready but for its layer and stream."""

    path: str  # the path that moves the bytes: auto, bulk and staged may hand a transfer to another
    reason: str = ""  # why that path, where it is not the one asked for

    @abstractmethod
    def run(self, layers: range, stream: int | None) -> None:
        """Enqueue the transfer for `layers` (as many as it was built for) on `stream`."""


class Mover(ABC):
    """One io path of one host pool: builds launches; the pool's io context owns it."""

    io: str  # one of IO_PATHS
    # How it reads a host buffer: by its strides and base address (the copy kernels), or by
    # indexing its layout-shaped tensor (the CPU oracle); the staged path shapes its staging
    # miniatures to match.
    reads_strides: bool = True

    @abstractmethod
    def build(self, transfer: Transfer) -> Launch:
        """The launch of one validated transfer."""

    def close(self) -> None:  # noqa: B027 -- most paths hold nothing for their pool
        """Drop what the path holds for its pool (staging memory, side streams); idempotent."""
