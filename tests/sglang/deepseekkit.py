"""DeepSeek-V3's HiCache stack, built by SGLang 0.5.23's own functions on the scheduler's path, and one
write/free/load/evict cycle through its radix tree.

The model's config.json is published as SGLang's runtime context, so SGLang's argument hooks run on it
(for MLA models they rewrite kernel io with page_first_direct to direct io, and direct io with
page_first to page_first_direct); `ModelConfig` gives `AttentionArch.MLA`; the KV-cache configurator
(mimokit's, with `use_mla_backend=True`) builds the `MLATokenToKVPool` of `kv_lora_rank +
qk_rope_head_dim` elements per token and layer, and the NextN draft runner its one-layer pool; the
speculative worker's draft plan packs it; the tree-cache factory builds SGLang's UnifiedRadixCache,
whose `init_hicache` has `attach_hybrid_pool_to_unified_cache` pick the plain-KV strategy:
`build_kv_only_stack` builds the MLA host pool and SGLang's HybridCacheController.

`run_cycle(stack)` caches a request's prefix (write-through backs it up), evicts it from the device,
has a new request for the prompt load it back layer by layer as a forward pass waits for each layer,
and evicts it from device and host, checking every target and draft layer byte for byte.
"""

from __future__ import annotations

import contextlib
import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from mimokit import build_tree_cache, hicache_draft_plan, kv_cache_configurator, poll, radix_key
from mlakit import DTYPES, CpuMlaKvcacheio, fill, same

PAGE = 4
ATTN_TP = 2  # MLA keeps its latent whole on every TP rank: both ranks hold the same pages
MAX_TOTAL_TOKENS = 256
CONTEXT_LENGTH = 2048
HICACHE_RATIO = 2.0
POLL_TIMEOUT = 60.0
# DeepSeek-V3's config.json (huggingface.co/deepseek-ai/DeepSeek-V3) with 61 layers scaled to 3; every
# other value is the checkpoint's.  The latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
}
LAYERS = DEEPSEEK_V3_CONFIG["num_hidden_layers"]
KV_CACHE_DIM = DEEPSEEK_V3_CONFIG["kv_lora_rank"] + DEEPSEEK_V3_CONFIG["qk_rope_head_dim"]
KV_CACHE_DTYPE_FLAGS = {"bf16": "auto", "fp8": "fp8_e4m3"}


def write_model_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    return directory


def server_args(model_dir: Path, layout: str, io: str, *, dtype: str = "bf16", mtp: bool = False, storage_dir: Path | None = None):
    """What `sglang serve` of the scaled model would be launched with: TP 2, HiCache, optionally NextN MTP and a file tier."""
    from sglang.srt.server_args import ServerArgs

    fields = {}
    if mtp:
        # DeepSeek's NextN layer serves as EAGLE's draft model (one draft runner, one layer).
        fields.update(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    if storage_dir is not None:
        fields.update(hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"file_storage_path": str(storage_dir)}))
    return ServerArgs(model_path=str(model_dir), device="cpu", dtype="bfloat16", kv_cache_dtype=KV_CACHE_DTYPE_FLAGS[dtype], tp_size=ATTN_TP,
                      page_size=PAGE, context_length=CONTEXT_LENGTH, max_total_tokens=MAX_TOTAL_TOKENS, enable_hierarchical_cache=True,
                      hicache_ratio=HICACHE_RATIO, hicache_mem_layout=layout, hicache_io_backend=io, hicache_write_policy="write_through", **fields)


