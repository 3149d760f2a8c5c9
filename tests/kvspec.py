"""Test-side statement of the contract (docs/API.md), written independently of the package's layout code.

The byte helpers (bits, randomize, page_tokens) are portable_kv.testing's, re-exported here.
"""

from __future__ import annotations

import torch

from portable_kv.testing import bits, page_tokens, randomize

DTYPES = [torch.float16, torch.bfloat16] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
TOKEN_LAYOUTS = ("layer_first", "page_first")


def host_row(buffer: torch.Tensor, layout: str, page_size: int, token: int, layer: int) -> torch.Tensor:
    """(heads, head_dim) of one token and layer in a host buffer, straight from docs/API.md's shape table."""
    page, offset = divmod(token, page_size)
    if layout == "layer_first":
        return buffer[layer, token]
    if layout == "page_first":
        return buffer[token, layer]
    if layout == "page_first_direct":
        return buffer[page, layer, offset]
    if layout == "page_head":
        return buffer[page, :, offset, layer]
    raise AssertionError(layout)


def snapshot(dev, host) -> list[torch.Tensor]:
    return [bits(t) for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for a, b in zip(before, after):
        assert torch.equal(a, b), "a rejected call changed a pool"


__all__ = ["DTYPES", "TOKEN_LAYOUTS", "assert_same", "bits", "host_row", "page_tokens", "randomize", "snapshot"]
