"""One transfer: which tokens, which layers, which way, and each buffer (K and V, or
MLA's latent) on both sides: one tensor pair per buffer, each a strided gather.

The host pool builds one per call, after every check (pool.py), and hands it to
the mover of its io path (portable_kv/io/).
"""

from __future__ import annotations

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

    @property
    def device_token_bytes(self) -> int:
        return self.strides.row_bytes * self.strides.heads


def tensor_pair(host: torch.Tensor, device: Sequence[torch.Tensor], layout: str, page_size: int, registration_tokens: int = 0) -> TensorPair:
    strides = host_strides(host, layout, page_size)
    return TensorPair(host, layout, device, strides, chunking(strides), registration_tokens)


class Transfer(NamedTuple):
    """One validated call.

    A named tuple, not a dataclass: one is built per call, and a frozen
    dataclass costs a microsecond more to build (host CPU time per call)."""

    to_device: bool
    pairs: tuple[TensorPair, ...]  # K, V; or the latent
    indices: IndexPair
    layers: range
    page_size: int
    # Backups of this host pool issued before this call, on any stream and io path: a
    # staged load whose count has not moved since its last wait for the current stream
    # need not wait for that stream again (io/staged.py).
    host_writes: int = 0

    @property
    def tokens(self) -> int:
        return self.indices.tokens

    @property
    def bytes(self) -> int:
        return sum(self.tokens * len(self.layers) * p.device_token_bytes for p in self.pairs)
