"""The spec as vLLM 0.33.0 loads and drives it: its factory, its scheduler-side manager, the worker contract, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm 0.33.0 is not installed here (tox -e vllm installs it)")

import torch  # noqa: E402
from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllmkit import (  # noqa: E402
    CROSS_LAYER,
    HYBRID,
    PER_LAYER,
    CPULoadStoreSpec,
    block_tensors,
    gpu_spec,
    kv_caches,
    offloading_config,
    whole_page_mapping,
)

from portable_kv import backends  # noqa: E402
from portable_kv.engines.vllm import NotServed, choose_io  # noqa: E402


def test_the_factory_loads_the_spec_by_name():
    config = offloading_config(PER_LAYER, 1, cpu_bytes=1 << 20)
    from portable_kv.engines.vllm import PortableKVOffloadingSpec

    assert OffloadingSpecFactory.get_spec_cls(config.extra_config) is PortableKVOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, PortableKVOffloadingSpec) and isinstance(spec, CPUOffloadingSpec)
    # vLLM's own sizing: cpu_bytes_to_use over page-aligned chunks of every group's block bytes.
    assert spec.num_chunks == (1 << 20) // 8192 and not spec.replicated_layout


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_a_request_through_vllms_manager_and_the_spec_worker(blocks_per_chunk):
    geometry = CROSS_LAYER
    spec = OffloadingSpecFactory.create_spec(offloading_config(geometry, blocks_per_chunk, cpu_bytes=64 * 8192 * blocks_per_chunk))
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    tensors = block_tensors(geometry)
    before = tensors[0].clone()
    worker = spec.get_worker(kv_caches(tensors, geometry))
    request = base.ReqContext(req_id="r0")
    manager.on_new_request(request)
    keys = [base.make_offload_key(bytes([k]) * 16, 0) for k in range(3)]  # three chunks of a prompt
    assert [manager.lookup(k, request) for k in keys] == [base.LookupResult.MISS] * 3

    stored = manager.prepare_store(keys, request)
    assert stored.keys_to_store == keys and isinstance(stored.store_spec, CPULoadStoreSpec)
    assert manager.lookup(keys[0], request) == base.LookupResult.HIT_PENDING
    source = list(range(5, 5 + 3 * blocks_per_chunk))
    assert worker.submit_store(1, gpu_spec([source], [0]), stored.store_spec)
    worker.wait({1})
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, len(source) * geometry.pages[0])]
    manager.complete_store(keys, request)
    assert [manager.lookup(k, request) for k in keys] == [base.LookupResult.HIT] * 3
    assert [e.removed for e in manager.take_events()] == [False]

    load_spec = manager.prepare_load(keys[1:], request)  # a later request already has the first chunk
    target = list(range(60, 60 + 2 * blocks_per_chunk))
    assert worker.submit_load(2, load_spec, gpu_spec([target], [blocks_per_chunk]))
    worker.wait({2})
    assert [r.job_id for r in worker.get_finished()] == [2]
    manager.complete_load(keys[1:], request)

    assert torch.equal(tensors[0][target], before[source[blocks_per_chunk:]])
    untouched = [b for b in range(geometry.num_blocks) if b not in target]
    assert torch.equal(tensors[0][untouched], before[untouched])
    worker.shutdown()


def test_refused_by_name_at_start_up():
    tensors = block_tensors(PER_LAYER)
    io = choose_io(backends.current(), None)
    from portable_kv.engines.vllm import PortableKVOffloadingWorker

    padded = kv_caches(tensors, PER_LAYER)
    padded.group_data_refs[0][1].page_size_bytes = 2000
    with pytest.raises(NotServed, match="padded pages.*CPUOffloadingSpec"):
        PortableKVOffloadingWorker(padded, 1, 8, io)

    shared = kv_caches(tensors, PER_LAYER, {t: whole_page_mapping(2048) for t in range(4)})
    sharded = base.CanonicalPageMapping(4096, 2048, (base.CopyRun(0, 0, 64, 32, 64, 128),), 1, 0, True)  # half of each token row
    shared.group_data_refs[0][2].mapping = sharded
    with pytest.raises(NotServed, match="canonical_layout.*node.s host region.*given none"):
        PortableKVOffloadingWorker(shared, 1, 8, io, canonical_layout=True)
    with pytest.raises(NotServed, match="canonical_layout"):
        PortableKVOffloadingWorker(kv_caches(tensors, PER_LAYER), 1, 8, io, canonical_layout=True)  # uncertified pages

    strided = kv_caches([t[:, :1024] for t in tensors], PER_LAYER)
    for ref in strided.group_data_refs[0]:
        ref.page_size_bytes = 1024
    for t in strided.tensors:
        t.page_size_bytes = 1024
    with pytest.raises(NotServed, match="not back to back"):
        PortableKVOffloadingWorker(strided, 1, 8, io)
    with pytest.raises(NotServed, match="cpu_bytes_to_use"):
        PortableKVOffloadingWorker(kv_caches(tensors, PER_LAYER), 1, 0, io)


class _Backend:
    def __init__(self, vendor, offered):
        self.vendor, self.io_backends, self.name = vendor, offered, vendor


def test_io_paths_per_vendor():
    both = ("kernel", "direct", "staged", "auto")
    assert choose_io(_Backend("nvidia", both), None) == {"store": "auto", "load": "auto"}
    assert choose_io(_Backend("nvidia", both), "store=direct,load=kernel") == {"store": "direct", "load": "kernel"}
    assert choose_io(_Backend("amd", both), None) == {"store": "kernel", "load": "kernel"}
    assert choose_io(_Backend("amd", (*both, "bulk")), "bulk") == {"store": "bulk", "load": "bulk"}
    for io in ("direct", "staged", "auto", "store=kernel,load=direct"):
        with pytest.raises(NotServed, match="hipMemcpyBatchAsync"):
            choose_io(_Backend("amd", both), io)
    with pytest.raises(ValueError, match="offered"):
        choose_io(_Backend("nvidia", both), "bulk")
    with pytest.raises(ValueError, match="store and load"):
        choose_io(_Backend("nvidia", both), "store=direct")


def test_the_package_imports_without_importing_vllm():
    code = "import sys, portable_kv.engines.vllm as m; assert 'vllm' not in sys.modules, 'vllm imported'; print(m.VLLM_VERSION)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.33.0"


def test_each_job_is_prepared_once_a_pool_and_stores_are_off_the_critical_path(monkeypatch):
    from portable_kv.engines.vllm import PortableKVOffloadingWorker
    from portable_kv.mla import MLAHostPool

    asked = []
    prepare = MLAHostPool.prepare

    def recording(pool, device_pool, host_indices, device_indices, io_backend=None, background=False):
        asked.append((pool.kv_buffer.shape[-1], len(host_indices), background))
        return prepare(pool, device_pool, host_indices, device_indices, io_backend, background)

    monkeypatch.setattr(MLAHostPool, "prepare", recording)
    geometry = HYBRID  # two page sizes: two pools; group 1 uses tensors of both
    tensors = block_tensors(geometry)
    worker = PortableKVOffloadingWorker(kv_caches(tensors, geometry), 1, 16, choose_io(backends.current(), None))
    try:
        assert worker.submit_store(0, gpu_spec([[1, 2], [3, 4, 5]], [0, 0]), CPULoadStoreSpec([0, 1, 2, 3, 4]))
        stores, asked[:] = list(asked), []
        assert worker.submit_load(1, CPULoadStoreSpec([0, 1, 2, 3, 4]), gpu_spec([[10, 11], [12, 13, 14]], [0, 0]))
        # One plan per pool and set of layers: group 0's layers 0-1 and group 1's layers 1-2 of the 2048-byte pool,
        # group 1's layer of the 1024-byte pool.
        assert sorted(stores) == [(1024, 3, True), (2048, 2, True), (2048, 3, True)]
        assert sorted(asked) == sorted((page, n, False) for page, n, _ in stores)
        assert torch.equal(tensors[3][[12, 13, 14]], tensors[3][[3, 4, 5]])
    finally:
        worker.shutdown()


def test_each_layer_name_finds_its_slots_one_a_layer_or_all_of_a_packed_tensor():
    from portable_kv.engines.vllm import HostTier
    from portable_kv.engines.vllm.host_tier import Slot

    io = choose_io(backends.current(), None)
    tier = HostTier(kv_caches(block_tensors(HYBRID), HYBRID), 1, 4, io)
    try:
        # Tensors 0-2 (2048-byte pages) are layers 0-2 of pool 0, tensor 3 (1024) layer 0 of pool 1.
        assert tier.layer_slots([["a.0", "a.1"], ["b.0", "b.1", "b.2"]]) == {
            "a.0": (Slot(0, 0),), "a.1": (Slot(0, 1),), "b.0": (Slot(0, 1),), "b.1": (Slot(0, 2),), "b.2": (Slot(1, 0),)}
        with pytest.raises(ValueError, match="group_layer_names: expected 2 groups, got 1"):
            tier.layer_slots([["a.0", "a.1"]])
    finally:
        tier.close()
    packed = HostTier(kv_caches(block_tensors(CROSS_LAYER), CROSS_LAYER), 1, 4, io)
    try:
        # One tensor holds every layer's block: each layer's KV lands with the whole block.
        assert packed.layer_slots([[f"layer.{i}" for i in range(4)]]) == {f"layer.{i}": (Slot(0, 0),) for i in range(4)}
    finally:
        packed.close()
