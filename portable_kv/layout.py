"""Host layouts as shapes and strides.

Every layout is a permutation of one canonical 5-D view,
``(page, token_in_page, layer, head, dim)``.  The byte offset of a (token,
layer, head) row on either side of a transfer is therefore

    off = (t // P) * s_page + (t % P) * s_tok + l * s_layer + h * s_head

with the strides read off the canonical view.  The CPU oracle indexes the
canonical view with torch; the copy kernels and the DMA planner use its
strides.  Nothing else in the package knows what a layout looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# Layouts in which each run of page_size indices must be one whole page:
# their page is the unit they are built around (and what L3 tiers store).
PAGE_LAYOUTS = ("page_first_direct", "page_head")


def check_layout(layout: str, layouts: tuple[str, ...] = LAYOUTS) -> str:
    if layout not in layouts:
        raise ValueError(f"layout: expected one of {', '.join(layouts)}, got {layout!r}")
    return layout


def host_shape(layout: str, layers: int, pages: int, page_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one host buffer (K or V) as docs/API.md's table gives it."""
    tokens = pages * page_size
    return {
        "layer_first": (layers, tokens, heads, head_dim),
        "page_first": (tokens, layers, heads, head_dim),
        "page_first_direct": (pages, layers, page_size, heads, head_dim),
        "page_head": (pages, heads, page_size, layers, head_dim),
    }[check_layout(layout)]


def canonical_view(buffer: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """A view of a host buffer as (page, token_in_page, layer, head, dim), sharing its memory."""
    check_layout(layout)
    if layout == "layer_first":
        layers, tokens, heads, dim = buffer.shape
        return buffer.view(layers, tokens // page_size, page_size, heads, dim).permute(1, 2, 0, 3, 4)
    if layout == "page_first":
        tokens, layers, heads, dim = buffer.shape
        return buffer.view(tokens // page_size, page_size, layers, heads, dim)
    if layout == "page_first_direct":
        return buffer.permute(0, 2, 1, 3, 4)
    return buffer.permute(0, 2, 3, 1, 4)  # page_head


@dataclass(frozen=True)
class HostStrides:
    """Byte strides of one host buffer, and the largest unit it keeps contiguous."""

    page: int
    token: int
    layer: int
    head: int
    row_bytes: int  # one head's row: head_dim * itemsize
    heads: int
    tokens: int  # token slots in the pool

    @property
    def heads_contiguous(self) -> bool:
        return self.heads == 1 or self.head == self.row_bytes


def host_strides(buffer: torch.Tensor, layout: str, page_size: int) -> HostStrides:
    view = canonical_view(buffer, layout, page_size)
    item = buffer.element_size()
    s_page, s_tok, s_layer, s_head, s_dim = (s * item for s in view.stride())
    assert s_dim == item, "a head's row is contiguous in every layout"
    return HostStrides(s_page, s_tok, s_layer, s_head, view.shape[4] * item, view.shape[3], view.shape[0] * view.shape[1])


@dataclass(frozen=True)
class Chunking:
    """How one transfer of one tensor (K or V) splits into contiguous chunks.

    A chunk is one (token, layer, head group) and is contiguous on both
    sides.  Device rows are always (token, head, dim) contiguous, so the host
    layout alone decides: all heads of a token in one chunk, or one head each.
    """

    chunk_bytes: int
    groups: int  # head groups per token
    host_group: int  # byte stride between head groups on the host
    device_group: int  # ... and on the device


def chunking(strides: HostStrides) -> Chunking:
    if strides.heads_contiguous:
        return Chunking(strides.row_bytes * strides.heads, 1, 0, 0)
    return Chunking(strides.row_bytes, strides.heads, strides.head, strides.row_bytes)
