"""The staged path's schedule: host runs -> 1-D/2-D copies between a host pool and a
staging miniature of it, in chunks; and the rule of when staging carries a schedule well.

The staged io path moves the host side of a transfer with a few large copies
(copy engines) and the device side with the copy kernel working between a
staging buffer in device memory and the engine's KV buffers.  The staging
buffer of a chunk is a miniature of the host pool: the same layout, holding the
chunk's tokens in index order (staging token j is the chunk's j-th index) and
only the layers moved.  A run of consecutive host tokens is then one region
with the same shape on both sides, and that region is one 2-D copy (rows of
`width` bytes at each side's pitch) wherever its dimensions fold to two:

- layer_first: a run is one row per layer (pitch: the layer stride);
- page_first: a per-layer run is one row per token; all layers, one row;
- page_first_direct: a per-layer run of pages is one row per page (pitch: the
  page stride); all layers, one row;
- page_head: all layers, one row; per-layer rows are one head's row (tiny).

Pure numpy, no device: the CPU backend runs the same schedule with memmove.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import HostStrides, canonical_view, host_shape, host_strides

# cudaMemcpy2DAsync / hipMemcpy2DAsync refuse a pitch above the device's maximum
# pitch (cudaDevAttrMaxPitch: 2^31 - 1 on every current GPU); a layer_first pool
# past 2 GiB a layer has larger ones, and its rows become copies of their own.
MAX_PITCH = (1 << 31) - 1
# Each buffer's miniature (K, V; or MLA's latent) starts on this alignment in the staging
# buffer: the kernel picks its access width from the addresses, 16 bytes wants 16.
STAGING_ALIGN = 256
# Chunks a large transfer is cut into: a few large ones, then chunks that shrink
# toward the end of a load (grow from the start of a backup).  The kernel of a load's
# last chunk (a backup's first) overlaps no copy, so that chunk sets the pipeline's
# tail; every chunk boundary inside a run of host pages costs two more copies, each
# with a fixed cost on the copy engine, and each chunk costs host time.  TAPER: the
# most a load's chunk may shrink from the one before, so that the link fills it no
# sooner than the kernel empties the previous slot and no copy waits for a slot; a
# backup mirrors it.  TAIL_BYTES: the last chunk, whose kernel alone is the tail.
# The measurements behind each number: docs/DESIGN.md, "The staged path".
PIPELINE_CHUNKS = 4
TAPER = 0.6
TAIL_BYTES = 2 << 20
MIN_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Copies:
    """The copies of one buffer (K, V or the latent) between the host buffer and a staging slot, in
    chunk order: parallel arrays of byte offsets, row width, rows and each side's pitch.
    Host offsets leave out the layer term (layer * host layer stride), added per call."""

    host: np.ndarray
    staging: np.ndarray
    width: np.ndarray
    height: np.ndarray
    host_pitch: np.ndarray
    staging_pitch: np.ndarray
    chunk_ends: np.ndarray  # copies of chunk c are [chunk_ends[c-1], chunk_ends[c])

    def __len__(self) -> int:
        return int(self.width.size)

    @property
    def bytes(self) -> int:
        return int((self.width * self.height).sum())


@dataclass(frozen=True)
class StagingSchedule:
    """How one transfer goes through staging: its chunks and, for each buffer, the staging
    miniature's strides, where it starts in a slot, and the copies."""

    chunk_tokens: int  # tokens the largest chunk holds, a multiple of page_size: what a slot must hold
    chunks: tuple[range, ...]  # positions in the index list, in order
    layers: int  # layers a staging miniature holds: 1 (stride 0: any layer) or all of them
    staging: tuple[HostStrides, ...]
    offsets: tuple[int, ...]  # where each buffer's miniature starts in a slot
    slot_bytes: int  # bytes a slot must hold
    copies: tuple[Copies, ...]

    @property
    def copy_count(self) -> int:
        return sum(len(c) for c in self.copies)

    @property
    def min_width(self) -> int:
        return min(int(c.width.min()) for c in self.copies if len(c))

    @property
    def mean_copy_bytes(self) -> float:
        return sum(c.bytes for c in self.copies) / max(1, self.copy_count)


