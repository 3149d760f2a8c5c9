"""Host chunks and loaded blocks of the spec's worker against vLLM 0.33.0's own CPU worker, byte for byte.

Both run the same stores and loads on the same block tensors (vllmkit.py says
what stands in for CUDA on the host): the spec's chunks must hold exactly the
bytes vLLM's chunks hold (sub-blocks no store names stay as they were: zero
in both), and after the loads every block tensor must be identical, so that a
block no transfer names is untouched in both.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from vllmkit import (
    CROSS_LAYER,
    HYBRID,
    MLA,
    PER_LAYER,
    CPULoadStoreSpec,
    SharedOffloadRegion,
    block_tensors,
    gpu_spec,
    gpu_worker,
    kv_caches,
    vllm_on_host,
    whole_page_mapping,
)

from portable_kv import backends
from portable_kv.engines.vllm import choose_io

NUM_CHUNKS = 16


def scenario(geometry, blocks_per_chunk: int, seed: int):
    """Stores then loads, per group a run of blocks entered `start % blocks_per_chunk` sub-blocks into its first chunk."""
    rng = np.random.default_rng(seed)
    free_blocks = list(rng.permutation(geometry.num_blocks))
    free_chunks = list(rng.permutation(NUM_CHUNKS))
    stores, loads = [], []
    for _ in range(2):
        groups, starts, chunks, targets = [], [], [], []
        for _ in geometry.groups:
            count = int(rng.integers(1, 2 * blocks_per_chunk + 2))
            start = int(rng.integers(0, 3 * blocks_per_chunk))
            used = -(-(count + start % blocks_per_chunk) // blocks_per_chunk)
            groups.append([int(free_blocks.pop()) for _ in range(count)])
            targets.append([int(free_blocks.pop()) for _ in range(count)])
            starts.append(start)
            chunks += [int(free_chunks.pop()) for _ in range(used)]
        stores.append((gpu_spec(groups, starts), CPULoadStoreSpec(chunks)))
        loads.append((CPULoadStoreSpec(chunks), gpu_spec(targets, starts)))
    return stores, loads


def run_vllm(monkeypatch, geometry, tensors, blocks_per_chunk, stores, loads, canonical: bool):
    """vLLM's own CPUOffloadingWorker: its host chunks after the stores, its block tensors after the loads."""
    with vllm_on_host(monkeypatch):
        mappings = {t: whole_page_mapping(page) for t, page in enumerate(geometry.pages)} if canonical else None
        caches = kv_caches(tensors, geometry, mappings, device_like=True)
        region = None
        if canonical:
            row = -(-sum(geometry.pages) * blocks_per_chunk // mmap.PAGESIZE) * mmap.PAGESIZE
            region = SharedOffloadRegion(f"pkv-test-{blocks_per_chunk}", NUM_CHUNKS, 0, row, row)
        worker = gpu_worker.CPUOffloadingWorker(caches, blocks_per_chunk, NUM_CHUNKS, mmap_region=region, canonical_layout=canonical)
        try:
            for job, (src, dst) in enumerate(stores):
                assert worker.submit_store(job, src, dst)
            chunks = [t.clone() for t in worker._store_handler.dst_tensors]
            for job, (src, dst) in enumerate(loads):
                assert worker.submit_load(100 + job, src, dst)
            assert {r.job_id for r in worker.get_finished()} == {0, 1, 100, 101}
            return chunks, [t.clone() for t in tensors]
        finally:
            worker.shutdown()


def run_spec(geometry, tensors, blocks_per_chunk, stores, loads, canonical: bool):
    from portable_kv.engines.vllm import PortableKVOffloadingWorker

    mappings = {t: whole_page_mapping(page) for t, page in enumerate(geometry.pages)} if canonical else None
    worker = PortableKVOffloadingWorker(kv_caches(tensors, geometry, mappings), blocks_per_chunk, NUM_CHUNKS,
                                        choose_io(backends.current(), None), canonical_layout=canonical)
    try:
        for t in range(len(tensors)):
            worker.tier.chunk_view(t).zero_()  # vLLM's chunks start as zeros
        for job, (src, dst) in enumerate(stores):
            assert worker.submit_store(job, src, dst)
        chunks = [worker.tier.chunk_view(t).view(torch.int8).clone() for t in range(len(tensors))]
        for job, (src, dst) in enumerate(loads):
            assert worker.submit_load(100 + job, src, dst, expedited=job == 1)
        finished = worker.get_finished()
        assert [r.job_id for r in finished] == [0, 1, 100, 101]
        return chunks, [t.clone() for t in tensors], finished
    finally:
        worker.shutdown()


@pytest.mark.parametrize("canonical", [False, True], ids=["direct", "canonical"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
@pytest.mark.parametrize("geometry", [PER_LAYER, CROSS_LAYER, HYBRID, MLA], ids=["per-layer", "cross-layer", "hybrid", "mla"])
def test_chunks_and_loaded_blocks_are_vllms(monkeypatch, geometry, blocks_per_chunk, canonical):
    stores, loads = scenario(geometry, blocks_per_chunk, seed=blocks_per_chunk)
    original = block_tensors(geometry)
    want_chunks, want_blocks = run_vllm(monkeypatch, geometry, [t.clone() for t in original], blocks_per_chunk, stores, loads, canonical)
    got_chunks, got_blocks, finished = run_spec(geometry, [t.clone() for t in original], blocks_per_chunk, stores, loads, canonical)

    for t, (got, want) in enumerate(zip(got_chunks, want_chunks)):
        assert got.shape == want.shape, f"tensor {t}"
        assert torch.equal(got, want), f"tensor {t}: host chunks differ from vLLM's"
    assert any(bool(c.any()) for c in got_chunks)
    for t, (got, want) in enumerate(zip(got_blocks, want_blocks)):
        assert torch.equal(got, want), f"tensor {t}: blocks after the loads differ from vLLM's"
    # Round trip: each loaded block is the block stored from, bit for bit.
    for (store, _), (_, load) in zip(stores, loads):
        for t in {t for group in geometry.groups for t in group}:
            groups_with_t = [g for g, group in enumerate(geometry.groups) if t in group]
            src, dst = np.split(store.block_ids, np.cumsum(store.group_sizes)[:-1]), np.split(load.block_ids, np.cumsum(load.group_sizes)[:-1])
            for g in groups_with_t:
                assert torch.equal(got_blocks[t][torch.from_numpy(dst[g]).long()], original[t][torch.from_numpy(src[g]).long()])
    sizes = {r.job_id: r.transfer_size for r in finished}
    per_block = [sum(geometry.pages[t] for t in group) for group in geometry.groups]
    assert sizes[0] == sum(n * b for n, b in zip(stores[0][0].group_sizes, per_block))
