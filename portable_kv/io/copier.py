"""The copier: what copies bytes between host and device memory (a GPU's copy engines, or
memmove) and orders the streams those copies run on.

One small interface, implemented by each vendor runtime (backends/runtime.py under
cuda.py and rocm.py) and by the host (backends/memmove.py), so that an io path takes
one copier and runs on any of them: the direct path hands it batches, the staged
path 1-D batches and 2-D copies and its streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from .mover import Mover
from .streams import Streams


@dataclass(frozen=True)
class CopyBatch:
    """1-D copies for a copy engine: parallel arrays of byte addresses and sizes."""

    dst: np.ndarray  # uint64
    src: np.ndarray  # uint64
    sizes: np.ndarray  # uint64
    skipped: bool = False  # tokens were left out: an index was outside a pool

    def __len__(self) -> int:
        return int(self.sizes.size)

    def slice(self, begin: int, end: int) -> CopyBatch:
        return CopyBatch(self.dst[begin:end], self.src[begin:end], self.sizes[begin:end])


class Copier(ABC):
    """Copies in 1-D, 2-D and batched form on a stream, and the streams' order."""

    device: torch.device
    dma_streams: int  # streams one direct-io transfer is spread over, a copy engine each
    # From this average copy length a transfer goes out as one call on the caller's stream
    # (io/direct.py); None: always spread over `dma_streams`.
    one_call_copy_bytes: int | None = None

    @abstractmethod
    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue one copy of `nbytes` on `stream`."""

    @abstractmethod
    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        """Enqueue `height` rows of `width` bytes, each side at its own pitch, on `stream`."""

    def memcpy_batch(self, batch: CopyBatch, stream: int) -> None:
        """Enqueue every copy of `batch` on `stream`: here one by one; a runtime with a
        batched call makes it one call."""
        for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
            self.memcpy(dst, src, size, stream)

    @abstractmethod
    def current_stream(self) -> int:
        """The handle of the current stream: transfers are ordered on it."""

    @abstractmethod
    def streams(self) -> Streams:
        """New side streams and events over this copier, for one mover."""

    @abstractmethod
    def register_host(self, address: int, nbytes: int) -> int:
        """Page-lock and map an existing host range for the copier; returns its device address."""

    @abstractmethod
    def unregister_host(self, address: int) -> None:
        """Undo register_host."""

    @abstractmethod
    def direct_mover(self) -> Mover:
        """A new direct-io mover over this copier, for one host pool."""
