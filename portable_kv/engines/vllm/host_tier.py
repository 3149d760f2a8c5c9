"""vLLM's offloaded KV blocks held in portable_kv host pools, and moved by portable_kv's movers.

vLLM's worker hands its KV cache over as block tensors: each one int8
`(num_blocks, page_size_bytes)`, a row one GPU block of a layer (per-layer
tensors) or of every layer (cross-layer blocks), plus, per KV cache group, the
tensors its layers use.  Its host copy of tensor t is `(num_chunks,
blocks_per_chunk * page_bytes)`: chunk c holds the pages of `blocks_per_chunk`
consecutive logical blocks back to back.

Here the tensors of one page size are the layers of one MLA-kind device pool
(one buffer a layer, a row `(1, page_bytes)` of uint8): tokens are GPU blocks.
Its host pool is `layer_first` with one token a sub-block of a chunk, so that
host token `c * blocks_per_chunk + j` of layer t is sub-block j of chunk c of
tensor t: the same bytes at the same offsets of a per-tensor buffer as vLLM's
own CPU spec keeps.  A transfer is then index pairs (GPU block, host token),
prepared once as one portable_kv plan per pool and set of layers, and launched
for every layer at once or layer by layer.  Nothing here imports vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...device_pool import MLADevicePool
from ...mla import MLAHostPool

# Said by every refusal: what still runs the model when this spec cannot.
OWN_SPEC = "vLLM's own CPU spec serves it: leave spec_name out of kv_connector_extra_config (CPUOffloadingSpec)"


class NotServed(ValueError):
    """A KV cache this spec does not hold; the message says what, and that vLLM's own spec can."""


@dataclass(frozen=True)
class Slot:
    """Where one vLLM block tensor lives: a pool, and its layer there."""

    pool: int
    layer: int


@dataclass(frozen=True)
class Moves:
    """The index pairs of one group of one transfer: GPU blocks and host tokens, in order."""

    group: int
    blocks: np.ndarray  # int64 GPU block ids
    tokens: np.ndarray  # int64 host tokens: chunk * blocks_per_chunk + sub-block


def block_rows(tensor: torch.Tensor, page_bytes: int, name: str) -> torch.Tensor:
    """A block tensor as `(num_blocks, 1, page_bytes)` uint8 rows over the same memory, never a copy."""
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise NotServed(f"{name}: expected (num_blocks, ...) with at least one block, got {tuple(tensor.shape)}; {OWN_SPEC}")
    blocks = int(tensor.shape[0])
    if tensor.nbytes != blocks * page_bytes or not tensor.is_contiguous():
        raise NotServed(f"{name}: blocks of {page_bytes} bytes that are not back to back (shape {tuple(tensor.shape)}, "
                        f"strides {tensor.stride()}); portable_kv binds contiguous block rows; {OWN_SPEC}")
    return tensor.view(torch.uint8).view(blocks, 1, page_bytes)


def _identity_mapping(mapping: Any, page_bytes: int) -> bool:
    """A canonical page mapping under which the canonical page is the worker's page itself."""
    runs = tuple(mapping.runs)
    return (mapping.num_writers == 1 and mapping.canonical_page_size_bytes == page_bytes == mapping.local_page_size_bytes
            and len(runs) == 1 and runs[0].local_offset == 0 and runs[0].canonical_offset == 0
            and runs[0].fragment_size == page_bytes and runs[0].num_fragments == 1)


def needs_region(kv_caches: Any, canonical_layout: bool) -> bool:
    """Whether the canonical pages are shared or sharded by ranks: then they live in the node's region (region_tier.py)."""
    return canonical_layout and any(ref.mapping is not None and not _identity_mapping(ref.mapping, kv_caches.tensors[ref.tensor_idx].page_size_bytes)
                                    for refs in kv_caches.group_data_refs for ref in refs)


