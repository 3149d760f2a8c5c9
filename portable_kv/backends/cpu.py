"""The reference backend: torch index ops on the canonical view; the oracle for every test.

`kernel` io moves data with torch advanced indexing, independent of the
planner; `direct` io executes the copy engines' plan (plan.copy_batch) with
memmove, so the DMA planner runs in CI too.
"""

from __future__ import annotations

import ctypes

import torch

from ..layout import canonical_view
from ..plan import Transfer, copy_batch
from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    vendor = "cpu"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def transfer(self, transfer: Transfer, io_backend: str) -> None:
        if io_backend == "direct":
            batch = copy_batch(transfer)
            for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
                ctypes.memmove(dst, src, size)
            return
        P = transfer.page_size
        host_idx, _ = transfer.indices.on(torch.device("cpu"))
        _, dev_idx = transfer.indices.on(transfer.pairs[0].device[0].device)
        page, offset = host_idx // P, host_idx % P
        for pair in transfer.pairs:
            view = _as_bits(canonical_view(pair.host, pair.layout, P))
            for layer in transfer.layers:
                device = _as_bits(pair.device[layer])
                if transfer.to_device:
                    device[dev_idx] = view[page, offset, layer].to(device.device)
                else:
                    view[page, offset, layer] = device[dev_idx].cpu()


# Moves are bit copies: integer views of the same width work for every dtype,
# float8 included, whose index kernels torch does not implement on the CPU.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])

