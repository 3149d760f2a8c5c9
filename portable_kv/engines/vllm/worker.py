"""The spec's worker: vLLM 0.33.0's `OffloadingWorker` contract over a HostTier (per-process host
pools), or a RegionTier where canonical pages are shared or sharded by ranks (the node's region).

As vLLM's own CPU worker: three directions (stores, loads, expedited loads),
each a queue of transfers that run and finish in the order they were
submitted, on a stream of their own that first waits for the model's stream
(stores read KV it wrote; loads must land after writes to their blocks);
`get_finished` reports finished transfers in order with their bytes and time,
`wait` blocks on the named ones.  Each job is prepared once, one portable_kv
plan per pool (host_tier.py), and moved through portable_kv's io paths
instead of `swap_blocks_batch`; stores are marked as off the critical path.
On the cpu backend a transfer is done when it returns.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from ... import backends
from .host_tier import HostTier, Slot, TierTransfer
from .node_region import NodeRegion
from .region_tier import RegionTier


@dataclass
class _Job:
    job_id: int
    num_bytes: int
    start: Any  # a timing event, or perf_counter seconds on the cpu backend
    end: Any  # an event, or None on the cpu backend (done at submit)
    elapsed: float = 0.0


class Direction:
    """One direction's queue of transfers, in submission order."""

    def __init__(self, tier: HostTier | RegionTier, to_device: bool, device: torch.device) -> None:
        self.tier, self.to_device, self.device = tier, to_device, device
        self.gpu = device.type != "cpu"
        self.stream = torch.cuda.Stream(device=device) if self.gpu else None
        self.jobs: deque[_Job] = deque()
        self.events: dict[int, Any] = {}

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, order: Sequence[Slot] | None = None) -> TierTransfer:
        """Prepare the job (one plan per pool) and enqueue it: every layer at once, or one layer after
        another in `order` (a load whose forward waits layer by layer)."""
        gpu_spec, host_spec = (dst_spec, src_spec) if self.to_device else (src_spec, dst_spec)
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: expected a GPULoadStoreSpec and a CPULoadStoreSpec, got "
                            f"{type(src_spec).__name__} -> {type(dst_spec).__name__}")
        moves = self.tier.plan(gpu_spec.block_ids, gpu_spec.group_sizes, gpu_spec.block_indices, host_spec.block_ids)
        transfer = self.tier.prepare(moves, self.to_device)
        launch = transfer.run if order is None else partial(transfer.run_layers, order)
        if not self.gpu:
            start = time.perf_counter()
            launch()
            self.jobs.append(_Job(job_id, transfer.num_bytes, start, None, time.perf_counter() - start))
            return transfer
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Earlier jobs of this direction are ahead on the same stream: order is kept by the stream itself.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            launch()
            end.record(self.stream)
        self.jobs.append(_Job(job_id, transfer.num_bytes, start, end))
        self.events[job_id] = end
        return transfer

    def finished(self) -> list[TransferResult]:
        results = []
        while self.jobs and (self.jobs[0].end is None or self.jobs[0].end.query()):
            job = self.jobs.popleft()
            seconds = job.elapsed if job.end is None else job.start.elapsed_time(job.end) * 1e-3
            self.events.pop(job.job_id, None)
            results.append(TransferResult(job_id=job.job_id, success=True, transfer_size=job.num_bytes, transfer_time=seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            event = self.events.get(job_id)
            if event is not None:
                event.synchronize()

    def drain(self) -> None:
        if self.jobs and self.jobs[-1].end is not None:
            self.jobs[-1].end.synchronize()
        self.jobs.clear()
        self.events.clear()


class PortableKVOffloadingWorker(OffloadingWorker):
    """vLLM's worker-side offloading contract, its bytes moved by portable_kv (docs/API.md, "vLLM offloading spec")."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int, io: dict[str, str], *,
                 canonical_layout: bool = False, numa_node: int | str | None = None, node_region: NodeRegion | None = None) -> None:
        """`node_region`: the node's shared region, where canonical pages that ranks share or shard live
        (region_tier.py); the worker owns it from here and closes it at shutdown."""
        backend = backends.current()
        if node_region is not None:
            if node_region.num_chunks != num_chunks:
                node_region.close(backend)
                raise ValueError(f"node_region: expected {num_chunks} chunks, got {node_region.num_chunks}")
            try:
                self.tier: HostTier | RegionTier = RegionTier(kv_caches, blocks_per_chunk, node_region, backend)
            except Exception:
                node_region.close(backend)
                raise
        else:
            self.tier = HostTier(kv_caches, blocks_per_chunk, num_chunks, io, canonical_layout=canonical_layout, numa_node=numa_node)
        device = backend.device
        self._store = Direction(self.tier, False, device)
        self._load = Direction(self.tier, True, device)
        # Its own stream, so that a load the step waits for does not queue behind regular loads.
        self._expedited_load = Direction(self.tier, True, device)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Async GPU -> host."""
        self._store.submit(job_id, src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Async host -> GPU."""
        (self._expedited_load if expedited else self._load).submit(job_id, src_spec, dst_spec)
        return True

    def submit_layerwise_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, order: Sequence[Slot]) -> TierTransfer:
        """Host -> GPU on the expedited loads' stream, one call per layer in `order`: the
        transfer's `ready(slot)` says when each layer has landed.  Finished, and waited by `wait`, as a load."""
        return self._expedited_load.submit(job_id, src_spec, dst_spec, order)

    def get_finished(self) -> list[TransferResult]:
        return self._store.finished() + self._load.finished() + self._expedited_load.finished()

    def wait(self, job_ids: set[int]) -> None:
        for direction in (self._store, self._load, self._expedited_load):
            direction.wait(job_ids)

    def shutdown(self) -> None:
        for direction in (self._store, self._load, self._expedited_load):
            direction.drain()
        self.tier.close()
