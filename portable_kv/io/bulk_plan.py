"""The `bulk` io path's plan: a transfer's copies cut into pieces and packed into stages.

The direct path's copies of one layer (runs consecutive on both sides, merged:
direct.layer_copies) are cut into pieces of at most `piece_limit` bytes, and the
pieces into stages of one shared-memory buffer each.  A kernel block moves a
stage with one barrier: every piece of it is fetched into the buffer at once
(bulk copies on sm_90), then stored out.  The plan does not depend on the
layer, so one plan serves every per-layer call of an engine's load, and the
kernel adds the layer's terms (kv_bulk.h).  Everything is vectorised: a plan
of a 1,356-page load is built in milliseconds, once per index pair.

Stages are packed by where each piece ends: piece k goes to stage
floor((end_k - 1) / piece_limit), so a stage holds less than two limits of
bytes and its buffer is `2 * piece_limit` bytes.  A greedy packing would fill
buffers better, but is a loop over pieces on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..transfer import Transfer
from .direct import layer_copies

# Bulk copies need 16-byte aligned addresses and sizes (cp.async.bulk); the vector
# walker that stands in elsewhere moves 16-byte vectors for the same reason.
BULK_ALIGN = 16
PIECE_LIMIT = 16 << 10  # bytes of one piece: a stage buffer holds up to two
# Fields of one piece as the kernel reads it (PkvBulkPiece, kv_bulk.h): host offset,
# device offset (both before the layer's terms), bytes, offset in the stage's buffer, job.
PIECE_FIELDS = 5


class BulkPlan(NamedTuple):
    """A transfer's pieces and stages, layer-independent, as the kernel reads them."""

    pieces: np.ndarray  # (n, PIECE_FIELDS) int64, in stage order
    stage_first: np.ndarray  # (stages + 1,) int64: stage s holds pieces [stage_first[s], stage_first[s + 1])
    stage_bytes: np.ndarray  # (stages,) int64: bytes a stage moves, what its barrier waits for
    buffer_bytes: int  # shared memory of one stage buffer
    skipped: bool  # tokens outside a pool were left out (the caller raises the flag)

    @property
    def stages(self) -> int:
        return int(self.stage_bytes.size)


def why_not_bulk(transfer: Transfer) -> str | None:
    """None where the bulk path can carry `transfer`, else why not (the fallback's reason)."""
    for pair in transfer.pairs:
        s, c = pair.strides, pair.chunks
        offsets = (pair.host.data_ptr(), s.page, s.token, s.layer, c.host_group, c.chunk_bytes, pair.device_token_bytes, c.device_group)
        if any(value % BULK_ALIGN for value in offsets):
            return f"rows of {c.chunk_bytes} bytes or strides not {BULK_ALIGN}-byte aligned"
        if any(t.data_ptr() % BULK_ALIGN for t in (pair.device[layer] for layer in transfer.layers)):
            return f"a device layer buffer not {BULK_ALIGN}-byte aligned"
    return None


def bulk_plan(transfer: Transfer, piece_limit: int = PIECE_LIMIT) -> BulkPlan:
    """The plan of `transfer`'s pairs (K then V, or the latent), kept with its indices."""
    key = ("bulk plan", piece_limit, transfer.page_size)
    return transfer.indices.known((transfer.pairs,), key, lambda: _build(transfer, piece_limit))


def _build(transfer: Transfer, piece_limit: int) -> BulkPlan:
    host_parts, device_parts, size_parts, job_parts = [], [], [], []
    skipped = False
    for job, pair in enumerate(transfer.pairs):
        host_rel, dev_rel, size, left_out = layer_copies(transfer.indices, pair, transfer.page_size)
        skipped |= left_out
        host, device, size = cut(host_rel, dev_rel, size, piece_limit)
        host_parts.append(host)
        device_parts.append(device)
        size_parts.append(size)
        job_parts.append(np.full(size.size, job, np.int64))
    size = np.concatenate(size_parts)
    end = np.cumsum(size)
    start = end - size
    stage_of = (end - 1) // piece_limit
    # Compact stage numbers (a piece over one limit leaves a number unused), then each
    # piece's place in its stage's buffer: its start less the stage's first start.
    firsts = np.flatnonzero(np.concatenate(([True], stage_of[1:] != stage_of[:-1]))) if size.size else np.zeros(0, np.int64)
    stage_first = np.append(firsts, size.size).astype(np.int64)
    stage_index = np.repeat(np.arange(firsts.size), np.diff(stage_first))
    smem = start - start[firsts][stage_index] if size.size else start
    pieces = np.stack([np.concatenate(host_parts), np.concatenate(device_parts), size, smem, np.concatenate(job_parts)], axis=1)
    stage_bytes = np.add.reduceat(size, firsts) if size.size else np.zeros(0, np.int64)
    return BulkPlan(np.ascontiguousarray(pieces, dtype=np.int64), stage_first, stage_bytes.astype(np.int64), 2 * piece_limit, skipped)


def cut(host: np.ndarray, device: np.ndarray, size: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies cut into pieces of at most `limit` bytes (the last piece of a copy holds the rest)."""
    counts = -(-size // limit)
    if size.size == 0 or counts.max() <= 1:
        return host, device, size
    copy = np.repeat(np.arange(size.size), counts)
    within = np.arange(copy.size) - np.repeat(np.cumsum(counts) - counts, counts)
    offset = within * limit
    return host[copy] + offset, device[copy] + offset, np.minimum(size[copy] - offset, limit)