def check_served(kv_caches: Any, canonical_layout: bool, node_region: bool = False) -> None:
    """Refuse, by name, a KV cache whose host bytes this spec would not keep as vLLM's own spec does.
    `node_region`: the worker has the node's shared region for canonical pages that ranks share or shard."""
    tensors, groups = kv_caches.tensors, kv_caches.group_data_refs
    if not tensors or not groups:
        raise NotServed(f"kv_caches: no block tensors or no KV cache groups to offload; {OWN_SPEC}")
    for g, refs in enumerate(groups):
        for ref in refs:
            page = tensors[ref.tensor_idx].page_size_bytes
            if ref.page_size_bytes != page:
                raise NotServed(f"group {g}: padded pages ({ref.page_size_bytes} bytes of KV in pages of {page}); vLLM moves the "
                                f"unpadded bytes only and portable_kv moves whole block rows; {OWN_SPEC}")
            if canonical_layout and ref.mapping is None:
                raise NotServed(f"group {g}: canonical_layout with a page vLLM did not certify (pipeline parallel, a packed or "
                                f"cross-layer layout, or a page it cannot place): no canonical mapping to write it by; {OWN_SPEC}")
            if canonical_layout and not node_region and not _identity_mapping(ref.mapping, page):
                raise NotServed(f"group {g}: canonical_layout with a page that ranks share or shard (tensor or context parallel) "
                                f"needs the node's host region that every rank writes (node_region.py), and this worker was "
                                f"given none; PortableKVOffloadingSpec gives its worker one; {OWN_SPEC}")


