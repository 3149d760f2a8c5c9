"""vLLM's canonical layout in the node's shared region: what each rank writes and reads there.

The region's rows are vLLM's chunks (`kv_bytes_per_chunk` bytes each).  As in
vLLM's `SharedOffloadRegion.create_next_canonical_view`, block tensor t owns
`canonical_page_bytes[t] * blocks_per_chunk` bytes of every row, tensors back
to back from the row's start, and sub-block j of a chunk is the j-th canonical
page there.  A rank's page maps into a canonical page by its
`CanonicalPageMapping` runs; a store writes the runs of the blocks this rank
writes (ranks that hold the same bytes take turns by canonical page id,
`chunk * blocks_per_chunk + sub-block`, as vLLM's `is_writer`), a load reads
this rank's runs back, whichever ranks and parallelism wrote them.  A transfer
is one batch of 1-D copies for the backend's copier (one batched call on a
GPU, memmove on the cpu backend), as vLLM's `swap_blocks_batch` gets them.
Nothing here imports vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...io.copier import CopyBatch
from .host_tier import OWN_SPEC, Moves, NotServed, Slot, block_rows, check_served, plan_moves
from .node_region import NodeRegion


@dataclass(frozen=True)
class Fragments:
    """One reference's runs unrolled: byte offsets in the rank's page and in the canonical page."""

    tensor: int
    local: np.ndarray  # uint64
    canonical: np.ndarray  # uint64
    sizes: np.ndarray  # uint64
    num_writers: int
    writer_index: int


def unroll(tensor: int, mapping: Any) -> Fragments:
    """A reference's CanonicalPageMapping as one copy per fragment (vLLM's `_build_copy_plan`)."""
    local, canonical, sizes = [], [], []
    for run in mapping.runs:
        for i in range(run.num_fragments):
            local.append(run.local_offset + i * run.local_stride)
            canonical.append(run.canonical_offset + i * run.canonical_stride)
            sizes.append(run.fragment_size)
    local_at, canonical_at, nbytes = (np.asarray(values, dtype=np.uint64) for values in (local, canonical, sizes))
    return Fragments(tensor, local_at, canonical_at, nbytes, mapping.num_writers, mapping.writer_index)


class RegionTier:
    """vLLM's block tensors against their canonical pages in a NodeRegion: the HostTier surface the worker uses."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: NodeRegion, backend: Any) -> None:
        check_served(kv_caches, canonical_layout=True, node_region=True)
        self.blocks_per_chunk, self.num_chunks, self.region, self.backend = blocks_per_chunk, region.num_chunks, region, backend
        tensors = kv_caches.tensors
        self.rows = [block_rows(t.tensor, t.page_size_bytes, f"kv_caches.tensors[{i}]") for i, t in enumerate(tensors)]
        self.pages = [t.page_size_bytes for t in tensors]
        self.groups = [[unroll(ref.tensor_idx, ref.mapping) for ref in refs] for refs in kv_caches.group_data_refs]
        self.canonical_pages = [0] * len(tensors)
        for refs in kv_caches.group_data_refs:
            for ref in refs:
                self.canonical_pages[ref.tensor_idx] = max(self.canonical_pages[ref.tensor_idx], ref.mapping.canonical_page_size_bytes)
        spans = [page * blocks_per_chunk for page in self.canonical_pages]
        self.offsets = [sum(spans[:t]) for t in range(len(spans))]
        if sum(spans) > region.row_bytes:
            raise NotServed(f"kv_bytes_per_chunk: the canonical pages of a chunk take {sum(spans)} bytes, the region's rows "
                            f"{region.row_bytes}; {OWN_SPEC}")
        self.device = tensors[0].tensor.device

    def layer_slots(self, group_layer_names: Sequence[Sequence[str]]) -> dict[str, tuple[Slot, ...]]:
        """Every layer in the one slot of the tier: a transfer lands whole."""
        return {name: (Slot(0, 0),) for names in group_layer_names for name in names}

    def chunk_view(self, tensor_idx: int) -> torch.Tensor:
        """Tensor `tensor_idx`'s canonical pages: `(num_chunks, canonical_page_bytes * blocks_per_chunk)` uint8, a view of the region."""
        start = self.offsets[tensor_idx]
        return self.region.rows()[:, start : start + self.canonical_pages[tensor_idx] * self.blocks_per_chunk]

    def plan(self, gpu_blocks: np.ndarray, group_sizes: Sequence[int], block_indices: Sequence[int], chunks: np.ndarray) -> list[Moves]:
        """The transfer's index pairs per group (plan_moves)."""
        return plan_moves(self.blocks_per_chunk, len(self.groups), gpu_blocks, group_sizes, block_indices, chunks)

    def prepare(self, moves: list[Moves], to_device: bool) -> RegionTransfer:
        """The moves as one batch of copies: per block and reference, a copy per fragment of its runs;
        a store keeps the blocks whose canonical page this rank writes."""
        per = self.blocks_per_chunk
        dst, src, sizes, num_bytes = [], [], [], 0
        for m in moves:
            for frags in self.groups[m.group]:
                blocks, pages = m.blocks, m.tokens
                if not to_device and frags.num_writers > 1:
                    mine = pages % frags.num_writers == frags.writer_index
                    blocks, pages = blocks[mine], pages[mine]
                t = frags.tensor
                local = (self.rows[t].data_ptr() + blocks.astype(np.uint64) * np.uint64(self.pages[t]))[:, None] + frags.local[None, :]
                canonical = (np.uint64(self.region.address + self.offsets[t]) + (pages // per).astype(np.uint64) * np.uint64(self.region.row_bytes)
                             + (pages % per).astype(np.uint64) * np.uint64(self.canonical_pages[t]))[:, None] + frags.canonical[None, :]
                dst.append((local if to_device else canonical).ravel())
                src.append((canonical if to_device else local).ravel())
                sizes.append(np.broadcast_to(frags.sizes, local.shape).ravel())
                num_bytes += len(blocks) * int(frags.sizes.sum())
        empty = np.zeros(0, dtype=np.uint64)
        batch = CopyBatch(np.concatenate(dst or [empty]), np.concatenate(src or [empty]), np.concatenate(sizes or [empty]))
        chunks = np.unique(np.concatenate([m.tokens for m in moves] or [np.zeros(0, np.int64)]) // per)
        return RegionTransfer(self, batch, chunks, num_bytes)

    def stats(self) -> list[dict]:
        """The region's bytes and the bytes page-locked so far."""
        return [{"region_bytes": self.region.nbytes, "pinned_bytes": self.region.pinned_bytes()}]

    def close(self) -> None:
        """Unlock and unmap the region after the transfers already enqueued."""
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)
        self.region.close(self.backend)


class RegionTransfer:
    """One transfer of a RegionTier: `run()` enqueues its batch on the current stream after
    page-locking the chunks it touches; `ready(slot)` is the event it has landed by."""

    def __init__(self, tier: RegionTier, batch: CopyBatch, chunks: np.ndarray, num_bytes: int) -> None:
        self.tier, self.batch, self.chunks, self.num_bytes = tier, batch, chunks, num_bytes
        self.event: Any = None

    def slots(self) -> list[Slot]:
        return [Slot(0, 0)]

    def run(self) -> None:
        tier = self.tier
        tier.region.pin(self.chunks, tier.backend)
        copier = tier.backend.copier
        if len(self.batch):
            copier.memcpy_batch(self.batch, copier.current_stream())
        if tier.device.type != "cpu":
            self.event = torch.cuda.Event()
            self.event.record()

    def run_layers(self, order: Sequence[Slot]) -> None:
        """The whole batch: every layer is in the tier's one slot."""
        self.run()

    def ready(self, slot: Slot) -> list[Any]:
        return [] if self.event is None else [self.event]
