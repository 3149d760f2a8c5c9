"""Byte-level helpers for tests, examples and `portable-kv check`: random bit patterns in,
bytes compared out (some random patterns are NaN, so never compare floats)."""

from __future__ import annotations

import torch


def randomize(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included): results are compared as bytes, never as floats."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=generator)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of the bytes of a tensor, on the CPU: a snapshot that later writes to `t` leave alone
    (`.cpu()` of a CPU tensor would be `t` itself)."""
    return t.contiguous().view(torch.uint8).to("cpu", copy=True)


def page_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """All token slots of the given pages, page after page."""
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
