"""The canonical layout at TP 2 and TP 4: one region per node, every rank a process writing its runs.

Ranks are spawned processes (rankkit.py), each with its own KV tensors and
rank.  The region must hold, bit for bit, what vLLM 0.33.0's own
CPUOffloadingWorker writes into its shared region for the same stores
(vLLM's worker run here, rank after rank, over its SharedOffloadRegion); each
rank must load back its share of what it stored; a TP-4 engine must load what
a TP-2 engine stored (its canonical pages handed over chunk by chunk); and no
region may be left in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import rankkit
import torch
from rankkit import ATTENTION, BLOCKS_PER_CHUNK, MLA, NUM_CHUNKS, canonical_caches, full_kv, rank_kv, row_bytes, specs
from vllmkit import DeviceLike, SharedOffloadRegion, gpu_worker, vllm_on_host

from portable_kv.engines.vllm import NotServed
from portable_kv.engines.vllm import node_region as node_region_module
from portable_kv.engines.vllm.node_region import NodeRegion, region_path

JOIN_SECONDS = 400.0

# Per job: the blocks of each group (attention, MLA), each group's first logical block, the chunks.
TP2_STORES = [{"blocks": [[3, 7, 9], [4, 5]], "starts": [1, 0], "chunks": [0, 1, 2]},
              {"blocks": [[11, 12], [13]], "starts": [2, 3], "chunks": [3, 4]}]
TP2_LOADS = [{"blocks": [[20, 21, 22], [23, 24]], "starts": [1, 0], "chunks": [0, 1, 2]},
             {"blocks": [[25, 26], [27]], "starts": [2, 3], "chunks": [3, 4]}]
TP4_STORES = [{"blocks": [[1, 2, 30], [6]], "starts": [0, 1], "chunks": [5, 6, 7]}]
TP4_LOADS = [*TP2_LOADS, {"blocks": [[14, 15, 16], [17]], "starts": [0, 1], "chunks": [5, 6, 7]}]


def run_ranks(tp: int, plan: dict, out_dir: Path) -> dict:
    """Spawn the tp ranks, wait for them (bounded), and return rank 0's region snapshot and every rank's KV after the loads."""
    out_dir.mkdir()
    engine_id = f"pkv-test-{uuid.uuid4().hex}"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(tp)
    ranks = [context.Process(target=rankkit.rank_main, args=(rank, tp, plan, barrier, str(out_dir), engine_id)) for rank in range(tp)]
    try:
        for process in ranks:
            process.start()
        deadline = time.monotonic() + JOIN_SECONDS
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        errors = [f"rank {r}: " + (out_dir / f"rank{r}.err").read_text() for r in range(tp) if (out_dir / f"rank{r}.err").exists()]
        assert not errors, "\n".join(errors)
        assert [p.exitcode for p in ranks] == [0] * tp, f"exit codes {[p.exitcode for p in ranks]} (None: still running at {JOIN_SECONDS} s)"
        assert not os.path.exists(region_path(engine_id)), "the owner left the region's name in /dev/shm"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(10)
        if os.path.exists(region_path(engine_id)):
            os.unlink(region_path(engine_id))
    results = [torch.load(out_dir / f"rank{r}.pt") for r in range(tp)]
    return {"region": torch.load(out_dir / "region.pt"), "kv": [r["kv"] for r in results], "written": [r["bytes"] for r in results]}


def vllm_region(tp: int, stores: list[dict], preload: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[dict[int, int]]]:
    """vLLM's own CPUOffloadingWorker at `tp`, rank after rank over one SharedOffloadRegion: its rows after the
    stores, and the bytes each rank's stores wrote."""
    engine_id = f"pkv-vllm-{uuid.uuid4().hex}"
    workers = []
    with pytest.MonkeyPatch.context() as monkeypatch, vllm_on_host(monkeypatch):
        try:
            for rank in range(tp):
                region = SharedOffloadRegion(engine_id, NUM_CHUNKS, rank, row_bytes(tp), row_bytes(tp) // tp)
                caches = canonical_caches(tp, rank, rank_kv(full_kv(), tp, rank), wrap=lambda t: t.as_subclass(DeviceLike))
                workers.append(gpu_worker.CPUOffloadingWorker(caches, BLOCKS_PER_CHUNK, NUM_CHUNKS, mmap_region=region, canonical_layout=True))
            for t, pages in enumerate(preload or []):
                workers[0]._store_handler.dst_tensors[t].copy_(pages.view(torch.int8))
            for worker in workers:
                for job_id, job in enumerate(stores):
                    assert worker.submit_store(job_id, *specs(job))
            written = [{r.job_id: r.transfer_size for r in worker.get_finished()} for worker in workers]
            return workers[0]._mmap_region.base_tensor.view(torch.uint8).view(NUM_CHUNKS, row_bytes(tp)).clone(), written
        finally:
            for worker in workers:
                worker.shutdown()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A TP-2 engine that stores and loads, then a TP-4 engine given its canonical pages that stores and loads more."""
    root = tmp_path_factory.mktemp("node-region")
    tp2 = run_ranks(2, {"preload": None, "stores": TP2_STORES, "loads": TP2_LOADS}, root / "tp2")
    tp4 = run_ranks(4, {"preload": str(root / "tp2" / "region.pt"), "stores": TP4_STORES, "loads": TP4_LOADS}, root / "tp4")
    return {2: tp2, 4: tp4}


def expect_loaded(got: dict, tp: int, rank: int, stores: list[dict], loads: list[dict]) -> None:
    """Each load's blocks hold the rank's shard of the model's KV of the blocks stored to those chunks."""
    want = rank_kv(full_kv(), tp, rank)
    for store, load in zip(stores, loads):
        assert store["chunks"] == load["chunks"] and store["starts"] == load["starts"]
        for names, source, target in zip((ATTENTION, MLA), store["blocks"], load["blocks"]):
            for name in names:
                assert torch.equal(got[name][target], want[name][source]), f"rank {rank} of {tp}, {name}: blocks {target}"


@pytest.mark.parametrize("tp", [2, 4])
def test_the_region_holds_the_canonical_pages_vllms_own_worker_writes(engines, tp):
    preload = engines[2]["region"]["views"] if tp == 4 else None
    want, want_written = vllm_region(tp, TP2_STORES if tp == 2 else TP4_STORES, preload)
    got = engines[tp]["region"]["rows"]
    assert got.shape == want.shape
    assert bool(got.any()), "nothing was stored"
    differ = np.flatnonzero((got != want).numpy().reshape(-1))
    assert differ.size == 0, f"{differ.size} bytes differ from vLLM's region, first at byte {differ[:1]}"
    # Ranks holding the same bytes took the same turns as vLLM's: each rank wrote what vLLM's rank wrote.
    for rank, (got_rank, want_rank) in enumerate(zip(engines[tp]["written"], want_written)):
        assert {j: b for j, b in got_rank.items() if j < 100} == want_rank, f"rank {rank}: bytes written per store"


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_back_its_share_of_what_it_stored(engines, tp):
    stores, loads = (TP2_STORES, TP2_LOADS) if tp == 2 else (TP4_STORES, TP4_LOADS[2:])
    for rank, kv in enumerate(engines[tp]["kv"]):
        expect_loaded(kv, tp, rank, stores, loads)


def test_a_tp4_engine_loads_what_a_tp2_engine_stored(engines):
    for rank, kv in enumerate(engines[4]["kv"]):
        expect_loaded(kv, 4, rank, TP2_STORES, TP4_LOADS[:2])


def test_the_owner_replaces_a_crashed_starts_region_and_leaves_no_name(tmp_path):
    path = region_path(f"pkv-test-{uuid.uuid4().hex}")
    with open(path, "wb") as stale:
        stale.write(b"\xff" * 100)  # a crashed start's region, of another size
    try:
        region = NodeRegion(path, 4, 4096, owner=True, barrier=lambda: None)
        assert not os.path.exists(path)
        assert region.rows().shape == (4, 4096) and not bool(region.rows().any())
        region.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_rank_whose_owner_failed_says_so_and_joins_both_barriers():
    calls = []
    with pytest.raises(RuntimeError, match="owner did not create it"):
        NodeRegion(region_path(f"pkv-test-{uuid.uuid4().hex}"), 4, 4096, owner=False, barrier=lambda: calls.append(1))
    assert len(calls) == 2


class RecordingBackend:
    def __init__(self):
        self.registered, self.unregistered = [], []

    def register_host(self, address: int, nbytes: int) -> int:
        self.registered.append((address, nbytes))
        return address

    def unregister_host(self, address: int) -> None:
        self.unregistered.append(address)


def test_pages_are_locked_lazily_a_segment_at_a_time(monkeypatch):
    monkeypatch.setattr(node_region_module, "PIN_SEGMENT_BYTES", 2 * 4096)
    path = region_path(f"pkv-test-{uuid.uuid4().hex}")
    region = NodeRegion(path, 5, 4096, owner=True, barrier=lambda: None)
    backend = RecordingBackend()
    try:
        assert region.pinned_bytes() == 0
        region.pin(np.array([0, 1, 4]), backend)
        region.pin(np.array([1]), backend)
        base = region.address
        assert backend.registered == [(base, 2 * 4096), (base + 4 * 4096, 4096)]
        assert region.pinned_bytes() == 3 * 4096
    finally:
        region.close(backend)
    assert sorted(backend.unregistered) == [base, base + 4 * 4096]


def test_ranks_that_disagree_on_the_size_are_refused(tmp_path):
    path = region_path(f"pkv-test-{uuid.uuid4().hex}")
    owner = NodeRegion(path, 4, 4096, owner=True, barrier=lambda: None)
    try:
        with pytest.raises(RuntimeError, match="ranks disagree"):
            # The owner's name is gone once every rank has mapped it: recreate one of another size to join.
            with open(path, "wb") as other:
                other.truncate(3 * 4096)
            NodeRegion(path, 4, 4096, owner=False, barrier=lambda: None)
    finally:
        owner.close()
        if os.path.exists(path):
            os.unlink(path)


class OneProcessGroup:
    """vLLM's worker group as the spec asks it (ranks' hosts, this rank, a barrier), over one process."""

    def __init__(self, hosts: list[str], rank: int) -> None:
        self.hosts, self.world_size, self.rank_in_group, self.cpu_group, self.barriers = hosts, len(hosts), rank, None, 0

    def barrier(self) -> None:
        self.barriers += 1


def spec_at_tp2(monkeypatch, hosts: list[str]):
    from dataclasses import replace

    from vllm.distributed import parallel_state
    from vllmkit import Geometry, offloading_config

    from portable_kv.engines.vllm import PortableKVOffloadingSpec

    group = OneProcessGroup(hosts, 0)
    monkeypatch.setattr(parallel_state, "get_inner_dp_world_group", lambda: group)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), hosts))
    geometry = Geometry(pages=[4096, 4096, 18432], groups=[[0, 1], [2]], num_blocks=rankkit.NUM_BLOCKS)
    config = offloading_config(geometry, BLOCKS_PER_CHUNK, cpu_bytes=NUM_CHUNKS * row_bytes(2), canonical_layout=True)
    config = replace(config, canonical_layout=True, engine_id=f"pkv-test-{uuid.uuid4().hex}",
                     parallel=replace(config.parallel, world_size=2, tp_size=2))
    return PortableKVOffloadingSpec(config), group


def test_the_spec_gives_its_worker_the_nodes_region_at_tp2(monkeypatch):
    from portable_kv.engines.vllm.region_tier import RegionTier

    spec, group = spec_at_tp2(monkeypatch, ["node-a", "node-a"])
    assert spec.num_chunks == NUM_CHUNKS and spec.kv_bytes_per_chunk == row_bytes(2)
    worker = spec.get_worker(canonical_caches(2, 0, rank_kv(full_kv(), 2, 0)))
    try:
        assert isinstance(worker.tier, RegionTier) and worker.tier.region.owner
        assert worker.tier.region.nbytes == NUM_CHUNKS * row_bytes(2) and group.barriers == 2
        assert not os.path.exists(region_path(spec.config.engine_id))
    finally:
        worker.shutdown()


def test_shared_pages_across_nodes_are_refused_by_name(monkeypatch):
    spec, _ = spec_at_tp2(monkeypatch, ["node-a", "node-b"])
    with pytest.raises(NotServed, match="2 nodes.*CPUOffloadingSpec"):
        spec.get_worker(canonical_caches(2, 0, rank_kv(full_kv(), 2, 0)))
