"""The host-pool surface SGLang 0.5.23's cache controller and storage backends use
(docs/API.md, "The SGLang host-pool surface"): slot allocation, sizes, physical
transfer entry points.  A mixin of the host pools; `MLASurface` adds what SGLang's
MLA pool has beyond it.

Semantics follow SGLang's `HostKVCache` (mem_cache/pool_host/base.py),
`MHATokenToKVPoolHost` (pool_host/mha.py) and `MLATokenToKVPoolHost`
(pool_host/mla.py): token slots, byte sizes over all layers, the same return
types.  One deliberate difference: SGLang's pools ignore the `device_pool`
argument of their transfers and copy to the buffers they captured at
construction; portable_kv moves the buffers of the pool it is given
(docs/API.md's contract), checked once per pool by the identity of its
tensors.  For SGLang's own device pools the two are the same tensors, and a
relocated device pool is followed instead of written behind its back.
"""

from __future__ import annotations

from typing import Any

import torch

from .allocator import PageRunAllocator


class SGLangSurface:
    dcp_size = 1
    dcp_rank = 0
    # SGLang renames every storage key after a pool's tag; none keeps pages
    # shared with SGLang's own pools in an L3 tier.
    storage_format_tag: str | None = None
    # The host pool's memory is host memory; SGLang's `device` names where the
    # host buffers live, not the GPU they are copied to.
    device = "cpu"
    # First model layer this pool holds (pipeline stages hold a slice).
    start_layer = 0

    def _init_allocator(self) -> None:
        self._slots = PageRunAllocator(self.size, self.page_size)

    # -- slots --------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free token slots (a multiple of page_size) as a CPU int64 tensor, or None if full.

        Whole pages, in runs of consecutive pages where the free space allows.
        """
        self._check_open()
        return self._slots.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Release token slots; returns how many.  A slot that is not allocated raises ValueError."""
        self._check_open()
        return self._slots.free(indices)

    def available_size(self) -> int:
        """Token slots `alloc` can hand out now."""
        self._check_open()
        return self._slots.available_size()

    def clear(self) -> None:
        """Every slot free again (the data stays; slots are bookkeeping)."""
        self._check_open()
        self._slots.clear()

    # -- sizes --------------------------------------------------------------------------

    @property
    def end_layer(self) -> int:
        """One past the last model layer this pool holds (SGLangHostPool stores SGLang's value instead)."""
        return self.start_layer + self.layer_num

    @property
    def logical_size(self) -> int:
        """Slots the radix tree sees; without decode context parallelism, `size`."""
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size

    def get_ksize_per_token(self) -> int:
        """Bytes of K per token over all layers (MLA: of the latent, the whole row, as SGLang's pool says)."""
        heads, dim = self._geometry.shapes[0]
        return self.layer_num * heads * dim * self.dtype.itemsize

    def get_size_per_token(self) -> int:
        """Bytes of every buffer per token over all layers."""
        return self.layer_num * self._geometry.token_elements * self.dtype.itemsize

    @property
    def size_per_token(self) -> int:
        return self.get_size_per_token()

    # -- physical transfer entry points --------------------------------------------------

    def prepare_transfer_indices(self, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's own copies of one submission's indices (slots here are physical).

        SGLang's transfer engine calls this once per submission and passes what it
        returns to every call of that submission; SGLang's contract is that they stay
        unchanged through it.  As the pool's copies they are: the calls that follow
        validate them once and then find them by identity, with no comparison of
        values and in inference mode too (validation.py)."""
        return self._validator.stable_copies(host_indices, device_indices)

    def backup_from_device_all_layer_physical(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        """`backup_from_device_all_layer`, under the name SGLang's transfer engine calls."""
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer_physical(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str | None = None,
        is_draft: bool = False,
    ) -> None:
        """`load_to_device_per_layer`, under the name SGLang's transfer engine calls."""
        self.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)

    def destroy(self) -> None:
        """SGLang's name for `close()`: releases the host memory; idempotent."""
        self.close()


class MLASurface:
    """SGLang's MLATokenToKVPoolHost's geometry of a latent row, beyond the common surface.

    It relies on the pool's `kv_cache_dim`, `dtype` and `layer_num`."""

    @property
    def token_stride_size(self) -> int:
        """Bytes of one token's latent row in one layer."""
        return self.kv_cache_dim * self.dtype.itemsize

    @property
    def layout_dim(self) -> int:
        """Bytes of one token's latent rows over all layers."""
        return self.token_stride_size * self.layer_num
