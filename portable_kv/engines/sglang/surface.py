"""The host-pool surface SGLang 0.5.23's cache controller and storage backends use
(docs/API.md, "The SGLang host-pool surface"): slot allocation, sizes, physical
transfer entry points.  Mixins of SGLang's pools here: `SGLangSurface` of every
portable_kv pool SGLang builds, `HostSlots` and `PhysicalNames` also of the state
and indexer pools, `MLASurface` of the MLA pool.

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

from ...allocator import PageRunAllocator
from ...mla import MLAHostPool


class HostSlots:
    """The slot half of SGLang's host-pool contract (alloc, free, available_size, clear),
    answered by the pool's `PageRunAllocator` (`_slots`).  Placed before the pool's other
    bases, so that these come first in the MRO."""

    _slots: PageRunAllocator

    def _slots_open(self) -> PageRunAllocator:
        if getattr(self, "closed", False):
            raise ValueError("host pool: the pool is closed")
        return self._slots

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots (a multiple of page_size) as a CPU int64 tensor, or None if full.

        Whole pages, in runs of consecutive pages where the free space allows.
        """
        return self._slots_open().alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Release slots; returns how many.  A slot that is not allocated raises ValueError."""
        return self._slots_open().free(indices)

    def available_size(self) -> int:
        """Slots `alloc` can hand out now."""
        return self._slots_open().available_size()

    def clear(self) -> None:
        """Every slot free again (the data stays; slots are bookkeeping)."""
        self._slots_open().clear()


class PhysicalNames:
    """The names SGLang's transfer engine calls, for slots that are physical here."""

    def load_to_device_per_layer_physical(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                          io_backend: str | None = None, is_draft: bool = False) -> None:
        """`load_to_device_per_layer`, under the name SGLang's transfer engine calls."""
        self.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)  # type: ignore[attr-defined]

    def backup_from_device_all_layer_physical(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                              io_backend: str | None = None) -> None:
        """`backup_from_device_all_layer`, under the name SGLang's transfer engine calls."""
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)  # type: ignore[attr-defined]


class SGLangSurface(HostSlots, PhysicalNames):
    """What SGLang reads of a portable_kv host pool beyond the transfers."""

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

    size: int
    page_size: int
    layer_num: int
    dtype: torch.dtype
    _geometry: Any

    def _init_slots(self) -> None:
        self._slots = PageRunAllocator(self.size, self.page_size)

    # -- sizes --------------------------------------------------------------------------

    @property
    def end_layer(self) -> int:
        """One past the last model layer this pool holds (SGLang's pools store SGLang's value instead)."""
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
        return self.token_bytes  # type: ignore[attr-defined]

    @property
    def size_per_token(self) -> int:
        return self.get_size_per_token()

    # -- one submission ------------------------------------------------------------------

    def prepare_transfer_indices(self, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's own copies of one submission's indices (slots here are physical), which
        map to one plan (plan.py).

        SGLang's transfer engine calls this once per submission and passes what it
        returns to every call of that submission; SGLang's contract is that they stay
        unchanged through it.  As the pool's copies they are: the calls that follow find
        the submission's plan by identity, with no comparison of values and in inference
        mode too."""
        plan = self._submission_plan(host_indices, device_indices, self._io(io_backend))  # type: ignore[attr-defined]
        return plan.host_indices, plan.device_indices

    def destroy(self) -> None:
        """SGLang's name for `close()`: releases the host memory; idempotent."""
        self.close()  # type: ignore[attr-defined]


def with_sglang_names(pool_class: type) -> type:
    """`pool_class` (a core host pool) with SGLang's surface mixed in and SGLang's io names
    passed through as they are: what SGLang's pools add to a core pool, without SGLang's
    constructor (the benchmark's and the tests' SGLang-shaped pools)."""
    mixins = (SGLangSurface, MLASurface) if issubclass(pool_class, MLAHostPool) else (SGLangSurface,)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pool_class.__init__(self, *args, **kwargs)
        self._init_slots()

    return type(f"SGLangNamed{pool_class.__name__}", (*mixins, pool_class), {"__init__": __init__, "_io": lambda self, io: io})


class MLASurface:
    """SGLang's MLATokenToKVPoolHost's geometry of a latent row, beyond the common surface.

    It relies on the pool's `kv_cache_dim`, `dtype` and `layer_num`."""

    kv_cache_dim: int
    dtype: torch.dtype
    layer_num: int

    @property
    def token_stride_size(self) -> int:
        """Bytes of one token's latent row in one layer."""
        return self.kv_cache_dim * self.dtype.itemsize

    @property
    def layout_dim(self) -> int:
        """Bytes of one token's latent rows over all layers."""
        return self.token_stride_size * self.layer_num