def miniature(layout: str, layers: int, staged_layers: int, pages: int, page_size: int, heads: int, head_dim: int,
              dtype: torch.dtype, storage: torch.Tensor | None = None) -> torch.Tensor:
    """A staging miniature of a host buffer: `pages` pages of `staged_layers` layers, in `layout`.

    With one staged layer, its layer dimension is expanded to `layers` with stride 0, so
    the copy kernel's absolute layer index lands on the one staged layer.  `storage`
    (bytes) holds it; without one it is a meta tensor, for the strides only."""
    shape = host_shape(layout, staged_layers, pages, page_size, heads, head_dim)
    if storage is None:
        tensor = torch.empty(shape, dtype=dtype, device="meta")
    else:
        tensor = storage[: int(np.prod(shape)) * dtype.itemsize].view(dtype).view(shape)
    if staged_layers == 1 and layers > 1:
        full = list(host_shape(layout, layers, pages, page_size, heads, head_dim))
        tensor = tensor.expand(full)
    return tensor


def staging_strides(host: torch.Tensor, layout: str, layers: int, staged_layers: int, pages: int, page_size: int) -> HostStrides:
    """Byte strides of a staging miniature of the host buffer `host`."""
    view = canonical_view(host, layout, page_size)
    heads, head_dim = view.shape[3], view.shape[4]
    return host_strides(miniature(layout, layers, staged_layers, pages, page_size, heads, head_dim, host.dtype), layout, page_size)


