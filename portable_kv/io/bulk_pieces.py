"""The `bulk` io path's piece list: a transfer's copies laid end to end and cut into stages.

The direct path's copies of one layer (runs consecutive on both sides, merged:
direct.layer_copies), K's then V's, are laid end to end in one stream of bytes,
and the stream is cut into stages of `stage_bytes`, each one shared-memory buffer
full: a copy that crosses a stage boundary becomes two pieces.  A kernel block
moves a stage with one barrier: every piece of it is fetched into the buffer at
once (bulk copies on sm_90), then stored out.  Every stage but the last is full,
so a block's buffers hold as many bytes in flight as they can.  The piece list does
not depend on the layer, so one list serves every per-layer call of an engine's
load, and the kernel adds the layer's terms (kv_bulk.h).  Everything is
vectorised: the pieces of a 1,356-page load take milliseconds, once per
plan and direction.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..transfer import Transfer
from .direct import layer_copies

# Bulk copies need 16-byte aligned addresses and sizes (cp.async.bulk); the vector
# walker that stands in elsewhere moves 16-byte vectors for the same reason.
BULK_ALIGN = 16
STAGE_BYTES = 32 << 10  # one stage, one shared-memory buffer
# Fields of one piece as the kernel reads it (PkvBulkPiece, kv_bulk.h): host offset,
# device offset (both before the layer's terms), bytes, offset in the stage's buffer, job.
PIECE_FIELDS = 5


class BulkPieces(NamedTuple):
    """A transfer's pieces and stages, layer-independent, as the kernel reads them."""

    pieces: np.ndarray  # (n, PIECE_FIELDS) int64, in stage order
    stage_first: np.ndarray  # (stages + 1,) int64: stage s holds pieces [stage_first[s], stage_first[s + 1])
    stage_bytes: np.ndarray  # (stages,) int64: bytes a stage moves, what its barrier waits for
    buffer_bytes: int  # shared memory of one stage buffer: the stage size
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


def bulk_pieces(transfer: Transfer, stage_bytes: int = STAGE_BYTES) -> BulkPieces:
    """The pieces of `transfer`'s pairs (K then V, or the latent), layer-independent."""
    host_parts, device_parts, size_parts, job_parts = [], [], [], []
    skipped = False
    for job, pair in enumerate(transfer.pairs):
        host_rel, dev_rel, size, left_out = layer_copies(transfer.indices, pair, transfer.page_size)
        skipped |= left_out
        host_parts.append(host_rel)
        device_parts.append(dev_rel)
        size_parts.append(size)
        job_parts.append(np.full(size.size, job, np.int64))
    host, device, size = np.concatenate(host_parts), np.concatenate(device_parts), np.concatenate(size_parts)
    job = np.concatenate(job_parts)
    start = np.cumsum(size) - size  # each copy's place in the stream of bytes
    first_stage, last_stage = start // stage_bytes, (start + size - 1) // stage_bytes
    counts = last_stage - first_stage + 1
    copy = np.repeat(np.arange(size.size), counts)  # the copy of each piece
    stage = first_stage[copy] + (np.arange(copy.size) - np.repeat(np.cumsum(counts) - counts, counts))
    piece_start = np.maximum(start[copy], stage * stage_bytes)
    piece_end = np.minimum(start[copy] + size[copy], (stage + 1) * stage_bytes)
    within = piece_start - start[copy]
    pieces = np.stack([host[copy] + within, device[copy] + within, piece_end - piece_start, piece_start - stage * stage_bytes, job[copy]], axis=1)
    stages = int(stage[-1]) + 1 if stage.size else 0
    stage_first = np.searchsorted(stage, np.arange(stages + 1)).astype(np.int64)
    total = int(size.sum())
    filled = np.minimum(stage_bytes, total - np.arange(stages, dtype=np.int64) * stage_bytes)
    return BulkPieces(np.ascontiguousarray(pieces, dtype=np.int64), stage_first, filled, stage_bytes, skipped)
