"""One buffer of per-layer slot rows as a portable_kv pool: what SGLang's state and indexer host pools hold.

SGLang's Mamba state pool (`MambaPoolHost`) and DSA's indexer pool
(`DSAIndexerPoolHost`) keep, per layer, one device tensor whose leading axis
is a slot (a request's state checkpoint; an index-key page) and whose rest is
that slot's bytes.  Seen as (slots, 1, row) it is an MLA pool's latent with a
page of one slot: `SlotRowsHostPool` is an `MLAHostPool` over those views
(the same checks, movers, io paths and pages as every portable_kv pool), built
and called as SGLangPool builds and calls its pools, drafts packed after the
target's layers.  Its host buffer is (slots, layers, 1, row) page_first and
(slots, layers, 1, 1, row) page_first_direct: SGLang's bytes in either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...device_pool import MLADevicePool
from ...mla import MLAHostPool
from .pool import SGLangPool


class SlotRows:
    """The device side of one state tensor: its per-layer (slots, 1, row) views, under the
    attribute name a one-buffer pool moves (`kv_buffer`)."""

    __slots__ = ("kv_buffer",)

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        self.kv_buffer = [slot_rows(layer) for layer in layers]


def slot_rows(layer: torch.Tensor) -> torch.Tensor:
    """One layer's (slots, ...) tensor as (slots, 1, row), sharing its memory."""
    if not layer.is_contiguous():
        raise ValueError(f"expected contiguous slot rows, got shape {tuple(layer.shape)} with strides {layer.stride()}")
    return layer.view(layer.shape[0], 1, -1)


def contiguous_slots(tensor: torch.Tensor) -> bool:
    """Whether each layer of a (layers, slots, ...) tensor is contiguous rows of slots (not views into a shared envelope)."""
    return all(layer.is_contiguous() for layer in tensor.unbind(0)) if tensor.shape[0] else True


class SlotRowsHostPool(SGLangPool, MLAHostPool):
    """Host rows for per-layer slot tensors (`layers`), with each draft's one layer packed after them.

    `slots` host rows exactly; SGLang's io choice per call (SGLangPool); the
    device tensors a call moves are those of the `SlotRows` it is given."""

    def __init__(self, layers: SlotRows, drafts: Sequence[SlotRows], *, slots: int, layout: str, pin_memory: bool,
                 io_backend: str | None = None, pool_label: str = "state", allocator_type: str = "default") -> None:
        target = MLADevicePool.from_buffers(layers.kv_buffer, 1)
        self._init_from_sglang(
            target, [(draft.kv_buffer,) for draft in drafts], host_to_device_ratio=1.0, host_size=0, page_size=1, layout=layout,
            pin_memory=pin_memory, device_capacity_tokens=target.size, start_layer=0, end_layer=None, pool_label=pool_label,
            allocator_type=allocator_type, host_token_capacity=slots, io_backend=io_backend)

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot of one layer."""
        return self.kv_cache_dim * self.dtype.itemsize

    def page_bytes(self, index: Any) -> torch.Tensor:
        """Slot `index`'s rows over all layers, as bytes in the host layout's order."""
        return self.get_data_page(index).view(torch.uint8)

    def set_page_bytes(self, index: Any, data: torch.Tensor) -> None:
        """Write `page_bytes`'s bytes back into slot `index`."""
        if data.storage_offset() % self.dtype.itemsize:
            data = data.clone()  # a byte slice that starts mid-element cannot be viewed as this dtype
        self.set_from_flat_data_page(index, data.view(self.dtype))
