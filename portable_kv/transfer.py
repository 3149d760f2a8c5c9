"""One transfer: which tokens, which layers, which way, and each buffer (K and V, or MLA's
latent) on both sides: one tensor pair per buffer, each a strided gather.

A plan builds one per direction and layer span, after every check (plan.py), and hands
it to the mover of its io path (portable_kv/io/), which turns it into a launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .indices import IndexPair
from .layout import Chunking, HostStrides, chunking, host_strides


@dataclass(frozen=True)
class TensorPair:
    """One buffer (K, V or MLA's latent) on both sides of a transfer."""

    host: torch.Tensor  # the host pool buffer, in its layout
    layout: str
    device: Sequence[torch.Tensor]  # per-layer device buffers, (tokens, heads, dim)
    strides: HostStrides
    chunks: Chunking
    registration_tokens: int = 0  # host memory registered in pieces of this many tokens; no copy may span two
    # The per-layer device buffers' addresses, resident on the device, where the copy kernels
    # read them (GPU backends); made once per device pool a host pool is bound to.
    layer_table: LayerTable | None = None

    @property
    def device_token_bytes(self) -> int:
        return self.strides.row_bytes * self.strides.heads


class LayerTable:
    """Per-layer base addresses of an engine's device buffers, resident on the device."""

    def __init__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        addresses = [t.data_ptr() for t in buffers]
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.alignment = math.gcd(*addresses)


def tensor_pair(host: torch.Tensor, device: Sequence[torch.Tensor], layout: str, page_size: int, registration_tokens: int = 0,
                table_device: torch.device | None = None) -> TensorPair:
    strides = host_strides(host, layout, page_size)
    table = LayerTable(device, table_device) if table_device is not None else None
    return TensorPair(host, layout, device, strides, chunking(strides), registration_tokens, table)


class BadIndexFlag:
    """Set when a launch skips a token whose index is outside its pool: one per host pool.

    It lives in page-locked, mapped host memory on a GPU, so a kernel sets it and
    the host reads it without synchronising; the next call turns it into an error.
    """

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
        self.word = self.tensor.numpy()  # nonzero once raised: a call reads it without a call of its own

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def set(self) -> None:
        self.word[0] = 1

    def check(self) -> None:
        if self.word[0]:
            self.word[0] = 0
            raise RuntimeError(
                "portable_kv: an earlier transfer met token indices outside the pools and skipped them "
                "(nothing outside the pools was written); validate indices, or keep validate=True"
            )


class Transfer(NamedTuple):
    """One validated transfer of a plan, as a mover builds its launch from it."""

    to_device: bool
    pairs: tuple[TensorPair, ...]  # K, V; or the latent
    indices: IndexPair
    layers: range  # the span it was built for; a call moves as many layers from its own start
    page_size: int
    flag: BadIndexFlag  # raised where a launch skips a token outside a pool
    background: bool = False  # off the caller's critical path: auto prefers the copy engines

    @property
    def tokens(self) -> int:
        return self.indices.tokens

    @property
    def bytes(self) -> int:
        return sum(self.tokens * len(self.layers) * p.device_token_bytes for p in self.pairs)
