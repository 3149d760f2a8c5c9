"""MLAHostPool (docs/API.md): the host tier of an MLA pool (DeepSeek-V3/R1, Kimi-K2).

MLA models keep one latent buffer per layer instead of K and V: the compressed
KV (`kv_lora_rank`) and the rotary key (`qk_rope_head_dim`) of each token, one
"head" of `kv_cache_dim` elements.  The pool is HostPool's machinery with one
buffer: the same checks, movers and pages, one tensor pair per transfer.  Its
shapes, flat pages and page addresses are SGLang 0.5.23's
`MLATokenToKVPoolHost`'s (`pool_host/mla.py`), so pages are shared with
SGLang nodes through an L3 tier.
"""

from __future__ import annotations

from typing import Any

import torch

from .device_pool import MLA, DeviceGeometry, latent_split
from .layout import LAYOUTS
from .pool import HostPool

# page_head orders a page by head; a latent row is one head, and SGLang's MLA pool refuses it.
MLA_LAYOUTS = tuple(layout for layout in LAYOUTS if layout != "page_head")


class MLAHostPool(HostPool):
    """The host tier of an MLA pool: latent pages in page-locked host memory, in one of three layouts.

    `kv_buffer` is one tensor: (L, size, 1, D) layer_first, (size, L, 1, D)
    page_first, (page_num, L, P, 1, D) page_first_direct, D = kv_cache_dim."""

    kind = MLA
    layouts = MLA_LAYOUTS
    kv_buffer: torch.Tensor | None

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        layout: str = "page_first_direct",
        io_backend: str = "direct",
        pin_memory: bool = True,
        validate: bool = True,
        host_memory: str = "pinned",
        numa_node: int | str | None = None,
    ) -> None:
        super().__init__(device_pool, host_to_device_ratio, host_size_gb, layout, io_backend, pin_memory, validate, host_memory, numa_node)

    def _describe_rows(self, device_pool: Any, geometry: DeviceGeometry) -> None:
        self.kv_cache_dim = geometry.shapes[0][1]
        # From the device pool where it says (SGLang's does); else the row is all latent.
        self.kv_lora_rank, self.qk_rope_head_dim = latent_split(
            self.kv_cache_dim, getattr(device_pool, "kv_lora_rank", None), getattr(device_pool, "qk_rope_head_dim", 0))

    def _check_layout(self, layout: str) -> str:
        if layout == "page_head":
            raise ValueError(f"layout: 'page_head' orders a page by head and an MLA pool has one; expected one of {', '.join(MLA_LAYOUTS)}, got 'page_head'")
        return super()._check_layout(layout)
