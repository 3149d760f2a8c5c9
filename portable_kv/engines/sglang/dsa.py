"""portable_kv's DSA indexer pool as SGLang 0.5.23's `DSAIndexerPoolHost` (docs/API.md, "SGLang host pools served and not served").

DeepSeek-V3.2's sparse attention keeps, beside each layer's MLA latent, index
keys with their scales: per layer one uint8 row per device page (fp8 keys,
then one fp32 scale per 128-element block).  The host pool rides on the
anchor MLA host pool (portable_kv's `SGLangMLAHostPool`): the same token
slots, page size and layout, one host row per page.  Its layers are compact:
only device layers that own index keys (shared-top-k layers hold none), then
one per packed NextN draft.  `SGLangDSAIndexerHostPool` holds the rows in a
`SlotRowsHostPool` (slots.py), so portable_kv's io paths move them, and
answers SGLang's contract: its constructor as SGLang's DSA strategy and
draft-sidecar builder call it, per-layer loads (``is_draft`` for drafts),
the all-layer backup, and pages for L3 tiers in SGLang's byte order.  It
subclasses SGLang's class for SGLang's `isinstance` tests; SGLang's
constructor never runs.  This module imports sglang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

from ...allocator import PageRunAllocator
from .mla import SGLangMLAHostPool
from .pool import fallback_builder
from .slots import SlotRows, SlotRowsHostPool
from .surface import HostSlots


def indexer_unsupported_reason(decl: Any, anchor_host: Any, is_dummy: bool = False) -> str | None:
    """Why SGLang's DSA indexer host pool for these arguments stays SGLang's own, or None."""
    if is_dummy:
        return "is_dummy: an allocator-only indexer pool (a rank that is not the DSA source) holds no rows"
    if not isinstance(anchor_host, SGLangMLAHostPool):
        return f"anchor_host: SGLang's own {type(anchor_host).__name__}; the indexer follows the latent pool it is anchored on"
    device_pool = decl.device_pool
    if getattr(device_pool, "layer_shard_enabled", False):
        return "a layer-sharded DSA device pool moves a subset of layers per rank; portable_kv's pool moves every owned layer"
    width = decl.storage_info.page_bytes(anchor_host.page_size)
    rows = [buffer for buffer in device_pool.index_k_with_scale_buffer if buffer.shape[0]]
    if any(buffer.dim() != 2 or buffer.shape[1] != width for buffer in rows):
        return f"index rows other than one {width}-byte row per page (compressed index pools); portable_kv moves whole page rows"
    return None


class SGLangDSAIndexerHostPool(HostSlots, DSAIndexerPoolHost):
    """DSA index keys in host memory, one row per page of the anchor MLA pool, in its layout.

    `index_k_with_scale_buffer` is SGLang's shape, (layers, pages, row)
    layer_first and (pages, layers, 1, row) page_first/page_first_direct,
    viewing the row pool's memory.  Transfers follow the device pool SGLang
    passes: the target DSA pool, or on ``is_draft=True`` loads a draft's.
    """

    can_use_jit = False
    can_use_write_back_jit = False
    staging_buffer = None
    device = "cpu"
    _is_dummy = False

    def __init__(self, decl: Any, anchor_host: Any, *, packed_draft_device_pools: tuple = (), pin_memory: bool = True,
                 device: str = "cpu", allocator_type: str = "default", is_dummy: bool = False) -> None:
        reason = indexer_unsupported_reason(decl, anchor_host, is_dummy)
        if reason:
            raise NotImplementedError(reason)
        device_pool = decl.device_pool
        self.decl, self.device_pool, self._destroyed = decl, device_pool, False
        self.page_size, self.layout, self.pin_memory = anchor_host.page_size, anchor_host.layout, pin_memory
        self.dtype, self.indexer_dtype = device_pool.store_dtype, decl.storage_info.dtype
        self.start_layer, self.end_layer = device_pool.start_layer, device_pool.end_layer
        declared = decl.owned_device_layers
        self._live_target_layers = [layer for layer in range(device_pool.layer_num) if declared is None or layer in declared]
        self._device_to_host_layer = {layer: i for i, layer in enumerate(self._live_target_layers)}
        self.target_layer_num = len(self._live_target_layers)
        self.mtp_draft_device_pools = tuple(packed_draft_device_pools)
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        self.size, self.page_num = anchor_host.size, anchor_host.page_num
        self.indexer_page_stride_size = decl.storage_info.page_bytes(self.page_size)
        self.indexer_layout_dim = self.indexer_page_stride_size * self.layer_num
        # SGLang's row count: a padding row past the anchor's last page.
        self.indexer_page_num = (self.size + self.page_size + 1) // self.page_size
        self.size_per_token = decl.storage_info.bytes_per_token_per_layer * self.layer_num

        self._device_pools: dict[int, tuple[Any, SlotRows]] = {}
        self._pages: tuple[Any, Any, torch.Tensor, torch.Tensor] | None = None
        self._rows = SlotRowsHostPool(
            self._target_rows(device_pool), [self._draft_rows(draft) for draft in self.mtp_draft_device_pools], slots=self.indexer_page_num,
            layout=self.layout, pin_memory=pin_memory, io_backend=anchor_host.io_backend, pool_label="indexer", allocator_type=allocator_type)
        host, width = self._rows.kv_buffer, self.indexer_page_stride_size
        self.index_k_with_scale_buffer = (host.view(self.layer_num, self.indexer_page_num, width) if self.layout == "layer_first"
                                          else host.view(self.indexer_page_num, self.layer_num, 1, width))
        self.index_k_data_refs = [self.index_k_with_scale_buffer[i] for i in range(self.layer_num)] if self.layout == "layer_first" else []
        # The anchor's token slots (HostSlots): SGLang's group hands this pool the anchor's slots.
        self._slots = PageRunAllocator(self.size, self.page_size)
        self.lock = threading.RLock()

    def _target_rows(self, device_pool: Any) -> SlotRows:
        """The owned layers' index rows of a target DSA pool, made once per pool (its index buffers never move)."""
        held = self._device_pools.get(id(device_pool))
        if held is None or held[0] is not device_pool:
            buffers = device_pool.index_k_with_scale_buffer
            held = self._device_pools[id(device_pool)] = (device_pool, SlotRows([buffers[layer] for layer in self._live_target_layers]))
        return held[1]

    def _draft_rows(self, device_pool: Any) -> SlotRows:
        held = self._device_pools.get(id(device_pool))
        if held is None or held[0] is not device_pool:
            held = self._device_pools[id(device_pool)] = (device_pool, SlotRows(device_pool.index_k_with_scale_buffer))
        return held[1]

    def _page_indices(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each page's first token slot -> its page (one index row per page), kept for the per-layer calls of one transfer."""
        held = self._pages
        if held is not None and held[0] is host_indices and held[1] is device_indices:
            return held[2], held[3]
        if host_indices.numel() % self.page_size:
            raise ValueError(f"host_indices: the DSA index keys move whole pages of {self.page_size} tokens, got {host_indices.numel()} tokens")
        pages = (host_indices.reshape(-1, self.page_size)[:, 0] // self.page_size, device_indices.reshape(-1, self.page_size)[:, 0] // self.page_size)
        self._pages = (host_indices, device_indices, *pages)
        return pages

    def init_kv_buffer(self) -> torch.Tensor:
        """The host buffer, allocated at construction."""
        return self.index_k_with_scale_buffer

    # -- transfers as SGLang calls them ------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = None, *, is_draft: bool = False) -> None:
        """H2D, one layer's index rows.  A device layer without index keys is nothing to do;
        ``is_draft``: `layer_id` is ``target device layers + depth`` and `device_pool` that draft's pool."""
        if not is_draft and layer_id not in self._device_to_host_layer:
            return
        host_layer = self._draft_host_layer(layer_id) if is_draft else self._device_to_host_layer[layer_id]
        rows = self._draft_rows(device_pool) if is_draft else self._target_rows(device_pool)
        host_pages, device_pages = self._page_indices(host_indices, device_indices)
        self._rows.load_to_device_per_layer(rows, host_pages, device_pages, host_layer, io_backend, is_draft=is_draft)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                     io_backend: str | None = None) -> None:
        """D2H, every owned layer from `device_pool`, each packed draft's from its own pool."""
        host_pages, device_pages = self._page_indices(host_indices, device_indices)
        self._rows.backup_from_device_all_layer(self._target_rows(device_pool), host_pages, device_pages, io_backend)

    # -- pages for L3 tiers -------------------------------------------------------------

    def get_data_page(self, index: Any, flat: bool = True) -> torch.Tensor:
        """The index rows of the page whose first token is `index`: a copy in the layout's order, or (flat=False) SGLang's view."""
        page = int(index) // self.page_size
        if flat:
            return self._rows.get_data_page(page)
        return self.index_k_with_scale_buffer[:, page : page + 1] if self.layout == "layer_first" else self.index_k_with_scale_buffer[page : page + 1]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.indexer_page_stride_size, dtype=self.indexer_dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._rows.set_from_flat_data_page(int(index) // self.page_size, data_page.reshape(-1))

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """One block per page, every layer's row (page_first, page_first_direct), as SGLang's."""
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"get_page_buffer_meta: the index rows of a {self.layout!r} page are not one block")
        return self._rows.get_page_buffer_meta(indices[:: self.page_size] // self.page_size)

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return self._rows.is_stride_page_aligned(page_size_bytes)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.index_k_with_scale_buffer]

    def destroy(self) -> None:
        """Release the host memory; idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        self._rows.close()
        self.index_k_with_scale_buffer = None
        self.index_k_data_refs = []


def host_pool_builder(sglang_class: type) -> Callable[..., Any]:
    """What install() binds as SGLang's `DSAIndexerPoolHost`: portable_kv's indexer pool, or
    SGLang's own class (with a log line) for arguments `indexer_unsupported_reason` names."""

    def reason(given: dict[str, Any]) -> str | None:
        return indexer_unsupported_reason(given["decl"], given["anchor_host"], given.get("is_dummy", False))

    return fallback_builder(SGLangDSAIndexerHostPool, sglang_class, reason, "DSA indexer host pool")
