"""PortableKVOffloadingSpec: vLLM 0.33.0's CPU offloading spec, its worker moving bytes with portable_kv.

It is vLLM's `CPUOffloadingSpec` for everything the scheduler sees (chunk
sizing from `cpu_bytes_to_use`, the manager with its LRU/ARC policies, store
threshold, events and metrics), with two changes on the worker side:
`get_worker` builds `PortableKVOffloadingWorker`, whose host chunks live in
portable_kv host pools (page-locked, on the GPU's NUMA node), and each worker
keeps its own chunks, as vLLM's spec does wherever it has no shared region
(`replicated_layout` off: an MLA model under tensor parallelism keeps one copy
a rank, and the manager sizes chunks for that).  The canonical layout
(`canonical_layout` in kv_connector_extra_config) under tensor or context
parallelism is the exception: its pages are shared or sharded by ranks, so
they live in one region per node that every rank maps (node_region.py,
region_tier.py), sized as vLLM's shared region, `replicated_layout` included.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ... import backends
from .host_tier import OWN_SPEC, NotServed, check_served, needs_region
from .io_paths import choose_io
from .node_region import NodeRegion, region_path
from .worker import PortableKVOffloadingWorker


class PortableKVOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading with portable_kv's host pools and io paths (docs/API.md, "vLLM offloading spec").

    kv_connector_extra_config: vLLM's own keys (`cpu_bytes_to_use`,
    `eviction_policy`, `store_threshold`, ...) and `portable_kv_io` (one io
    path, or `store=IO,load=IO`; default per vendor: io_paths.py) and
    `portable_kv_numa_node` (an int, or "off"; default the GPU's own node).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.io_request: Any = self.extra_config.get("portable_kv_io")
        self.numa_node: int | str | None = self.extra_config.get("portable_kv_numa_node")

    def _uses_shared_region(self) -> bool:
        # The direct layout keeps each worker's chunks in its own host pools; the canonical one, the node's region.
        return bool(self.config.canonical_layout)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            io = choose_io(backends.current(), self.io_request)
            region = self._node_region(kv_caches) if self.num_chunks > 0 and needs_region(kv_caches, self.config.canonical_layout) else None
            self._worker = PortableKVOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, io,
                                                      canonical_layout=self.config.canonical_layout, numa_node=self.numa_node,
                                                      node_region=region)
        return self._worker

    def _node_region(self, kv_caches: CanonicalKVCaches) -> NodeRegion:
        """The node's region, built by every rank at once over vLLM's worker group (a superset of the
        ranks on this node, as vLLM's own barrier uses): the lowest rank on the node owns it."""
        from vllm.distributed.parallel_state import get_inner_dp_world_group, get_world_group

        check_served(kv_caches, canonical_layout=True, node_region=True)  # before any rank creates or waits
        try:
            group = get_inner_dp_world_group()
        except AssertionError:
            group = get_world_group()
        hosts: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=group.cpu_group)
        node = [rank for rank, host in enumerate(hosts) if host == hosts[group.rank_in_group]]
        replicated = any(ref.mapping.num_writers > 1 for refs in kv_caches.group_data_refs for ref in refs)
        if replicated and len(node) != len(hosts):
            raise NotServed(f"canonical_layout: ranks on {len(set(hosts))} nodes take turns writing the pages they share, and "
                            f"each node's region would miss the turns taken on the others; {OWN_SPEC}")
        return NodeRegion(region_path(self.config.engine_id), self.num_chunks, self.kv_bytes_per_chunk,
                          owner=group.rank_in_group == node[0], barrier=group.barrier,
                          share=(node.index(group.rank_in_group), len(node)))
