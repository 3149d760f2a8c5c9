"""vLLM 0.33.0's worker-side connector moving CUDA KV blocks through portable_kv's offloading spec.

vLLM's own `OffloadingConnectorWorker` gets the spec's worker (built by vLLM's
factory from kv_connector_extra_config) over CUDA block tensors, as
register_kv_caches hands them over, and is driven with the connector metadata
its scheduler sends: store jobs (deferred to the next step, as vLLM does),
then sync and async load jobs into other blocks, finished through its
get_finished.  For each io path the backend offers: every loaded block is the
block stored from, bit for bit; no other block changes; each host chunk holds
its blocks at their sub-block offsets, as vLLM's own CPU worker lays them out.

Skipped, with the reason, without a CUDA GPU or without vllm importable
(`bash tools/fetch_gpu_wheels.sh --vllm` fetches vLLM's Python files for an
offline GPU host; its compiled ops are not loaded: portable_kv moves every byte).
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from portable_kv import backends

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm 0.33.0 is not importable here (tools/fetch_gpu_wheels.sh --vllm)")
# vLLM's CUDA platform imports its compiled op library at import; the wheel cut to its Python files
# has none, and nothing on the offloading path calls those ops: an empty module stands in for it.
if importlib.util.find_spec("vllm._C_stable_libtorch") is None:
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker", reason="vLLM's connector worker does not import here")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllmkit import CROSS_LAYER, HYBRID, PER_LAYER, CPULoadStoreSpec, gpu_spec, kv_caches, offloading_config  # noqa: E402

BLOCKS_PER_CHUNK = 4


def finish(connector: OffloadingConnectorWorker, jobs: set[int], timeout_s: float = 30.0) -> None:
    """Poll vLLM's connector until its worker reports every job, as vLLM's steps do."""
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    while not jobs <= done:
        connector.get_finished(set())
        meta = connector.build_connector_worker_meta()
        done |= set(meta.completed_jobs) if meta else set()
        assert time.monotonic() < deadline, f"jobs {jobs - done} never finished"


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [PER_LAYER, CROSS_LAYER, HYBRID], ids=["per-layer", "cross-layer", "hybrid"])
@pytest.mark.parametrize("io", backends.current().io_backends)
def test_vllm_connector_moves_cuda_blocks_bit_exact(geometry, io):
    device = backends.current().device
    gen = torch.Generator().manual_seed(7)
    original = [torch.randint(-128, 128, (geometry.num_blocks, p), dtype=torch.int8, generator=gen) for p in geometry.pages]
    tensors = [t.to(device) for t in original]
    spec = OffloadingSpecFactory.create_spec(offloading_config(geometry, BLOCKS_PER_CHUNK, cpu_bytes=64 << 20, portable_kv_io=io))
    connector = OffloadingConnectorWorker(spec, None, None)  # vLLM's configs are read by register_kv_caches only
    connector._init_worker(kv_caches(tensors, geometry))
    tier = connector.worker.tier

    per_group = 2 * BLOCKS_PER_CHUNK - 1  # a partial last chunk
    sources = [list(range(g * 20 + 1, g * 20 + 1 + per_group)) for g in range(len(geometry.groups))]
    targets = [list(range(60 + g * 12, 60 + g * 12 + per_group)) for g in range(len(geometry.groups))]
    chunks = list(range(2 * len(geometry.groups)))
    store = TransferJob("r0", gpu_spec(sources, [0] * len(sources)), CPULoadStoreSpec(chunks))
    connector.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: store}))
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))  # the next step submits the store
    finish(connector, {1})

    for g, group in enumerate(geometry.groups):
        for t in group:
            host = tier.chunk_view(t).view(torch.int8).reshape(-1, geometry.pages[t])
            rows = [chunks[2 * g + i // BLOCKS_PER_CHUNK] * BLOCKS_PER_CHUNK + i % BLOCKS_PER_CHUNK for i in range(per_group)]
            assert torch.equal(host[rows], original[t][sources[g]]), f"group {g} tensor {t}: host chunk bytes"

    half = [targets[g][:3] for g in range(len(targets))], [targets[g][3:] for g in range(len(targets))]
    loads = {
        2: TransferJob("r1", CPULoadStoreSpec([chunks[2 * g] for g in range(len(targets))]), gpu_spec(half[0], [0] * len(targets)), sync=True),
        3: TransferJob("r2", CPULoadStoreSpec(chunks), gpu_spec(half[1], [3] * len(targets))),
    }
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=loads, store_jobs={}))
    finish(connector, {2, 3})
    torch.cuda.synchronize()

    moved = {t: set() for t in range(len(tensors))}
    for g, group in enumerate(geometry.groups):
        for t in group:
            assert torch.equal(tensors[t][targets[g]].cpu(), original[t][sources[g]]), f"group {g} tensor {t}: loaded blocks"
            moved[t] |= set(targets[g])
    for t, tensor in enumerate(tensors):
        untouched = [b for b in range(geometry.num_blocks) if b not in moved[t]]
        assert torch.equal(tensor[untouched].cpu(), original[t][untouched]), f"tensor {t}: a block no transfer names changed"
    connector.shutdown()
