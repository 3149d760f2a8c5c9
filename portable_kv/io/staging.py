"""Staging memory, and a staging schedule made ready for it: the staging slots (Slot),
and what each call reuses of a schedule (StagedCopies): its copies as lists, each
chunk's staging-local indices, each slot's staging views and batched copies.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import torch

from ..indices import IndexPair
from ..layout import chunking
from ..transfer import TensorPair, Transfer, tensor_pair
from .copier import CopyBatch
from .staging_schedule import Copies, StagingRule, StagingSchedule, miniature
from .streams import Streams

_generations = itertools.count(1)


class Slot:
    """One staging buffer and its events: `filled` after its writer, `free` after its reader."""

    def __init__(self, device: torch.device, nbytes: int, streams: Streams) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.address = self.buffer.data_ptr()
        self.filled, self.free = streams.event(), streams.event()
        self.generation = next(_generations)  # the staging views made for this buffer carry it


class StagedCopies:
    """A staging schedule with what each call reuses, kept in its plan's launch."""

    def __init__(self, staged: StagingSchedule, transfer: Transfer) -> None:
        self.schedule = staged
        fields = ("host", "staging", "width", "height", "host_pitch", "staging_pitch")
        self.copies = tuple(tuple(getattr(c, f).tolist() for f in fields) for c in staged.copies)
        self.ends = tuple([0, *c.chunk_ends.tolist()] for c in staged.copies)
        # Staging token j of a chunk is its j-th index: the kernel moves each chunk between
        # staging slots 0, 1, ... and the chunk's device slots.
        first = transfer.pairs[0]
        device = torch.from_numpy(transfer.indices.inside(first.strides.tokens, first.device[0].shape[0])[1])
        self.indices = tuple(IndexPair(torch.arange(len(c), dtype=torch.int64), device[c.start:c.stop]) for c in staged.chunks)
        self._pairs: dict[int, tuple[TensorPair, ...]] = {}
        self._carried: dict[StagingRule, bool] = {}
        self._batched: dict[StagingRule, bool] = {}
        self._rows: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...] | None = None
        self._batches: dict[tuple[int, int, int], CopyBatch] = {}

    def carried_by(self, rule: StagingRule) -> bool:
        """`rule.carries(self.schedule)`, answered once per rule: its numpy reductions would
        otherwise delay each call's first copy."""
        carried = self._carried.get(rule)
        if carried is None:
            carried = self._carried[rule] = rule.carries(self.schedule)
        return carried

    def batched_by(self, rule: StagingRule) -> bool:
        """`rule.batches(self.schedule)`, answered once per rule."""
        batched = self._batched.get(rule)
        if batched is None:
            batched = self._batched[rule] = rule.batches(self.schedule)
        return batched

    def pairs(self, slot: Slot, transfer: Transfer, reads_strides: bool) -> tuple[TensorPair, ...]:
        """Each buffer of `slot` as the copy kernel's "host" side: the staging miniatures.

        A kernel reads strides and a base address: a flat tensor, with the layer stride 0
        where one layer is staged, so that its absolute layer index lands on it.  The CPU
        oracle indexes a layout-shaped tensor of the staged layers only."""
        pairs = self._pairs.get(slot.generation)
        if pairs is None:
            pages, layers = self.schedule.chunk_tokens // transfer.page_size, self.schedule.layers
            made = []
            for pair, strides, offset in zip(transfer.pairs, self.schedule.staging, self.schedule.offsets):
                storage = slot.buffer[offset:]
                if reads_strides:
                    tensor = storage[: self.schedule.chunk_tokens * layers * pair.device_token_bytes].view(pair.host.dtype)
                    made.append(replace(pair, host=tensor, strides=strides, chunks=chunking(strides), registration_tokens=0))
                else:
                    head_dim = strides.row_bytes // pair.host.element_size()
                    tensor = miniature(pair.layout, layers, layers, pages, transfer.page_size, strides.heads, head_dim, pair.host.dtype, storage)
                    made.append(tensor_pair(tensor, pair.device, pair.layout, transfer.page_size))
            pairs = self._pairs[slot.generation] = tuple(made)
        return pairs

    def batch(self, chunk: int, slot: Slot, transfer: Transfer, layer: int) -> CopyBatch:
        """`chunk`'s rows as one batch of 1-D copies between the host pool and `slot`, from
        `layer` on: made once per (chunk, slot, layer), so that a call enqueues them without
        building them."""
        key = (chunk, slot.generation, layer)
        batch = self._batches.get(key)
        if batch is None:
            which, host, staging, sizes = self.rows(chunk)
            host_bases = np.array([p.host.data_ptr() + layer * p.strides.layer for p in transfer.pairs], np.int64)
            staging_bases = np.array([slot.address + offset for offset in self.schedule.offsets], np.int64)
            host, staging = (host + host_bases[which]).astype(np.uint64), (staging + staging_bases[which]).astype(np.uint64)
            sizes = sizes.astype(np.uint64)
            batch = CopyBatch(staging, host, sizes) if transfer.to_device else CopyBatch(host, staging, sizes)
            self._batches[key] = batch
        return batch

    def rows(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows of `chunk`'s 2-D copies as 1-D copies, K's then V's: (the buffer's
        position, host offset without the layer term, offset in the tensor's staging, bytes)."""
        if self._rows is None:
            made = []
            for c in range(len(self.schedule.chunks)):
                parts = [_rows_of(copies, ends[c], ends[c + 1]) for copies, ends in zip(self.schedule.copies, self.ends)]
                made.append((np.repeat(np.arange(len(parts)), [p[0].size for p in parts]),
                             *(np.concatenate([p[n] for p in parts]) for n in range(3))))
            self._rows = tuple(made)
        return self._rows[chunk]


def _rows_of(copies: Copies, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(host offsets, staging offsets, bytes) of every row of copies [begin, end)."""
    heights = copies.height[begin:end]
    which = np.repeat(np.arange(begin, end), heights)
    row = np.arange(which.size) - np.repeat(np.cumsum(heights) - heights, heights)
    return (copies.host[which] + row * copies.host_pitch[which], copies.staging[which] + row * copies.staging_pitch[which],
            copies.width[which])
