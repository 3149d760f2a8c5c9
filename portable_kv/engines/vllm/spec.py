"""PortableKVOffloadingSpec: vLLM 0.33.0's CPU offloading spec, its worker moving bytes with portable_kv.

It is vLLM's `CPUOffloadingSpec` for everything the scheduler sees (chunk
sizing from `cpu_bytes_to_use`, the manager with its LRU/ARC policies, store
threshold, events and metrics), with two changes on the worker side:
`get_worker` builds `PortableKVOffloadingWorker`, whose host chunks live in
portable_kv host pools (page-locked, on the GPU's NUMA node), and each worker
keeps its own chunks, as vLLM's spec does wherever it has no shared region
(`replicated_layout` off: an MLA model under tensor parallelism keeps one copy
a rank, and the manager sizes chunks for that).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ... import backends
from .io_paths import choose_io
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
        # Each worker's chunks are its own host pools: no rank reads another's bytes.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            io = choose_io(backends.current(), self.io_request)
            self._worker = PortableKVOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, io,
                                                      canonical_layout=self.config.canonical_layout, numa_node=self.numa_node)
        return self._worker
