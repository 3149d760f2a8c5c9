"""A transfer, and its plan for copy engines: indices -> (dst, src, bytes) chunks.

The kernel io backends compute the same offsets inside the kernel from the
indices and the strides; this module builds them on the host, vectorised,
for the DMA path (one batched memcpy call) and for the CPU backend's `direct`.
Like the kernels, the plan leaves out a token whose index is outside either
pool (an engine that skips validation must not get a wild copy) and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .layout import Chunking, HostStrides, chunking, host_strides


@dataclass(frozen=True)
class TensorPair:
    """One of K or V on both sides of a transfer."""

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


class IndexPair:
    """Validated host/device token indices, as contiguous int64, with their copies on
    other devices cached.

    Engines pass the same index tensors to every per-layer call, so a copy made
    for one layer serves the other layers.  Kernels read the copies by address:
    each one is contiguous int64 whatever view (strided, stride 0, offset) it came from.
    """

    def __init__(self, host: torch.Tensor, device: torch.Tensor) -> None:
        # As given: copies are made where and when a mover asks, so GPU-resident indices
        # are read on the host only by the paths that plan on the host (never by kernel io).
        self._given = (host, device)
        self._by_device: dict = {}
        self.tokens = int(host.numel())
        self._runs: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._inside: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, bool]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices on `device`; on a GPU, made on and kept for the current stream: a
        kernel on another stream has no order after that stream's copy, so it gets its own."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        key = device if device.type == "cpu" else (device, raw_stream(device.index))
        pair = self._by_device.get(key)
        if pair is None:
            # To the CPU: GPU-resident indices may still be being written by the current
            # stream, and a blocking copy waits for it (a non-blocking copy read at once could
            # see the values before they exist).  To a GPU: stream-ordered, a kernel launched
            # after reads the copy.
            pair = tuple(_dense(_copy_to(t, device)) for t in self._given)
            self._by_device[key] = pair
        return pair

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        host, dev = self.on(torch.device("cpu"))
        return host.numpy(), dev.numpy()

    def inside(self, host_tokens: int, device_tokens: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The indices of the tokens inside both pools, and whether any token was left out.

        The copy kernels check every index against both pools; the host-side
        movers (the DMA plan, the CPU oracle) keep the same guarantee with this."""
        key = (host_tokens, device_tokens)
        cached = self._inside.get(key)
        if cached is None:
            host, dev = self.numpy()
            ok = (host >= 0) & (host < host_tokens) & (dev >= 0) & (dev < device_tokens)
            cached = (host, dev, False) if ok.all() else (host[ok], dev[ok], True)
            self._inside[key] = cached
        return cached


