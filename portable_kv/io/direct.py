"""The `direct` io path: the copy engines straight between the pools, no SM.

Its plan turns indices into (dst, src, bytes) copies on the host, vectorised:
runs consecutive on both sides merge into one copy.  The copy kernels compute
the same offsets inside the kernel; here, like there, a token whose index is
outside either pool is left out (an engine that skips validation must not get a
wild copy) and flagged.  The descriptors of each layer a plan moves are built once
and kept in its launch.  A transfer's short copies go out as one batched call per
stream over `dma_streams` side streams, so that several copy engines work at once;
on NVIDIA long ones (`copier.one_call_copy_bytes`) as one batched call on the current
stream, as one copy engine keeps the link busy with them and the other streams'
events and calls only cost the caller.
"""

from __future__ import annotations

import numpy as np

from ..indices import IndexPair
from ..transfer import TensorPair, Transfer
from .copier import Copier, CopyBatch
from .mover import Launch, Mover


class DirectLaunch(Launch):
    """A transfer's copy descriptors, built once per layer it moves (a per-layer load adds its
    layer's base addresses to the layer-relative copies once), sent to the copy engines."""

    path = "direct"

    def __init__(self, mover: DirectMover, transfer: Transfer) -> None:
        self.mover, self.transfer = mover, transfer
        self.copies = [layer_copies(transfer.indices, pair, transfer.page_size) for pair in transfer.pairs]
        self.skipped = any(c[3] for c in self.copies)
        self._batches: dict[int, tuple[CopyBatch, bool]] = {}  # layer start -> its copies, and whether they go as one call
        self._pieces: dict[int, tuple[int, list[CopyBatch]]] = {}  # layer start -> (dma_streams, the copies split over them)

    def run(self, layers: range, stream: int | None) -> None:
        if self.skipped:
            self.transfer.flag.set()
        planned = self._batches.get(layers.start)
        if planned is None:
            planned = self._batches[layers.start] = self._plan(layers)
        batch, long_copies = planned
        if not len(batch):
            return
        if long_copies:
            self.mover.send(batch, [batch], stream)
            return
        # dma_streams is assignable between calls: the split follows it.
        streams = self.mover.copier.dma_streams
        split = self._pieces.get(layers.start)
        if split is None or split[0] != streams:
            split = self._pieces[layers.start] = (streams, split_even(batch, streams))
        self.mover.send(batch, split[1], stream)

    def _plan(self, layers: range) -> tuple[CopyBatch, bool]:
        batch = copy_batch(self.transfer, self.copies, layers)
        one_call = self.mover.copier.one_call_copy_bytes
        return batch, one_call is not None and int(batch.sizes.sum()) >= one_call * len(batch)


class DirectMover(Mover):
    """A transfer's copies over the copier's `dma_streams` side streams, ordered after and
    before the current stream (the batched calls also refuse the legacy default stream)."""

    io = "direct"

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.streams = copier.streams()

    def build(self, transfer: Transfer) -> Launch:
        return DirectLaunch(self, transfer)

    def send(self, batch: CopyBatch, pieces: list[CopyBatch], current: int | None) -> None:
        streams, copier = self.streams, self.copier
        # The current stream takes a piece where it can; side streams the rest (all of it on
        # the legacy default stream), and only those are ordered around it.
        on_current = streams.handle(current) != 0
        if len(pieces) == 1 and on_current:
            copier.memcpy_batch(batch, streams.handle(current))
            return
        side = streams.side(current, len(pieces) - on_current)
        streams.fork(current, side)
        on = ([current] if on_current else []) + list(side)
        for piece, stream in zip(pieces, on):
            copier.memcpy_batch(piece, streams.handle(stream))
        streams.join(current, side)

    def close(self) -> None:
        self.streams = self.copier.streams()


def split_even(batch: CopyBatch, parts: int) -> list[CopyBatch]:
    """`parts` pieces of about equal bytes (fewer for a small batch)."""
    if parts <= 1 or len(batch) < 2 * parts:
        return [batch]
    cuts = np.searchsorted(np.cumsum(batch.sizes), [batch.sizes.sum() * i // parts for i in range(1, parts)])
    bounds = [0, *cuts.tolist(), len(batch)]
    return [batch.slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def copy_batch(transfer: Transfer, copies: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]], layers: range) -> CopyBatch:
    """Every copy of `layers`, K then V, each run merged, as one batch: the layer-relative
    `copies` (layer_copies) plus each layer's base addresses."""
    dst, src, sizes = [], [], []
    for pair, (host_rel, dev_rel, size, _) in zip(transfer.pairs, copies):
        host_base = pair.host.data_ptr()
        layer_ids = np.asarray(layers, dtype=np.int64)
        host_addr = ((host_base + layer_ids * pair.strides.layer)[:, None] + host_rel[None, :]).ravel()
        layer_base = np.array([pair.device[int(layer)].data_ptr() for layer in layer_ids], dtype=np.int64)
        dev_addr = (layer_base[:, None] + dev_rel[None, :]).ravel()
        size = np.tile(size, len(layer_ids))
        to, frm = (dev_addr, host_addr) if transfer.to_device else (host_addr, dev_addr)
        dst.append(to)
        src.append(frm)
        sizes.append(size)
    return CopyBatch(np.concatenate(dst).view(np.uint64), np.concatenate(src).view(np.uint64), np.concatenate(sizes).view(np.uint64))


def layer_copies(indices: IndexPair, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """One layer's copies of `pair`, in (head group, run) order: host offsets from the host
    buffer's layer, device offsets from the layer's buffer, byte sizes, and whether tokens
    outside a pool were left out."""
    host_off, dev_off, size, skipped = run_offsets(indices, pair, page_size)
    groups = np.arange(pair.chunks.groups, dtype=np.int64)
    host_rel = ((groups * pair.chunks.host_group)[:, None] + host_off[None, :]).ravel()
    dev_rel = ((groups * pair.chunks.device_group)[:, None] + dev_off[None, :]).ravel()
    return host_rel, dev_rel, np.tile(size, len(groups)), skipped


def run_offsets(indices: IndexPair, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Host offsets, device offsets and byte sizes of the merged runs, before the layer and
    head-group terms, and whether tokens outside a pool were left out."""
    host_idx, dev_idx, skipped = indices.inside(pair.strides.tokens, int(pair.device[0].shape[0]))
    s = pair.strides
    starts, lengths = token_runs(host_idx, dev_idx, pair, page_size)
    h, d = host_idx[starts], dev_idx[starts]
    return (h // page_size) * s.page + (h % page_size) * s.token, d * pair.device_token_bytes, lengths * pair.chunks.chunk_bytes, skipped


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
    if pair.registration_tokens:  # a copy must not span two host registrations
        follows &= host_idx[1:] % pair.registration_tokens != 0
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return starts, np.diff(np.append(starts, n))
