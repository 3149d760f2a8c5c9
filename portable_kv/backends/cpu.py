"""The reference backend: torch indexing on the canonical view; the oracle for every test.

`kernel` io moves data with torch advanced indexing, independent of the planners;
`direct`, `staged` and `bulk` io execute their descriptors, schedules and pieces with
memmove, so the planners run in CI too.  Every path keeps the GPU kernels' guarantee for
unvalidated indices: a token outside either pool is skipped and flagged, and the
next call raises.
"""

from __future__ import annotations

import torch

from ..io.bulk import PieceWalker
from ..io.kernel_args import WORD_DTYPES
from ..io.mover import Launch, Mover
from ..layout import canonical_view
from ..transfer import Transfer
from .base import Backend
from .memmove import Memmove


class IndexingLaunch(Launch):
    """torch advanced indexing of one transfer's in-bounds tokens."""

    path = "indexing"
    reason = "the cpu backend serves kernel io with torch indexing"

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer
        P = transfer.page_size
        host_np, dev_np, self.skipped = transfer.indices.inside(transfer.pairs[0].strides.tokens, transfer.pairs[0].device[0].shape[0])
        host_idx = torch.from_numpy(host_np)
        self.device_idx, self.page, self.offset = torch.from_numpy(dev_np), host_idx // P, host_idx % P
        self.views = [as_words(canonical_view(pair.host, pair.layout, P)) for pair in transfer.pairs]

    def run(self, layers: range, stream: int | None) -> None:
        transfer, dev_idx, page, offset = self.transfer, self.device_idx, self.page, self.offset
        if self.skipped:
            transfer.flag.set()
        for pair, view in zip(transfer.pairs, self.views):
            for layer in layers:
                device = as_words(pair.device[layer])
                if transfer.to_device:
                    device[dev_idx] = view[page, offset, layer]
                else:
                    view[page, offset, layer] = device[dev_idx]


class IndexingMover(Mover):
    """torch advanced indexing on the canonical view of the host buffers: the oracle."""

    io = "kernel"
    reads_strides = False

    def build(self, transfer: Transfer) -> Launch:
        return IndexingLaunch(transfer)


class CpuBackend(Backend):
    name = "cpu"
    vendor = "cpu"
    reads_layer_tables = False

    def __init__(self) -> None:
        super().__init__()
        self.copier = Memmove()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def kernel_mover(self) -> Mover:
        return IndexingMover()

    def staging_mover(self, blocks: int) -> Mover:
        return IndexingMover()

    @property
    def offers_bulk(self) -> bool:
        return True

    def bulk_mover(self, fallback: Mover) -> Mover:
        return PieceWalker(self.copier)  # the model carries every transfer: no fallback


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width: moves are bit copies."""
    return t.view(WORD_DTYPES[t.element_size()])