def plan_moves(blocks_per_chunk: int, num_groups: int, gpu_blocks: np.ndarray, group_sizes: Sequence[int],
               block_indices: Sequence[int], chunks: np.ndarray) -> list[Moves]:
    """vLLM's block-to-chunk correspondence: group g's blocks start at logical block `block_indices[g]`,
    so its first chunk is entered `block_indices[g] % blocks_per_chunk` sub-blocks in."""
    if len(group_sizes) != num_groups or len(block_indices) != len(group_sizes):
        raise ValueError(f"group_sizes: expected {num_groups} groups with a block index each, "
                         f"got {len(group_sizes)} sizes and {len(block_indices)} indices")
    per = blocks_per_chunk
    moves, block_at, chunk_at = [], 0, 0
    for g, (count, first) in enumerate(zip(group_sizes, block_indices)):
        if count == 0:
            continue
        skip = int(first) % per
        used = -(-(count + skip) // per)
        group_chunks = np.asarray(chunks[chunk_at : chunk_at + used], dtype=np.int64)
        tokens = group_chunks if per == 1 else (group_chunks[:, None] * per + np.arange(per)).ravel()[skip : skip + count]
        moves.append(Moves(g, np.asarray(gpu_blocks[block_at : block_at + count], dtype=np.int64), tokens))
        block_at, chunk_at = block_at + count, chunk_at + used
    if block_at != len(gpu_blocks) or chunk_at != len(chunks) or any(len(m.tokens) != len(m.blocks) for m in moves):
        raise ValueError(f"transfer: {len(gpu_blocks)} GPU blocks and {len(chunks)} chunks do not match group_sizes "
                         f"{list(group_sizes)} from block indices {list(block_indices)} at {per} blocks a chunk")
    return moves


class HostTier:
    """vLLM's block tensors as portable_kv device pools, with their host pools of `num_chunks` chunks.

    `prepare` plans one transfer (a plan per pool, its index copies its
    own), whose calls enqueue on the current stream; `chunk_view(t)` is
    tensor t's host copy in vLLM's `(num_chunks, blocks_per_chunk *
    page_bytes)` shape.
    """

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int, io: dict[str, str], *, canonical_layout: bool = False,
                 pin_memory: bool = True, numa_node: int | str | None = None, validate: bool = True) -> None:
        if num_chunks < 1:
            raise NotServed(f"cpu_bytes_to_use: room for {num_chunks} chunks; give at least one chunk's bytes")
        check_served(kv_caches, canonical_layout)
        self.blocks_per_chunk, self.num_chunks, self.io = blocks_per_chunk, num_chunks, dict(io)
        tensors = kv_caches.tensors
        by_page: dict[int, list[int]] = {}
        for t, tensor in enumerate(tensors):
            by_page.setdefault(tensor.page_size_bytes, []).append(t)
        self.slots: list[Slot] = [Slot(0, 0)] * len(tensors)
        self.devices: list[MLADevicePool] = []
        self.hosts: list[MLAHostPool] = []
        tokens = num_chunks * blocks_per_chunk
        try:
            for pool, (page, members) in enumerate(by_page.items()):
                rows = [block_rows(tensors[t].tensor, page, f"kv_caches.tensors[{t}]") for t in members]
                device = MLADevicePool.from_buffers(rows, page_size=1)
                # layer_first: one host token a sub-block, a layer's tokens back to back (module docstring).
                self.hosts.append(MLAHostPool(device, host_to_device_ratio=tokens / device.size, layout="layer_first",
                                              io_backend=self.io["store"], pin_memory=pin_memory, validate=validate, numa_node=numa_node))
                self.devices.append(device)
                for layer, t in enumerate(members):
                    self.slots[t] = Slot(pool, layer)
        except Exception:
            self.close()
            raise
        # Per group: the pools its layers use, and which layers of each (all of a pool's: one all-layer call).
        self.group_layers: list[dict[int, tuple[int, ...]]] = []
        self.group_bytes: list[int] = []  # bytes a block of the group moves, counted per reference as vLLM counts them
        self.group_tensors = [tuple(ref.tensor_idx for ref in refs) for refs in kv_caches.group_data_refs]
        for refs in kv_caches.group_data_refs:
            layers: dict[int, set[int]] = {}
            for ref in refs:
                slot = self.slots[ref.tensor_idx]
                layers.setdefault(slot.pool, set()).add(slot.layer)
            self.group_layers.append({pool: tuple(sorted(ls)) for pool, ls in layers.items()})
            self.group_bytes.append(sum(ref.page_size_bytes for ref in refs))

    def layer_slots(self, group_layer_names: Sequence[Sequence[str]]) -> dict[str, tuple[Slot, ...]]:
        """Where each named layer's KV lives, given each group's layer names in vLLM's order (its connector
        worker makes one reference a layer, in that order).  A group with fewer references than layers
        (one tensor holding every layer's block, as packed layouts do) gives each layer all of them."""
        if len(group_layer_names) != len(self.group_tensors):
            raise ValueError(f"group_layer_names: expected {len(self.group_tensors)} groups, got {len(group_layer_names)}")
        slots: dict[str, tuple[Slot, ...]] = {}
        for names, tensors in zip(group_layer_names, self.group_tensors):
            for i, name in enumerate(names):
                mine = (tensors[i],) if len(tensors) == len(names) else tensors
                slots[name] = tuple(dict.fromkeys(slots.get(name, ()) + tuple(self.slots[t] for t in mine)))
        return slots

    def chunk_view(self, tensor_idx: int) -> torch.Tensor:
        """Tensor `tensor_idx`'s host copy: `(num_chunks, blocks_per_chunk * page_bytes)` uint8, a view of host memory."""
        slot = self.slots[tensor_idx]
        buffer = self.hosts[slot.pool].kv_buffer[slot.layer, : self.num_chunks * self.blocks_per_chunk, 0]
        return buffer.reshape(self.num_chunks, -1)

    def plan(self, gpu_blocks: np.ndarray, group_sizes: Sequence[int], block_indices: Sequence[int], chunks: np.ndarray) -> list[Moves]:
        """The transfer's index pairs per group (plan_moves)."""
        return plan_moves(self.blocks_per_chunk, len(self.group_layers), gpu_blocks, group_sizes, block_indices, chunks)

    def prepare(self, moves: list[Moves], to_device: bool, io: str | None = None) -> TierTransfer:
        """The moves as one transfer, planned once: one portable_kv plan per pool and set of layers
        (groups that share both are one plan where their blocks are distinct).  Stores are off the
        step's critical path (`background`), so `auto` may give them the copy engines."""
        io = io or self.io["load" if to_device else "store"]
        by_layers: dict[tuple[int, tuple[int, ...]], list[Moves]] = {}
        for m in moves:
            for pool, layers in self.group_layers[m.group].items():
                by_layers.setdefault((pool, layers), []).append(m)
        calls = []
        for (pool, layers), parts in by_layers.items():
            for batch in [parts] if len(parts) == 1 or _distinct(parts) else [[p] for p in parts]:
                blocks = torch.from_numpy(np.concatenate([p.blocks for p in batch]))
                tokens = torch.from_numpy(np.concatenate([p.tokens for p in batch]))
                plan = self.hosts[pool].prepare(self.devices[pool], tokens, blocks, io_backend=io, background=not to_device)
                calls.append(PlannedCall(pool, layers, len(layers) == self.hosts[pool].layer_num, plan))
        return TierTransfer(calls, to_device, sum(len(m.blocks) * self.group_bytes[m.group] for m in moves))

    def move(self, moves: list[Moves], to_device: bool, io: str | None = None) -> int:
        """Prepare the moves and enqueue them on the current stream; returns the bytes moved."""
        transfer = self.prepare(moves, to_device, io)
        transfer.run()
        return transfer.num_bytes

    def stats(self) -> list[dict]:
        """Each host pool's `stats()` (one pool per page size): calls, bytes and the caller's time per
        direction and io path, the paths `auto` took and why, the last error."""
        return [host.stats() for host in self.hosts]

    def close(self) -> None:
        """Release the host memory after the transfers already enqueued."""
        for host in self.hosts:
            host.close()