def publish(args, tp_rank: int = 0) -> None:
    """Resolve `args` (SGLang's argument hooks run here) and publish them as one TP rank's runtime context."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    publish(args, role="test", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=None))


@dataclass
class DeepSeekStack:
    """DeepSeek-V3's HiCache stack for one TP rank, as SGLang builds it."""

    layout: str
    io: str
    dtype: str
    tp_rank: int
    model_config: Any
    kvcache: Any  # MLATokenToKVPool
    drafts: tuple  # the NextN draft runner's one-layer MLATokenToKVPool, with MTP
    allocator: Any
    req_to_token_pool: Any
    tree: Any  # UnifiedRadixCache
    controller: Any  # HybridCacheController
    host: Any  # the MLA host pool, the group's anchor
    _exit: contextlib.ExitStack = field(repr=False)

    def device_buffers(self) -> list[torch.Tensor]:
        return [*self.kvcache.kv_buffer, *(draft.kv_buffer[0] for draft in self.drafts)]

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> DeepSeekStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_stack(workdir: Path, layout: str, io: str, *, dtype: str = "bf16", mtp: bool = False, installed: bool = True, tp_rank: int = 0,
                storage_dir: Path | None = None) -> DeepSeekStack:
    """Build DeepSeek-V3's HiCache stack for `tp_rank` the way SGLang's scheduler does, on the CPU.

    `installed` puts portable_kv in first (and takes it out on close); otherwise the host pool is
    SGLang's own, moved by `CpuMlaKvcacheio`.  `storage_dir` attaches SGLang's HiCacheFile tier there.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.runtime_context import get_memory, reset_context

    import portable_kv.engines.sglang as pk_sglang

    exit_stack = contextlib.ExitStack()
    try:
        args = server_args(write_model_config(workdir / "DeepSeek-V3-3L"), layout, io, dtype=dtype, mtp=mtp, storage_dir=storage_dir)
        publish(args, tp_rank)
        exit_stack.callback(reset_context)
        kv_dtype = {"kv_cache_dtype": DTYPES[dtype], "kv_cache_dtype_str": KV_CACHE_DTYPE_FLAGS[dtype], "use_mla_backend": True}
        model_config = ModelConfig.from_server_args(args)
        target = kv_cache_configurator(args, model_config, "cpu", **kv_dtype).configure(pre_model_load_memory=0)
        drafts, draft_plan = (), None
        if mtp:
            draft_config = ModelConfig.from_server_args(args, is_draft_model=True)
            drafts = (kv_cache_configurator(args, draft_config, "cpu", target=target, **kv_dtype).configure(pre_model_load_memory=0).token_to_kv_pool,)
            draft_plan, packed = hicache_draft_plan(target, drafts, draft_config)
            assert packed == drafts, "SGLang packs DeepSeek's NextN draft into the target's host pool"
        kvcache, allocator = target.token_to_kv_pool, target.token_to_kv_pool_allocator
        ops = None
        if installed:
            pk_sglang.install()
            exit_stack.callback(pk_sglang.uninstall)
        else:
            ops = CpuMlaKvcacheio(*kvcache.kv_buffer, *(d.kv_buffer[0] for d in drafts)).bind(exit_stack)
            registered = common._cuda_host_register
            common._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None
            exit_stack.callback(setattr, common, "_cuda_host_register", registered)

        tree, _ = build_tree_cache(args, model_config, target, draft_plan, drafts, exit_stack, "DeepSeek-V3")
        host = tree.host_pool_group.anchor_entry.host_pool
        if ops is not None:
            ops.register(*host.data_refs)
            host.pin_memory = False  # its dummy pages would pin through the CUDA driver
        return DeepSeekStack(layout=get_memory().hicache_mem_layout, io=get_memory().hicache_io_backend, dtype=dtype, tp_rank=tp_rank,
                             model_config=model_config, kvcache=kvcache, drafts=drafts, allocator=allocator,
                             req_to_token_pool=target.req_to_token_pool, tree=tree, controller=tree.cache_controller, host=host,
                             _exit=exit_stack)
    except BaseException:
        exit_stack.close()
        raise


def resolved_layout_io(workdir: Path, layout: str, io: str) -> tuple[str, str]:
    """The (io backend, host layout) SGLang's argument resolution makes of a requested pair for DeepSeek-V3."""
    from sglang.srt.runtime_context import get_memory, reset_context

    publish(server_args(write_model_config(workdir / "DeepSeek-V3-3L"), layout, io))
    try:
        return get_memory().hicache_io_backend, get_memory().hicache_mem_layout
    finally:
        reset_context()


