"""Page access for storage tiers (L3): flat pages, views, zero-copy page addresses.

A mixin of AsymmetricHostPool.  It relies on the pool's `k_buffer`, `v_buffer`,
`layout`, `page_size`, `size`, `page_num`, `layer_num`, `dtype`, `_geometry`
(k_heads, k_dim, v_heads, v_dim) and `_check_open()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .layout import PAGE_LAYOUTS, canonical_view


class PageAccess:
    def _page(self, name: str, index: int) -> int:
        if isinstance(index, torch.Tensor) and index.numel() == 1:
            index = int(index.item())
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"{name}: expected an int token index, got {type(index).__name__}")
        if not 0 <= index < self.size or index % self.page_size:
            raise ValueError(f"{name}: expected the first token of a page (a multiple of {self.page_size} in [0, {self.size})), got {index}")
        return int(index) // self.page_size

    def _page_views(self, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (page, token, layer, head, dim) -> the page's (layer, token, head, dim)
        return tuple(canonical_view(b, self.layout, self.page_size)[page].transpose(0, 1) for b in (self.k_buffer, self.v_buffer))

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A copy of the page whose first token is `index`: flat (K then V), or (K, V) as (L, P, H, D)."""
        self._check_open()
        k, v = self._page_views(self._page("index", index))
        if not flat:
            return k.clone(), v.clone()
        return torch.cat((k.reshape(-1), v.reshape(-1)))

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._check_open()
        page = self._page("index", index)
        expected = self.flat_page_numel
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page: expected a torch.Tensor, got {type(data_page).__name__}")
        if data_page.dtype != self.dtype:
            raise TypeError(f"data_page: expected dtype {self.dtype}, got {data_page.dtype}")
        if data_page.dim() != 1 or data_page.numel() != expected:
            raise ValueError(f"data_page: expected a 1-D tensor of {expected} elements, got shape {tuple(data_page.shape)}")
        k, v = self._page_views(page)
        data_page = data_page.cpu()
        k.copy_(data_page[: k.numel()].view(k.shape))
        v.copy_(data_page[k.numel() :].view(v.shape))

    @property
    def flat_page_numel(self) -> int:
        g = self._geometry
        return self.layer_num * self.page_size * (g.k_heads * g.k_dim + g.v_heads * g.v_dim)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.flat_page_numel, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor | Sequence[int]) -> tuple[list[int], list[int]]:
        """Zero-copy page addresses for storage tiers: [k0, v0, k1, v1, ...] pointers and byte sizes."""
        self._check_open()
        if self.layout not in PAGE_LAYOUTS:
            raise ValueError(f"get_page_buffer_meta: defined for layouts {', '.join(PAGE_LAYOUTS)} (a page's K and V blocks contiguous), this pool is {self.layout!r}")
        values = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        pages = [self._page("indices", i) for i in values]
        k_bytes = self.k_buffer[0].numel() * self.k_buffer.element_size()
        v_bytes = self.v_buffer[0].numel() * self.v_buffer.element_size()
        ptrs, sizes = [], []
        for page in pages:
            ptrs += [self.k_buffer.data_ptr() + page * k_bytes, self.v_buffer.data_ptr() + page * v_bytes]
            sizes += [k_bytes, v_bytes]
        return ptrs, sizes

