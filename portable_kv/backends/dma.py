"""The `direct` io path: the DMA plan (plan.copy_batch) executed by copy engines, over
several streams, or by memmove where the device is the CPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..plan import CopyBatch, Transfer, copy_batch
from .base import Mover

if TYPE_CHECKING:
    from .runtime import DeviceRuntime


class DmaMover(Mover):
    """Copy engines of one GPU: one batched memcpy per stream, spread over
    runtime.dma_streams streams ordered after, and before, the current one."""

    io = "direct"

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self.device = torch.device("cuda", runtime.device_index)
        super().__init__(self.device)
        self._local = threading.local()

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        batch = copy_batch(transfer)
        if batch.skipped:
            self.bad_index.set()
        if not len(batch):
            return
        current = torch.cuda.current_stream(self.device)
        pieces = split_even(batch, self.runtime.dma_streams)
        if current.cuda_stream != 0 and len(pieces) == 1:
            self.runtime.memcpy_batch(batch, current.cuda_stream)
            return
        # Several streams let several copy engines work at once; and the batch
        # APIs reject the legacy default stream.  Side streams are ordered
        # after, and before, everything on the current stream.
        side = self._side_streams(current)
        streams = ([current] if current.cuda_stream != 0 else []) + side
        for stream in side:
            stream.wait_stream(current)
        for piece, stream in zip(pieces, streams):
            self.runtime.memcpy_batch(piece, stream.cuda_stream)
        for stream in side:
            current.wait_stream(stream)

    def _side_streams(self, current: torch.cuda.Stream) -> list[torch.cuda.Stream]:
        # Side streams of their own for each stream the engine uses: shared ones
        # would serialise a load and a backup that the engine put on two streams.
        by_stream = getattr(self._local, "side_streams", None)
        if by_stream is None:
            by_stream = self._local.side_streams = {}
        streams = by_stream.setdefault(current.cuda_stream, [])
        while len(streams) < self.runtime.dma_streams:
            streams.append(torch.cuda.Stream(self.device))
        return streams[: self.runtime.dma_streams]

    def close(self) -> None:
        self._local = threading.local()


class HostCopyMover(Mover):
    """The same plan executed with memmove on the CPU, so the planner runs in CI."""

    io = "direct"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        batch = copy_batch(transfer)
        if batch.skipped:
            self.bad_index.set()
        for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
            ctypes.memmove(dst, src, size)

    def close(self) -> None:
        """Nothing to drop: the plan's runs are kept with the indices, which the pool owns."""


def split_even(batch: CopyBatch, parts: int) -> list[CopyBatch]:
    """`parts` pieces of about equal bytes (fewer for a small batch)."""
    if parts <= 1 or len(batch) < 2 * parts:
        return [batch]
    cuts = np.searchsorted(np.cumsum(batch.sizes), [batch.sizes.sum() * i // parts for i in range(1, parts)])
    bounds = [0, *cuts.tolist(), len(batch)]
    return [batch.slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def split_batch(batch: CopyBatch, limit: int | None) -> list[CopyBatch]:
    """Pieces of at most `limit` descriptors (ROCm faults above 8192 on some parts)."""
    if limit is None or len(batch) <= limit:
        return [batch]
    return [batch.slice(i, i + limit) for i in range(0, len(batch), limit)]