# -- the cycle ---------------------------------------------------------------------------------


def run_cycle(stack: DeepSeekStack, *, pages: int = 5, seed: int = 0) -> torch.Tensor:
    """insert (write-through) -> evict device -> load back (per layer, waited as a forward pass waits) -> evict host.

    Every step is the radix tree's own entry point, driven as the scheduler drives it.  Returns the
    loaded device rows; raises AssertionError naming the first layer that differs.
    """
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    tree, tokens, buffers = stack.tree, pages * PAGE, stack.device_buffers()
    device_free, host_free = stack.allocator.available_size(), stack.host.available_size()
    for buffer in buffers:
        fill(buffer, generator)
    # Under EAGLE the tree keys a prefix by token bigrams: a prompt caches one token fewer than it has.
    boundary = int(tree.tree_core.is_eagle)
    rows = stack.allocator.alloc(tokens + boundary * PAGE)
    token_ids = torch.randint(0, DEEPSEEK_V3_CONFIG["vocab_size"], (tokens + boundary,), generator=generator).tolist()
    originals = [buffer[rows[:tokens]].clone() for buffer in buffers]
    key = radix_key(stack, token_ids).page_aligned(PAGE)
    tree.insert(InsertParams(key=key, value=rows[:tokens].to(torch.int64, copy=True)))
    if boundary:
        stack.allocator.free(rows[tokens:])
    assert tree.ongoing_write_through, "write_through should back the new node up"
    poll(stack, lambda: tree.ongoing_write_through, "the host backup", POLL_TIMEOUT)
    assert tree.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted == tokens
    assert stack.allocator.available_size() == device_free

    for buffer in buffers:  # the freed rows go to other requests before the prompt comes back
        fill(buffer, generator)
    before = [buffer.clone() for buffer in buffers]
    req = Req(rid="deepseek", origin_input_text="", origin_input_ids=array("q", token_ids), sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    assert stack.req_to_token_pool.alloc([req]) is not None
    try:
        match = tree.match_prefix(MatchPrefixParams(key=radix_key(stack, token_ids), req=req))
        assert (match.device_prefix_len, match.host_hit_length) == (0, tokens), f"host hit: {match}"
        req.prefix_len, req.host_hit_length = match.device_prefix_len, match.host_hit_length
        req.last_node, req.last_host_node, req.best_match_node = match.last_device_node, match.last_host_node, match.best_match_node
        loaded_tokens, node = tree.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=tokens, req=req))
        assert loaded_tokens == tokens
        loaded = tree.path_device_indices(node).to(torch.int64)
        producer = tree.ready_to_load_host_cache()
        assert producer >= 0
        # The model worker hands the load to the counter the tree registered with it; each
        # attention layer reads its buffer through the pool, which waits for that layer first.
        stack.controller.layer_done_counter.set_consumer(producer)
        for layer in range(LAYERS):
            stack.kvcache.get_key_buffer(layer)
            assert same(buffers[layer][loaded], originals[layer]), f"layer {layer}: loaded rows differ from the written ones"
        poll(stack, lambda: tree.ongoing_load_back, "the load back", POLL_TIMEOUT)
        for depth in range(len(stack.drafts)):  # the draft runner runs after the target's forward
            assert same(buffers[LAYERS + depth][loaded], originals[LAYERS + depth]), f"MTP draft {depth}: loaded rows differ"
    finally:
        stack.req_to_token_pool.free(req)
    for index, buffer in enumerate(buffers):
        expected = before[index].clone()
        expected[loaded] = originals[index]
        assert same(buffer, expected), f"buffer {index}: a row outside the loaded ones changed"
    assert tree.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted == tokens
    assert tree.evict_host(tokens) == tokens and stack.host.available_size() == host_free
    return loaded
