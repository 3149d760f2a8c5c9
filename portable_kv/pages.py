"""Page access for storage tiers (L3): flat pages, views, zero-copy page addresses.

A mixin of the host pools.  It relies on the pool's `buffers` (K and V, or
MLA's latent), `layout`, `page_size`, `size`, `page_num`, `layer_num`, `dtype`,
`_geometry` and `_check_open()`.

Byte order and addresses are SGLang 0.5.23's host pools' (`pool_host/mha.py`,
`pool_host/mla.py`), layout by layout, so a page that either side put in a
shared L3 tier reads back correctly in the other: a flat page is each buffer's
block in turn (K then V; MLA's one latent block), each in the layout's own
memory order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device_pool import DeviceGeometry, positive_int
from .layout import host_strides

# Layouts whose page (all layers) is one contiguous block per K and V.
PAGE_MAJOR_LAYOUTS = ("page_first", "page_first_direct", "page_head")


def _check_has_data(name: str, tensor: torch.Tensor) -> None:
    """Refuse, naming the argument, a tensor whose elements cannot be read as a dense block."""
    if tensor.is_meta:
        raise TypeError(f"{name}: expected a tensor with data on the CPU or a GPU, got one on the meta device (shapes only)")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {tensor.layout}; pass tensor.to_dense()")


class PageAccess:
    # What the mixin reads of its host pool (pool.py sets them), declared for type checkers.
    size: int
    page_size: int
    page_num: int
    layer_num: int
    layout: str
    dtype: torch.dtype
    _geometry: DeviceGeometry

    if TYPE_CHECKING:
        @property
        def buffers(self) -> tuple[torch.Tensor, ...]: ...

        def _check_open(self) -> None: ...

    def _page(self, name: str, index: int | torch.Tensor | np.integer) -> int:
        """The page whose first token is `index`."""
        if isinstance(index, torch.Tensor):
            if index.dim() != 0 or index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
                raise TypeError(f"{name}: expected an integer token index, got a tensor of shape {tuple(index.shape)} and dtype {index.dtype}")
            _check_has_data(name, index)
            index = int(index.item())
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{name}: expected an integer token index, got {type(index).__name__}")
        if not 0 <= index < self.size or index % self.page_size:
            raise ValueError(f"{name}: expected the first token of a page (a multiple of {self.page_size} in [0, {self.size})), got {index}")
        return int(index) // self.page_size

    def _page_views(self, page: int) -> tuple[torch.Tensor, ...]:
        """The page of each buffer as a view, in the layout's own order (SGLang's `get_data_page(flat=False)`)."""
        first = page * self.page_size
        if self.layout == "layer_first":
            return tuple(b[:, first : first + self.page_size] for b in self.buffers)
        if self.layout == "page_first":
            return tuple(b[first : first + self.page_size] for b in self.buffers)
        return tuple(b[page : page + 1] for b in self.buffers)

    def get_data_page(self, index: int | torch.Tensor | np.integer, flat: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The page whose first token is `index`.

        `flat=True`: a copy, one 1-D tensor, each buffer's block in turn in the
        layout's order.  `flat=False`: views into host memory (a storage tier
        reads straight into them), `(k, v)` of an MHA pool and the one latent
        view of an MLA pool, as SGLang's pools return them: `buffer[:, i:i+P]`
        (layer_first), `buffer[i:i+P]` (page_first), `buffer[p:p+1]`
        (page_first_direct, page_head).
        """
        self._check_open()
        views = self._page_views(self._page("index", index))
        if not flat:
            return views if len(views) > 1 else views[0]
        return torch.cat([view.reshape(-1) for view in views])

    def set_from_flat_data_page(self, index: int | torch.Tensor | np.integer, data_page: torch.Tensor) -> None:
        """Write a flat page (as `get_data_page(index)` returns it) to the page whose first token is `index`."""
        self._check_open()
        page = self._page("index", index)
        expected = self.flat_page_numel
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page: expected a torch.Tensor, got {type(data_page).__name__}")
        _check_has_data("data_page", data_page)
        if data_page.dtype != self.dtype:
            raise TypeError(f"data_page: expected dtype {self.dtype}, got {data_page.dtype}")
        if data_page.dim() != 1 or data_page.numel() != expected:
            raise ValueError(f"data_page: expected a 1-D tensor of {expected} elements, got shape {tuple(data_page.shape)}")
        # No autograd history: a page that requires grad must not make the pool part of its
        # graph (the pool would keep the caller's page alive, and every page read require grad).
        data_page = data_page.detach().cpu()
        start = 0
        for view in self._page_views(page):
            view.copy_(data_page[start : start + view.numel()].view(view.shape))
            start += view.numel()

    @property
    def flat_page_numel(self) -> int:
        """Elements of one flat page (every buffer, all layers)."""
        return self.layer_num * self.page_size * self._geometry.token_elements

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """Zeros of one flat page's size and dtype: a buffer a storage tier reads a page into."""
        self._check_open()
        return torch.zeros(self.flat_page_numel, dtype=self.dtype)

    # -- zero-copy addresses -------------------------------------------------------------

    def _first_pages(self, indices: torch.Tensor | Sequence[int]) -> list[int]:
        """Pages of SGLang's storage-call indices: every token of each page, whole pages, in order."""
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
                raise TypeError(f"indices: expected a 1-D integer tensor or a list of ints, got shape {tuple(indices.shape)} and dtype {indices.dtype}")
            _check_has_data("indices", indices)
            tokens = indices.cpu().numpy().astype(np.int64)
        else:
            if indices is None or isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
                raise TypeError(f"indices: expected a 1-D integer tensor or a list of ints, got {type(indices).__name__}")
            values = list(indices)
            if any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) for i in values):
                raise TypeError("indices: expected a 1-D integer tensor or a list of ints")
            tokens = np.asarray(values, dtype=np.int64)
        p = self.page_size
        if tokens.size % p:
            raise ValueError(f"indices: expected every token of whole pages (a length that is a multiple of {p}), got {tokens.size}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.size):
            raise ValueError(f"indices: expected token slots in [0, {self.size}), got {int(tokens.min())}..{int(tokens.max())}")
        runs = tokens.reshape(-1, p)
        whole = (runs[:, 0] % p == 0) & (runs == runs[:, :1] + np.arange(p)).all(axis=1)
        if not whole.all():
            bad = int(np.argmin(whole))
            raise ValueError(f"indices: expected each run of {p} to be one whole page (first a multiple of {p}, then consecutive); run {bad} starts {runs[bad, :4].tolist()}")
        return (runs[:, 0] // p).tolist()

    def get_page_buffer_meta(self, indices: torch.Tensor | Sequence[int]) -> tuple[list[int], list[int]]:
        """Byte addresses and sizes of whole pages, for a storage tier that copies them in place.

        `indices` are all token slots of the pages (a 1-D integer tensor on any
        device, or a list of ints), as SGLang's storage backends pass them.
        page_first, page_first_direct, page_head: for each page its contiguous
        block of each buffer, ``[k0, v0, k1, v1, ...]`` (MLA: ``[kv0, kv1,
        ...]``).  layer_first: for each page and each layer ``[k, v]`` (MLA:
        ``[kv]``), one layer's page each.
        """
        self._check_open()
        pages = self._first_pages(indices)
        buffers = [(b.data_ptr(), host_strides(b, self.layout, self.page_size)) for b in self.buffers]
        # A page-major layout's page stride is its page's size; in layer_first it
        # is one layer's page (layers are `layer` bytes apart).
        layers = [0] if self.layout in PAGE_MAJOR_LAYOUTS else range(self.layer_num)
        ptrs, sizes = [], []
        for page in pages:
            for layer in layers:
                ptrs += [base + page * s.page + layer * s.layer for base, s in buffers]
                sizes += [s.page for _, s in buffers]
        return ptrs, sizes

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor | Sequence[int], split_factor: int) -> tuple[list[int], list[int]]:
        """page_head only: each page's K and V cut into `split_factor` head groups, ``[k, v]`` per group.

        For a storage tier shared by ranks of another tensor-parallel width
        (each of their pages holds a share of these heads).
        """
        self._check_open()
        if self.layout != "page_head":
            raise ValueError(f"get_split_heads_page_buffer_meta: needs layout 'page_head' (heads outermost in a page), this pool is {self.layout!r}")
        heads = [heads for heads, _ in self._geometry.shapes]
        if isinstance(split_factor, bool) or not isinstance(split_factor, (int, np.integer)) or split_factor <= 0 \
                or any(h % split_factor for h in heads):
            counts = ", ".join(f"{label} {h}" for label, h in zip(self._geometry.kind.labels, heads))
            raise ValueError(f"split_factor: expected a positive divisor of the head counts ({counts}), got {split_factor!r}")
        split_factor = int(split_factor)
        pages = self._first_pages(indices)
        buffers = [(b.data_ptr(), host_strides(b, self.layout, self.page_size), h // split_factor) for b, h in zip(self.buffers, heads)]
        ptrs, sizes = [], []
        for page in pages:
            for group in range(split_factor):
                ptrs += [base + page * s.page + group * per_group * s.head for base, s, per_group in buffers]
                sizes += [s.page // split_factor for _, s, _ in buffers]
        return ptrs, sizes

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int:
        """Bytes of the first element `get_page_buffer_meta` (or the split variant) gives for a page: its first buffer's block."""
        first_page = list(range(self.page_size))
        meta = self.get_page_buffer_meta(first_page) if split_factor == 1 else self.get_split_heads_page_buffer_meta(first_page, split_factor)
        return meta[1][0]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """Whether every page of every buffer starts on a `page_size_bytes` boundary (O_DIRECT file I/O needs it).

        False for layer_first, whose page is not one block.
        """
        self._check_open()
        page_size_bytes = positive_int("page_size_bytes", page_size_bytes)
        if self.layout not in PAGE_MAJOR_LAYOUTS:
            return False
        return all(
            buffer.data_ptr() % page_size_bytes == 0 and host_strides(buffer, self.layout, self.page_size).page % page_size_bytes == 0
            for buffer in self.buffers
        )

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """The host tensors a storage tier registers for zero-copy I/O: ``[k_buffer, v_buffer]`` (MLA: ``[kv_buffer]``)."""
        self._check_open()
        return list(self.buffers)
