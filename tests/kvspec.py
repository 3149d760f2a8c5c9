"""Test-side statement of the contract (API.md), written independently of the package's layout code."""

from __future__ import annotations

import torch

DTYPES = [torch.float16, torch.bfloat16] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
TOKEN_LAYOUTS = ("layer_first", "page_first")


def host_row(buffer: torch.Tensor, layout: str, page_size: int, token: int, layer: int) -> torch.Tensor:
    """(heads, head_dim) of one token and layer in a host buffer, straight from API.md's shape table."""
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


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor: roundtrips compare bit patterns, never floats (random bf16 holds NaNs)."""
    return t.contiguous().view(torch.uint8).cpu()


def randomize(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    return t


def page_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def snapshot(dev, host) -> list[torch.Tensor]:
    return [bits(t) for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for a, b in zip(before, after):
        assert torch.equal(a, b), "a rejected call changed a pool"