def chunk_tokens(tokens: int, token_bytes: int, page_size: int, slot_bytes: int) -> int:
    """Tokens of a full chunk (a multiple of page_size): about tokens / PIPELINE_CHUNKS, at
    least MIN_CHUNK_BYTES' worth, at most what a slot holds; 0 when not one page fits a slot."""
    fits = slot_bytes // (token_bytes * page_size) * page_size
    if fits == 0:
        return 0
    wanted = max(-(-tokens // PIPELINE_CHUNKS), MIN_CHUNK_BYTES // token_bytes)
    return min(fits, -(-wanted // page_size) * page_size, -(-tokens // page_size) * page_size)


def chunk_bounds(tokens: int, token_bytes: int, page_size: int, slot_bytes: int, to_device: bool) -> np.ndarray:
    """Where the chunks of a transfer of `tokens` start and end (positions; 0 first, `tokens`
    last), each at most a full chunk (chunk_tokens) and each but the last a whole number of
    pages: full chunks first, then chunks shrinking by TAPER down to TAIL_BYTES at the end
    of a load; the same sizes in reverse for a backup.  Empty where not one page fits a slot."""
    full = chunk_tokens(tokens, token_bytes, page_size, slot_bytes) // page_size  # in pages from here on
    if full == 0:
        return np.zeros(0, np.int64)
    pages = -(-tokens // page_size)
    taper, size = [], max(1, math.ceil(TAIL_BYTES / (token_bytes * page_size)))
    while size < full and sum(taper) + size < pages:
        taper.append(size)
        size = math.ceil(size / TAPER)
    rest = pages - sum(taper)
    count = -(-rest // full)
    front = [-(-rest // count)] * (count - 1)
    sizes = [*front, rest - sum(front), *taper[::-1]]
    if not to_device:
        sizes.reverse()
    bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64) * page_size
    bounds[-1] = tokens
    return bounds


def host_runs(host_idx: np.ndarray, bounds: np.ndarray, registration_tokens: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Starts (positions) and lengths of runs of consecutive host tokens, cut at the chunk
    `bounds` and, for registered host memory, where a registration of K or of V ends."""
    n = host_idx.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    follows = np.diff(host_idx) == 1
    cuts = bounds[(bounds > 0) & (bounds < n)]
    follows[cuts - 1] = False
    for tokens in registration_tokens:
        if tokens:
            follows &= host_idx[1:] % tokens != 0
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return starts, np.diff(np.append(starts, n))


def whole_pages(host_idx: np.ndarray, starts: np.ndarray, lengths: np.ndarray, page_size: int) -> bool:
    """Whether every run is whole pages, each at a page boundary of the index list too."""
    return not ((starts % page_size).any() or (lengths % page_size).any() or (host_idx[starts] % page_size).any())


def _fold(dims: list[tuple[int, int, int]], row_bytes: int) -> tuple[int, tuple[int, int, int] | None, list[tuple[int, int, int]]]:
    """(width, rows, loops) of a region given as (count, host stride, staging stride) dimensions,
    innermost last, above a contiguous row of `row_bytes`: dims contiguous on both sides fold
    into the width; the next dim is the rows (and folds further dims that continue it on both
    sides); what is left is looped over, one copy each."""
    dims = [d for d in dims if d[0] > 1]
    width = row_bytes
    while dims and dims[-1][1] == width and dims[-1][2] == width:
        width *= dims.pop()[0]
    if not dims:
        return width, None, []
    count, hs, ss = dims.pop()
    while dims and dims[-1][1] == count * hs and dims[-1][2] == count * ss:
        count *= dims.pop()[0]
    if max(hs, ss) > MAX_PITCH:
        return width, None, [*dims, (count, hs, ss)]
    return width, (count, hs, ss), dims


def copies(host: HostStrides, staging: HostStrides, page_size: int, page_major: bool, host_starts: np.ndarray,
           staging_starts: np.ndarray, lengths: np.ndarray, staged_layers: int, chunk_of_run: np.ndarray, chunks: int) -> Copies:
    """The copies of every run (host token, staging token, tokens), one tensor, in run order."""
    parts: list[tuple[np.ndarray, ...]] = []
    order = np.arange(lengths.size)
    for length in np.unique(lengths):
        runs = order[lengths == length]
        if page_major:
            tokens = [(int(length) // page_size, host.page, staging.page), (page_size, host.token, staging.token)]
        else:
            tokens = [(int(length), host.token, staging.token)]
        dims = sorted([*tokens, (staged_layers, host.layer, staging.layer), (host.heads, host.head, staging.head)],
                      key=lambda d: d[1], reverse=True)
        width, rows, loops = _fold(dims, host.row_bytes)
        height, host_pitch, staging_pitch = rows if rows is not None else (1, width, width)
        h0 = (host_starts[runs] // page_size) * host.page + (host_starts[runs] % page_size) * host.token
        s0 = (staging_starts[runs] // page_size) * staging.page + (staging_starts[runs] % page_size) * staging.token
        host_off, staging_off = h0[:, None], s0[:, None]
        for count, hs, ss in loops:  # each loop multiplies the copies of a run
            step = np.arange(count, dtype=np.int64)
            host_off = (host_off[:, :, None] + step * hs).reshape(runs.size, -1)
            staging_off = (staging_off[:, :, None] + step * ss).reshape(runs.size, -1)
        per_run = host_off.shape[1]
        shape = np.tile(np.array([width, height, host_pitch, staging_pitch], np.int64), (runs.size * per_run, 1))
        parts.append((np.repeat(runs, per_run), host_off.ravel(), staging_off.ravel(), shape))
    if not parts:
        empty = np.zeros(0, np.int64)
        return Copies(empty, empty, empty, empty, empty, empty, np.zeros(chunks, np.int64))
    run = np.concatenate([p[0] for p in parts])
    sort = np.argsort(run, kind="stable")  # back to run order, which is chunk order
    shape = np.concatenate([p[3] for p in parts])[sort]
    ends = np.searchsorted(chunk_of_run[run[sort]], np.arange(chunks), side="right")
    return Copies(np.concatenate([p[1] for p in parts])[sort].astype(np.int64), np.concatenate([p[2] for p in parts])[sort].astype(np.int64),
                  shape[:, 0], shape[:, 1], shape[:, 2], shape[:, 3], ends.astype(np.int64))


def build(host_idx: np.ndarray, pairs: tuple, layout: str, page_size: int, layers: range, layer_count: int,
         slot_bytes: int, to_device: bool = True) -> StagingSchedule | None:
    """The staging schedule of a transfer, or None where staging cannot carry it (a page layout's
    indices that are not whole pages, layers that are neither one nor all from 0, or not one
    page fitting a slot).  `pairs` are transfer.TensorPair (K, V; or the latent): their host
    buffers, strides and registration pieces (runs are cut where any one's piece ends)."""
    staged_layers = len(layers)
    if staged_layers != 1 and (layers.start != 0 or staged_layers != layer_count):
        return None
    # Pages not adjacent on the host (in K or V alone: one head can make a layout's pages
    # adjacent): a run is whole pages.  With one token a page, the page stride is the token
    # step (the in-page token stride of a one-token page means nothing).
    page_major = tuple(page_size == 1 or p.strides.page != page_size * p.strides.token for p in pairs)
    token_bytes = sum(p.device_token_bytes for p in pairs) * staged_layers
    bounds = chunk_bounds(host_idx.size, token_bytes, page_size, slot_bytes - STAGING_ALIGN * (len(pairs) - 1), to_device)
    if bounds.size == 0:
        return None
    starts, lengths = host_runs(host_idx, bounds, tuple(p.registration_tokens for p in pairs))
    if any(page_major) and not whole_pages(host_idx, starts, lengths, page_size):
        return None
    chunks = tuple(range(int(b), int(e)) for b, e in zip(bounds[:-1], bounds[1:]))
    pages = -(-max(len(c) for c in chunks) // page_size)  # a staging miniature holds whole pages
    chunk = pages * page_size
    staging = tuple(staging_strides(p.host, layout, layer_count, staged_layers, pages, page_size) for p in pairs)
    offsets, slot = [], 0
    for pair in pairs:
        slot = -(-slot // STAGING_ALIGN) * STAGING_ALIGN
        offsets.append(slot)
        slot += chunk * staged_layers * pair.device_token_bytes
    chunk_of_run = np.searchsorted(bounds, starts, side="right") - 1
    runs = tuple(copies(p.strides, s, page_size, major, host_idx[starts], starts - bounds[chunk_of_run], lengths,
                        staged_layers, chunk_of_run, len(chunks)) for p, s, major in zip(pairs, staging, page_major))
    return StagingSchedule(chunk, chunks, staged_layers, staging, tuple(offsets), slot, runs)


@dataclass(frozen=True)
class StagingRule:
    """When staging carries a transfer well, and which transfers `auto` stages.

    Copies: each separate copy costs the copy engine a fixed time, so below an average of
    `min_copy_bytes` a copy loses more than the kernel path does; rows under
    `min_row_bytes` (page_head's per-layer rows are one head's) starve the engine.  Rows
    of `batch_row_bytes` on average go as 1-D copies, a chunk's in one batched call, which
    the engines run with less time between copies than separate 2-D copies; smaller rows
    (a page_first_direct host's per-layer pages) stay 2-D copies.  `auto` stages backups,
    loads whose copies go as 2-D copies, and loads whose copies are batched, as its
    switches say.  The measurements behind each default: docs/DESIGN.md, "The staged path"."""

    min_row_bytes: int = 1024
    min_copy_bytes: int = 2 << 20
    batch_row_bytes: int = 1 << 20
    auto_loads: bool = True
    auto_batched_loads: bool = True
    auto_backups: bool = True

    def carries(self, staged: StagingSchedule) -> bool:
        return staged.copy_count == 0 or (staged.min_width >= self.min_row_bytes and staged.mean_copy_bytes >= self.min_copy_bytes)

    def auto_stages(self, to_device: bool, batched: bool) -> bool:
        if not to_device:
            return self.auto_backups
        return self.auto_batched_loads if batched else self.auto_loads

    def batches(self, staged: StagingSchedule) -> bool:
        rows = sum(int(c.height.sum()) for c in staged.copies)
        return rows > 0 and sum(c.bytes for c in staged.copies) >= rows * self.batch_row_bytes


# The GPUs' rule: staged loads as 2-D copies did not beat the kernel path; batched ones did.
LINK_RULE = StagingRule(auto_loads=False)
# The CPU backend models the path to run its planning in CI: it stages whatever staging can carry.
EVERY_SCHEDULE = StagingRule(0, 0)
