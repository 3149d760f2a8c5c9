"""What vLLM's own connector reports of the spec's transfers: its worker's `TransferResult`s carry
the bytes and seconds vLLM's `OffloadingConnectorWorker` records for its metrics
(`vllm:kv_offload_store_bytes`, `vllm:kv_offload_load_bytes`, their times and sizes), and the
host tier's pools count the same bytes in `stats()`, per io path.  On the CPU backend."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker", reason="vLLM's connector worker does not import here")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
    TransferStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllmkit import PER_LAYER, CPULoadStoreSpec, gpu_spec, kv_caches, offloading_config  # noqa: E402

BLOCKS_PER_CHUNK = 4


def run_until_done(connector: OffloadingConnectorWorker, jobs: set[int], stats: TransferStats, timeout_s: float = 30.0) -> None:
    """Poll vLLM's connector as its steps do, gathering the transfer stats it hands its scheduler."""
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    while not jobs <= done:
        connector.get_finished(set())
        meta = connector.build_connector_worker_meta()
        if meta:
            done |= set(meta.completed_jobs)
            stats.load, stats.store = stats.load.aggregate(meta.transfer_stats.load), stats.store.aggregate(meta.transfer_stats.store)
        assert time.monotonic() < deadline, f"jobs {jobs - done} never finished"


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_vllm_metrics_count_the_spec_transfers_and_the_pools_agree(io):
    geometry = PER_LAYER
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randint(-128, 128, (geometry.num_blocks, p), dtype=torch.int8, generator=gen) for p in geometry.pages]
    spec = OffloadingSpecFactory.create_spec(offloading_config(geometry, BLOCKS_PER_CHUNK, cpu_bytes=16 << 20, portable_kv_io=io))
    connector = OffloadingConnectorWorker(spec, None, None)
    connector._init_worker(kv_caches(tensors, geometry))
    tier = connector.worker.tier
    try:
        blocks = [3, 4, 5, 9, 10]
        stats = TransferStats()
        store = TransferJob("r0", gpu_spec([blocks], [0]), CPULoadStoreSpec([0, 1]))
        connector.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: store}))
        connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
        run_until_done(connector, {1}, stats)
        load = TransferJob("r1", CPULoadStoreSpec([0, 1]), gpu_spec([[20, 21, 22, 23, 24]], [0]))
        connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={}))
        run_until_done(connector, {2}, stats)

        moved = len(blocks) * sum(geometry.pages)
        assert (stats.store.bytes, stats.store.sizes) == (moved, [moved])
        assert (stats.load.bytes, stats.load.sizes) == (moved, [moved])
        assert stats.store.time > 0 and stats.load.time > 0
        pools = tier.stats()
        assert sum(p["backup"][io]["bytes"] for p in pools if io in p["backup"]) == moved
        assert sum(p["load"][io]["bytes"] for p in pools if io in p["load"]) == moved
        assert all(p["last_error"] is None for p in pools)
    finally:
        connector.shutdown()
