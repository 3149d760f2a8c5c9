"""The reference backend: torch indexing on the canonical view; the oracle for every test.

`kernel` io moves data with torch advanced indexing, independent of the planners;
`direct`, `staged` and `bulk` io execute their plans on the host's copy engine (memmove),
so the planners run in CI too.  Every path keeps the GPU kernels' guarantee for
unvalidated indices: a token outside either pool is skipped and flagged, and the
next call raises.
"""

from __future__ import annotations

import torch

from ..io.bulk import PlanWalker
from ..io.kernel_args import WORD_DTYPES
from ..io.mover import Mover, MoverFactory
from ..layout import canonical_view
from ..transfer import Transfer
from .base import Backend
from .host import HostEngine


class IndexingMover(Mover):
    """torch advanced indexing on the canonical view of the host buffers."""

    io = "kernel"
    reads_strides = False

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        P = transfer.page_size
        host_np, dev_np, skipped = transfer.indices.inside(transfer.pairs[0].strides.tokens, transfer.pairs[0].device[0].shape[0])
        if skipped:
            self.bad_index.set()
        host_idx, dev_idx = torch.from_numpy(host_np), torch.from_numpy(dev_np)
        page, offset = host_idx // P, host_idx % P
        for pair in transfer.pairs:
            view = as_words(canonical_view(pair.host, pair.layout, P))
            for layer in transfer.layers:
                device = as_words(pair.device[layer])
                if transfer.to_device:
                    device[dev_idx] = view[page, offset, layer]
                else:
                    view[page, offset, layer] = device[dev_idx]

    def close(self) -> None:
        """Nothing to drop: the in-bounds indices are kept with the indices, which the pool owns."""


class CpuBackend(Backend):
    name = "cpu"
    vendor = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.engine = HostEngine()

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

    def bulk_mover(self, fallback: MoverFactory) -> Mover:
        return PlanWalker(self.engine)  # the model carries every transfer: no fallback


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width: moves are bit copies."""
    return t.view(WORD_DTYPES[t.element_size()])
