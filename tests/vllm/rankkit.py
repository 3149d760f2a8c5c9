"""Tensor-parallel ranks of one engine on the CPU, each a process of its own, for the node region's tests.

A small model: two attention layers of 2 KV heads (one KV cache group) and
one MLA layer (another group).  Every rank derives its KV tensors from one
full, unsharded KV of the model (its head shard, as vLLM shards KV heads; the
whole latent for MLA) and its canonical page mappings with vLLM's own
`derive_canonical_mappings`; at TP 4 two ranks hold each KV head, at any TP
every rank holds the latent, so both take turns by block id.
`rank_main` is what one rank runs: build the node region and the spec's worker
as PortableKVOffloadingSpec does, optionally fill chunks with canonical pages
stored earlier (by rank 0), store, snapshot the region, load.  Every wait is
bounded; a rank that fails writes its traceback and breaks the barrier.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import SimpleNamespace

import torch

BLOCK_TOKENS, HEAD_SIZE, TOTAL_KV_HEADS, MLA_ROW = 16, 64, 2, 576
NUM_BLOCKS, NUM_CHUNKS, BLOCKS_PER_CHUNK = 32, 8, 2
ATTENTION, MLA = ("attn.0", "attn.1"), ("mla.0",)
BARRIER_SECONDS = 240.0


def full_kv(seed: int = 7) -> dict[str, torch.Tensor]:
    """The model's KV before any parallelism: attention (blocks, K|V, tokens, heads, head_size), MLA (blocks, tokens, row)."""
    gen = torch.Generator().manual_seed(seed)
    kv = {name: torch.randn(NUM_BLOCKS, 2, BLOCK_TOKENS, TOTAL_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16) for name in ATTENTION}
    kv.update({name: torch.randn(NUM_BLOCKS, BLOCK_TOKENS, MLA_ROW, generator=gen).to(torch.bfloat16) for name in MLA})
    return kv


def rank_kv(full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of `tp` holds, as vLLM shards it: KV heads split (replicated where fewer than tp), latent whole."""
    heads = max(1, TOTAL_KV_HEADS // tp)
    shard = rank // max(1, tp // TOTAL_KV_HEADS) if tp > TOTAL_KV_HEADS else rank
    kv = {name: full[name][:, :, :, shard * heads : (shard + 1) * heads].contiguous() for name in ATTENTION}
    kv.update({name: full[name].clone() for name in MLA})
    return kv


def row_bytes(tp: int) -> int:
    """vLLM's kv_bytes_per_chunk at this TP (one copy a rank, page aligned)."""
    per_block = sum(t.nbytes // NUM_BLOCKS for t in rank_kv(full_kv(), tp, 0).values())
    return -(-per_block * tp * BLOCKS_PER_CHUNK // 4096) * 4096


def canonical_caches(tp: int, rank: int, kv: dict[str, torch.Tensor], wrap=lambda t: t):
    """vLLM's CanonicalKVCaches of one rank, its mappings from vLLM's derive_canonical_mappings."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.kv_offload import base

    attention = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=max(1, TOTAL_KV_HEADS // tp), head_size=HEAD_SIZE, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=MLA_ROW, dtype=torch.bfloat16)
    parallel = SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, world_size=tp, decode_context_parallel_size=1,
                               cp_kv_cache_interleave_size=1, rank=rank)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(get_total_num_kv_heads=lambda: TOTAL_KV_HEADS))
    groups = [SimpleNamespace(kv_cache_spec=attention, layer_names=list(ATTENTION)), SimpleNamespace(kv_cache_spec=mla, layer_names=list(MLA))]
    mappings = derive_canonical_mappings(vllm_config, SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=groups), kv)
    names = [*ATTENTION, *MLA]
    tensors = [base.CanonicalKVCacheTensor(wrap(kv[n].view(torch.int8).view(NUM_BLOCKS, -1)), kv[n].nbytes // NUM_BLOCKS) for n in names]
    refs = [[base.CanonicalKVCacheRef(names.index(n), kv[n].nbytes // NUM_BLOCKS, mappings[n]) for n in group.layer_names] for group in groups]
    return base.CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def specs(job: dict):
    """vLLM's specs of a job `{"blocks": [per group], "starts": [per group], "chunks": [...]}`: (GPU spec, CPU spec)."""
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    flat = [b for blocks in job["blocks"] for b in blocks]
    return base.GPULoadStoreSpec(flat, [len(b) for b in job["blocks"]], list(job["starts"])), CPULoadStoreSpec(job["chunks"])


def rank_main(rank: int, tp: int, plan: dict, barrier, out_dir: str, engine_id: str) -> None:
    """One rank: plan = {"preload": path or None, "stores": [job], "loads": [job]} (module docstring)."""
    try:
        from portable_kv import backends
        from portable_kv.engines.vllm import PortableKVOffloadingWorker, choose_io
        from portable_kv.engines.vllm.node_region import NodeRegion, region_path

        def wait() -> None:
            barrier.wait(BARRIER_SECONDS)

        kv = rank_kv(full_kv(), tp, rank)
        caches = canonical_caches(tp, rank, kv)
        region = NodeRegion(region_path(engine_id), NUM_CHUNKS, row_bytes(tp), owner=rank == 0, barrier=wait, share=(rank, tp))
        worker = PortableKVOffloadingWorker(caches, BLOCKS_PER_CHUNK, NUM_CHUNKS, choose_io(backends.current(), None),
                                            canonical_layout=True, node_region=region)
        try:
            if plan["preload"] is not None and rank == 0:
                for t, pages in enumerate(torch.load(plan["preload"])["views"]):
                    worker.tier.chunk_view(t).copy_(pages)
            wait()
            for job_id, job in enumerate(plan["stores"]):
                gpu, cpu = specs(job)
                assert worker.submit_store(job_id, gpu, cpu)
            wait()
            if rank == 0:
                views = [worker.tier.chunk_view(t).clone() for t in range(len(caches.tensors))]
                torch.save({"views": views, "rows": worker.tier.region.rows().clone()}, os.path.join(out_dir, "region.pt"))
            for job_id, job in enumerate(plan["loads"]):
                gpu, cpu = specs(job)
                assert worker.submit_load(100 + job_id, cpu, gpu)
            finished = {r.job_id: r.transfer_size for r in worker.get_finished()}
            assert set(finished) == set(range(len(plan["stores"]))) | {100 + j for j in range(len(plan["loads"]))}, finished
            torch.save({"kv": kv, "bytes": finished}, os.path.join(out_dir, f"rank{rank}.pt"))
        finally:
            worker.shutdown()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as err:
            err.write(traceback.format_exc())
        barrier.abort()
        sys.exit(1)