def raw_stream(index: int) -> int:
    """The handle of GPU `index`'s current torch stream (torch.cuda serves ROCm too)."""
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # ~0.3 us where the public call takes a few
    raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def _copy_to(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return indices.to(device)
    if indices.device.type == "cpu" and not indices.is_pinned():
        # From pageable memory the driver first waits for the stream's earlier work on the
        # host (CUDA's and HIP's rule for async copies to the device): an engine's load stream
        # waiting for its model stream would hold the caller until the model got there.
        indices = indices.pin_memory()
    return indices.to(device, non_blocking=True)


def _dense(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(torch.int64).contiguous()


class Transfer(NamedTuple):
    """One validated call: which tokens, which layers, which way, K and V.

    A named tuple, not a dataclass: one is built per call, and a frozen
    dataclass costs a microsecond more to build (host CPU time per call)."""

    to_device: bool
    pairs: tuple[TensorPair, TensorPair]  # K, V
    indices: IndexPair
    layers: range
    page_size: int
    # Backups of this host pool issued before this call, on any stream and io path: a
    # staged load whose count has not moved since its last wait for the current stream
    # need not wait for that stream again (StagedMover._load).
    host_writes: int = 0

    @property
    def tokens(self) -> int:
        return self.indices.tokens

    @property
    def bytes(self) -> int:
        return sum(self.tokens * len(self.layers) * p.device_token_bytes for p in self.pairs)


@dataclass(frozen=True)
class CopyBatch:
    """Chunks for a copy engine: parallel arrays of byte addresses and sizes."""

    dst: np.ndarray  # uint64
    src: np.ndarray  # uint64
    sizes: np.ndarray  # uint64
    skipped: bool = False  # tokens were left out: an index was outside a pool

    def __len__(self) -> int:
        return int(self.sizes.size)

    def slice(self, begin: int, end: int) -> CopyBatch:
        return CopyBatch(self.dst[begin:end], self.src[begin:end], self.sizes[begin:end])


def token_runs(host_idx: np.ndarray, dev_idx: np.ndarray, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs that are consecutive, and contiguous, on both sides."""
    n = host_idx.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    s, c = pair.strides, pair.chunks
    mergeable = c.groups == 1 and s.token == c.chunk_bytes and pair.device_token_bytes == c.chunk_bytes
    if not mergeable:
        return np.arange(n, dtype=np.int64), np.ones(n, np.int64)
    follows = (np.diff(host_idx) == 1) & (np.diff(dev_idx) == 1)
    if s.page != page_size * s.token:  # pages are not adjacent on the host: a run ends with its page
        follows &= host_idx[1:] % page_size != 0
    if pair.registration_tokens:  # a DMA copy must not span two host registrations
        follows &= host_idx[1:] % pair.registration_tokens != 0
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return starts, np.diff(np.append(starts, n))


def run_offsets(indices: IndexPair, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Host offsets, device offsets and byte sizes of the merged runs, before the layer and
    head-group terms, and whether tokens outside a pool were left out; kept with the
    indices, which an engine passes to every layer."""
    device_tokens = int(pair.device[0].shape[0])
    key = (pair.strides, pair.chunks, page_size, pair.registration_tokens, device_tokens)
    cached = indices._runs.get(key)
    if cached is None:
        host_idx, dev_idx, skipped = indices.inside(pair.strides.tokens, device_tokens)
        s = pair.strides
        starts, lengths = token_runs(host_idx, dev_idx, pair, page_size)
        h, d = host_idx[starts], dev_idx[starts]
        cached = ((h // page_size) * s.page + (h % page_size) * s.token, d * pair.device_token_bytes, lengths * pair.chunks.chunk_bytes, skipped)
        indices._runs[key] = cached
    return cached


def copy_batch(transfer: Transfer) -> CopyBatch:
    """All chunks of a transfer, K then V, each run merged, as one batch."""
    layers = np.asarray(transfer.layers, dtype=np.int64)
    dst, src, sizes = [], [], []
    skipped = False
    for pair in transfer.pairs:
        s, c = pair.strides, pair.chunks
        host_off, dev_off, size, left_out = run_offsets(transfer.indices, pair, transfer.page_size)
        skipped |= left_out
        groups = np.arange(c.groups, dtype=np.int64)
        layer_base = np.array([pair.device[int(l)].data_ptr() for l in layers], dtype=np.int64)
        # Broadcast to (layer, group, run).
        host_addr = (pair.host.data_ptr() + layers * s.layer)[:, None, None] + (groups * c.host_group)[None, :, None] + host_off[None, None, :]
        dev_addr = layer_base[:, None, None] + (groups * c.device_group)[None, :, None] + dev_off[None, None, :]
        to, frm = (dev_addr, host_addr) if transfer.to_device else (host_addr, dev_addr)
        dst.append(to.ravel())
        src.append(frm.ravel())
        sizes.append(np.broadcast_to(size, host_addr.shape).ravel())
    return CopyBatch(
        np.concatenate(dst).view(np.uint64),
        np.concatenate(src).view(np.uint64),
        np.concatenate(sizes).view(np.uint64),
        skipped,
    )
