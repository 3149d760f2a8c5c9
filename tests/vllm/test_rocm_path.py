"""On AMD the spec moves blocks with portable_kv's copy kernel, never the batched memcpy that ROCm loops.

The ROCm backend runs over the fake HIP runtime of tests/fake_runtimes.py (its
device the CPU, every runtime call recorded), as tests/unit/test_vendor_dispatch.py
does: a store and a load of vLLM blocks through the spec's worker launch the
copy kernel and call neither hipMemcpyBatchAsync nor a hipMemcpyAsync per block.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm 0.33.0 is not installed here (tox -e vllm installs it)")

from vllmkit import PER_LAYER, CPULoadStoreSpec, block_tensors, gpu_spec, kv_caches, offloading_config  # noqa: E402

from portable_kv.engines.vllm import NotServed  # noqa: E402

COPY_CALLS = ("hipMemcpyBatchAsync", "hipMemcpyAsync", "hipMemcpy2DAsync")


@pytest.fixture
def rocm_bound(fake_rocm_bound):
    return fake_rocm_bound[1]  # the fake HIP library, whose calls the tests read


def test_the_spec_takes_the_copy_kernel_on_rocm(rocm_bound):
    lib = rocm_bound
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(offloading_config(PER_LAYER, 4, cpu_bytes=1 << 20))
    worker = spec.get_worker(kv_caches(block_tensors(PER_LAYER), PER_LAYER))
    assert worker.tier.io == {"store": "kernel", "load": "kernel"}
    lib.calls.clear()
    assert worker.submit_store(0, gpu_spec([list(range(8))], [0]), CPULoadStoreSpec([3, 5]))
    assert worker.submit_load(1, CPULoadStoreSpec([3, 5]), gpu_spec([list(range(20, 28))], [0]))
    names = [name for name, _ in lib.calls]
    assert names.count("hipModuleLaunchKernel") == 2  # one launch a transfer: four layers of eight blocks each
    assert not [name for name in names if name in COPY_CALLS]
    worker.shutdown()


@pytest.mark.parametrize("io", ["direct", "staged", "auto", "store=kernel,load=direct"])
def test_batched_copy_paths_are_refused_on_rocm(rocm_bound, io):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(offloading_config(PER_LAYER, 1, cpu_bytes=1 << 20, portable_kv_io=io))
    with pytest.raises(NotServed, match="hipMemcpyBatchAsync.*CPUOffloadingSpec"):
        spec.get_worker(kv_caches(block_tensors(PER_LAYER), PER_LAYER))
