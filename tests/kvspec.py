"""Test-side statement of the contract (docs/API.md), written independently of the package's layout code.

The byte helpers (bits, randomize, page_tokens) are portable_kv.testing's, re-exported here.
"""

from __future__ import annotations

import pytest
import torch

import portable_kv as pk
from portable_kv.testing import bits, page_tokens, randomize

DTYPES = [torch.float16, torch.bfloat16] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
TOKEN_LAYOUTS = ("layer_first", "page_first")
# Pool kinds and their buffers, on the device pool and the host pool alike: MHA's K and V,
# MLA's one latent buffer (one head), which SGLang's MLA pool keeps in every layout but page_head.
BUFFERS = {"MHA": ("k_buffer", "v_buffer"), "MLA": ("kv_buffer",)}
KIND_LAYOUTS = {"MHA": LAYOUTS, "MLA": ("layer_first", "page_first", "page_first_direct")}
LATENT_DIM = 40  # a small kv_lora_rank + qk_rope_head_dim: 32 + 8


def pool_layouts(layouts=LAYOUTS, kinds=tuple(BUFFERS)) -> list:
    """(kind, layout) parameters: every kind with each of `layouts` it has."""
    return [pytest.param(kind, layout, id=f"{kind}-{layout}") for kind in kinds for layout in layouts if layout in KIND_LAYOUTS[kind]]


def pool_layout_pairs(layouts=LAYOUTS, kinds=tuple(BUFFERS)) -> list:
    """The same as one (kind, layout) value each, for a fixture's params."""
    return [pytest.param(p.values, id=p.id) for p in pool_layouts(layouts, kinds)]


def kind_of(pool) -> str:
    return "MHA" if hasattr(pool, "k_buffer") else "MLA"


def device_pool(kind: str, layers: int, tokens: int, page_size: int, dtype: torch.dtype = torch.bfloat16, *,
                k_heads: int = 2, k_dim: int = 24, v_heads: int = 2, v_dim: int = 16, latent_dim: int = LATENT_DIM, device=None):
    """A device pool of `kind`: K (k_heads x k_dim) and V (v_heads x v_dim), or the latent (1 x latent_dim)."""
    if kind == "MLA":
        return pk.MLADevicePool(layers, tokens, page_size, latent_dim, dtype, device)
    return pk.DeviceKVPool(layers, tokens, page_size, k_heads, k_dim, v_dim, v_heads=v_heads, dtype=dtype, device=device)


def host_pool(dev, **kwargs):
    """The host pool of `dev`'s kind."""
    return (pk.MLAHostPool if kind_of(dev) == "MLA" else pk.AsymmetricHostPool)(dev, **kwargs)


def sglang_host_pool(dev, **kwargs):
    """The host pool of `dev`'s kind with SGLang's surface mixed in, as portable_kv's SGLang
    pools have it (engines/sglang/surface.py), without SGLang's constructor arguments."""
    from portable_kv.engines.sglang.surface import with_sglang_names

    return with_sglang_names(pk.MLAHostPool if kind_of(dev) == "MLA" else pk.AsymmetricHostPool)(dev, **kwargs)


def device_buffers(dev) -> list[list[torch.Tensor]]:
    """Each buffer's per-layer tensors: [K's, V's], or [the latent's]."""
    return [list(getattr(dev, name)) for name in BUFFERS[kind_of(dev)]]


def host_buffers(host) -> list[torch.Tensor]:
    return [getattr(host, name) for name in BUFFERS[kind_of(host)]]


def every_tensor(dev, host=None) -> list[torch.Tensor]:
    """Every per-layer device tensor, then every host buffer."""
    return [t for layers in device_buffers(dev) for t in layers] + (host_buffers(host) if host is not None else [])


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
    return [bits(t) for t in every_tensor(dev, host)]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for a, b in zip(before, after):
        assert torch.equal(a, b), "a rejected call changed a pool"


__all__ = ["BUFFERS", "DTYPES", "KIND_LAYOUTS", "LATENT_DIM", "LAYOUTS", "TOKEN_LAYOUTS", "assert_same", "bits", "device_buffers",
           "device_pool", "every_tensor", "host_buffers", "host_pool", "host_row", "kind_of", "page_tokens", "pool_layout_pairs", "pool_layouts",
           "randomize", "snapshot"]
