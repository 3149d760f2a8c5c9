"""The `direct` io path: the copy engines straight between the pools, no SM.

Its plan turns indices into (dst, src, bytes) copies on the host, vectorised:
runs consecutive on both sides merge into one copy.  The copy kernels compute
the same offsets inside the kernel; here, like there, a token whose index is
outside either pool is left out (an engine that skips validation must not get a
wild copy) and flagged.  A transfer's short copies go out as one batched call per
stream over `dma_streams` side streams, so that several copy engines work at once;
on NVIDIA long ones (`engine.one_call_copy_bytes`) as one batched call on the current
stream, as one copy engine keeps the link busy with them and the other streams'
events and calls only cost the caller.
"""

from __future__ import annotations

import numpy as np

from ..indices import IndexPair
from ..transfer import TensorPair, Transfer
from .engine import CopyBatch, CopyEngine
from .mover import Mover


class DirectMover(Mover):
    """A transfer's copies over the engine's `dma_streams` side streams, ordered after and
    before the current stream (the batched calls also refuse the legacy default stream)."""

    io = "direct"

    def __init__(self, engine: CopyEngine) -> None:
        super().__init__(engine.device)
        self.engine = engine
        self.streams = engine.streams()

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        batch = copy_batch(transfer)
        if batch.skipped:
            self.bad_index.set()
        if not len(batch):
            return
        streams = self.streams
        current = streams.current()
        one_call = self.engine.one_call_copy_bytes
        long_copies = one_call is not None and int(batch.sizes.sum()) >= one_call * len(batch)
        pieces = [batch] if long_copies else split_even(batch, self.engine.dma_streams)
        # The current stream takes a piece where it can; side streams the rest (all of it on
        # the legacy default stream), and only those are ordered around it.
        on_current = streams.handle(current) != 0
        if len(pieces) == 1 and on_current:
            self.engine.memcpy_batch(batch, streams.handle(current))
            return
        side = streams.side(current, len(pieces) - on_current)
        streams.fork(current, side)
        on = ([current] if on_current else []) + list(side)
        for piece, stream in zip(pieces, on):
            self.engine.memcpy_batch(piece, streams.handle(stream))
        streams.join(current, side)

    def close(self) -> None:
        self.streams = self.engine.streams()


def split_even(batch: CopyBatch, parts: int) -> list[CopyBatch]:
    """`parts` pieces of about equal bytes (fewer for a small batch)."""
    if parts <= 1 or len(batch) < 2 * parts:
        return [batch]
    cuts = np.searchsorted(np.cumsum(batch.sizes), [batch.sizes.sum() * i // parts for i in range(1, parts)])
    bounds = [0, *cuts.tolist(), len(batch)]
    return [batch.slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def copy_batch(transfer: Transfer) -> CopyBatch:
    """Every copy of a transfer, K then V, each run merged, as one batch: the copies of one
    layer are kept with the indices, so a call adds its layer's base addresses and no more."""
    dst, src, sizes = [], [], []
    skipped = False
    for pair in transfer.pairs:
        host_rel, dev_rel, size, left_out = layer_copies(transfer.indices, pair, transfer.page_size)
        skipped |= left_out
        host_base = pair.host.data_ptr()
        if len(transfer.layers) == 1:
            layer = transfer.layers[0]
            host_addr = host_rel + (host_base + layer * pair.strides.layer)
            dev_addr = dev_rel + pair.device[layer].data_ptr()
        else:  # broadcast to (layer, copy)
            layers = np.asarray(transfer.layers, dtype=np.int64)
            host_addr = ((host_base + layers * pair.strides.layer)[:, None] + host_rel[None, :]).ravel()
            layer_base = np.array([pair.device[int(l)].data_ptr() for l in layers], dtype=np.int64)
            dev_addr = (layer_base[:, None] + dev_rel[None, :]).ravel()
            size = np.tile(size, len(layers))
        to, frm = (dev_addr, host_addr) if transfer.to_device else (host_addr, dev_addr)
        dst.append(to)
        src.append(frm)
        sizes.append(size)
    return CopyBatch(
        np.concatenate(dst).view(np.uint64),
        np.concatenate(src).view(np.uint64),
        np.concatenate(sizes).view(np.uint64),
        skipped,
    )


def layer_copies(indices: IndexPair, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """One layer's copies of `pair`, in (head group, run) order: host offsets from the host
    buffer's layer, device offsets from the layer's buffer, byte sizes, and whether tokens
    outside a pool were left out; kept with the indices, which an engine passes to every layer."""
    device_tokens = int(pair.device[0].shape[0])

    def build() -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        host_off, dev_off, size, skipped = run_offsets(indices, pair, page_size)
        groups = np.arange(pair.chunks.groups, dtype=np.int64)
        host_rel = ((groups * pair.chunks.host_group)[:, None] + host_off[None, :]).ravel()
        dev_rel = ((groups * pair.chunks.device_group)[:, None] + dev_off[None, :]).ravel()
        return host_rel, dev_rel, np.tile(size, len(groups)), skipped

    return indices.known((), ("direct copies", pair.strides, pair.chunks, page_size, pair.registration_tokens, device_tokens), build)


def run_offsets(indices: IndexPair, pair: TensorPair, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Host offsets, device offsets and byte sizes of the merged runs, before the layer and
    head-group terms, and whether tokens outside a pool were left out; kept with the
    indices, which an engine passes to every layer."""
    device_tokens = int(pair.device[0].shape[0])

    def build() -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        host_idx, dev_idx, skipped = indices.inside(pair.strides.tokens, device_tokens)
        s = pair.strides
        starts, lengths = token_runs(host_idx, dev_idx, pair, page_size)
        h, d = host_idx[starts], dev_idx[starts]
        return (h // page_size) * s.page + (h % page_size) * s.token, d * pair.device_token_bytes, lengths * pair.chunks.chunk_bytes, skipped

    return indices.known((), ("direct", pair.strides, pair.chunks, page_size, pair.registration_tokens, device_tokens), build)


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