@dataclass(frozen=True)
class PlannedCall:
    """One pool's share of a transfer: its prepared plan and the pool's layers it moves."""

    pool: int
    layers: tuple[int, ...]
    every_layer: bool  # all of the pool's layers: one all-layer call
    plan: Any  # what the host pool's prepare() returned


class TierTransfer:
    """One transfer of the tier, prepared once (`HostTier.prepare`): `run()` moves every layer,
    `run_layers(order)` one layer after another, `ready(slot)` says when a layer has landed."""

    def __init__(self, calls: list[PlannedCall], to_device: bool, num_bytes: int) -> None:
        self.calls, self.to_device, self.num_bytes = calls, to_device, num_bytes

    def slots(self) -> list[Slot]:
        """The (pool, layer) slots it moves, each once, in pool then layer order."""
        return sorted({Slot(c.pool, layer) for c in self.calls for layer in c.layers}, key=lambda s: (s.pool, s.layer))

    def run(self) -> None:
        """Enqueue every layer on the current stream: one all-layer call per plan that moves all of a pool's layers."""
        for call in self.calls:
            if call.every_layer and self.to_device:
                call.plan.load_all()
            elif call.every_layer:
                call.plan.backup()
            else:
                for layer in call.layers:
                    self._one(call, layer)

    def run_layers(self, order: Sequence[Slot]) -> None:
        """Enqueue one call per layer on the current stream: the slots of `order` in that order, then
        those it moves that `order` leaves out."""
        moved, named = self.slots(), set(order)
        for slot in [s for s in order if s in set(moved)] + [s for s in moved if s not in named]:
            for call in self.calls:
                if call.pool == slot.pool and slot.layer in call.layers:
                    self._one(call, slot.layer)

    def ready(self, slot: Slot) -> list[Any]:
        """The plans' events that complete when the slot's latest call has landed (none where it moves no such slot)."""
        return [c.plan.ready(slot.layer) for c in self.calls if c.pool == slot.pool and slot.layer in c.layers]

    def _one(self, call: PlannedCall, layer: int) -> None:
        if self.to_device:
            call.plan.load(layer)
        else:
            call.plan.backup(layer)


def _distinct(parts: list[Moves]) -> bool:
    """Whether merged groups name no block and no host token twice (a destination written twice would race)."""
    blocks = np.concatenate([p.blocks for p in parts])
    tokens = np.concatenate([p.tokens for p in parts])
    return len(np.unique(blocks)) == len(blocks) and len(np.unique(tokens)) == len(tokens)
