"""Qwen3-Next's HiCache stack, built by SGLang 0.5.23's own functions on the scheduler's path, and one
write/evict/load/evict cycle of a request's recurrent state and KV through its radix tree.

Qwen3-Next interleaves Gated DeltaNet linear-attention layers (a recurrent state per request: one
temporal state and one conv state per layer) with full-attention layers (paged KV).  The model's
config.json is published as SGLang's runtime context; the KV-cache configurator (mimokit's) builds the
`HybridReqToTokenPool` with its `MambaPool` and the full-attention KV pool, and with MTP the draft
runner's one-layer KV pool; the speculative worker's draft plan packs it; the tree-cache factory builds
SGLang's UnifiedRadixCache (FULL and MAMBA components), whose `init_hicache` has the hybrid-Mamba
strategy build the KV host pool, the Mamba state host pool and SGLang's HybridCacheController.

`run_cycle(stack)` caches a request (its KV pages and its state checkpoint) with write-through,
evicts it from the device, has a new request for the prompt load both back, the layers waited as a
forward pass waits for them, and evicts it from device and host; every full-attention, draft and
state layer is checked byte for byte, and every row outside the transfer untouched.
"""

from __future__ import annotations

import contextlib
import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from mimokit import (
    CpuKvcacheio,
    _without_host_registration,
    _without_triton_warmup,
    build_tree_cache,
    hicache_draft_plan,
    kv_cache_configurator,
    poll,
    publish_rank_zero,
    radix_key,
)
from mlakit import CpuMlaKvcacheio, fill, same

PAGE = 1  # SGLang keeps a request's state without snapshot buffers (no_buffer) on the CPU, which takes one-token pages
ATTN_TP = 2
MAX_TOTAL_TOKENS = 256
MAX_RUNNING_REQUESTS = 4
MAX_MAMBA_CACHE_SIZE = 8  # state slots on the device (a GPU run sizes them from its memory profile)
CONTEXT_LENGTH = 2048
HICACHE_RATIO = 2.0
POLL_TIMEOUT = 60.0
# Qwen3-Next-80B-A3B's config.json (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct) with 48 layers
# scaled to 4; every other value is the checkpoint's.  Every fourth layer is full attention (2 KV heads
# of 256), the others Gated DeltaNet: per TP rank of 2, a temporal state of 16 value heads x 128 x 128
# (float32) and a conv state of (2 x 16 x 128 + 32 x 128) / 2 channels x 3 taps (bf16).
QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "mtp_num_hidden_layers": 1,
    "torch_dtype": "bfloat16",
}
FULL_LAYERS = [i for i in range(QWEN3_NEXT_CONFIG["num_hidden_layers"]) if (i + 1) % QWEN3_NEXT_CONFIG["full_attention_interval"] == 0]
LINEAR_LAYERS = [i for i in range(QWEN3_NEXT_CONFIG["num_hidden_layers"]) if i not in FULL_LAYERS]


def write_model_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(QWEN3_NEXT_CONFIG))
    return directory


def server_args(model_dir: Path, layout: str, io: str, *, mtp: bool = False, storage: dict | None = None):
    """What `sglang serve` of the scaled model would be launched with: TP 2, HiCache, optionally NextN MTP and an L3 tier."""
    from sglang.srt.server_args import ServerArgs

    fields = {}
    if mtp:
        fields.update(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    if storage is not None:
        fields.update(storage)
    return ServerArgs(model_path=str(model_dir), device="cpu", dtype="bfloat16", tp_size=ATTN_TP, page_size=PAGE, context_length=CONTEXT_LENGTH,
                      max_total_tokens=MAX_TOTAL_TOKENS, max_running_requests=MAX_RUNNING_REQUESTS, max_mamba_cache_size=MAX_MAMBA_CACHE_SIZE, mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True,
                      enable_hierarchical_cache=True,
                      hicache_ratio=HICACHE_RATIO, hicache_mem_layout=layout, hicache_io_backend=io, hicache_write_policy="write_through", **fields)


class CpuMambaKvcacheio(CpuMlaKvcacheio):
    """The copy ops SGLang's own Mamba host pool calls (sgl_kernel's and its Mamba JIT kernels), in torch, for CPU runs.

    A state slot is an item as an MLA row is one, so the MLA ops serve: the Mamba JIT kernels'
    contracts are those of `transfer_kv_per_layer_mla_pf_lf` and `transfer_kv_all_layer_mla_lf_pf`
    (a per-layer table of device pointers), and the direct ops are sgl_kernel's with page_size 1."""

    transfer_kv_mamba_pf_lf = staticmethod(CpuMlaKvcacheio.transfer_kv_per_layer_mla_pf_lf)

    def transfer_kv_mamba_lf_pf(self, src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_):
        self.transfer_kv_all_layer_mla_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers)

    def bind(self, exit_stack: contextlib.ExitStack, module: str = "mamba") -> CpuMambaKvcacheio:
        import sglang.srt.mem_cache.pool_host.mamba as mamba

        super().bind(exit_stack, module)
        for name in ("transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf"):
            if getattr(mamba, name, None) is None:
                previous = getattr(mamba, name, None)
                setattr(mamba, name, getattr(self, name))
                exit_stack.callback(setattr, mamba, name, previous)
        return self


class CpuSymmetricKvcacheio(CpuKvcacheio):
    """mimokit's stand-ins plus the page_first ops SGLang's own MHA host pool calls when K and V
    share a head dim (Qwen3-Next's full-attention layers: 256 and 256)."""

    OPS = (*CpuKvcacheio.OPS, "transfer_kv_per_layer_pf_lf", "transfer_kv_all_layer_lf_pf")

    @staticmethod
    def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, **_):
        dst_k[dst_indices] = src_k[src_indices, layer_id]
        dst_v[dst_indices] = src_v[src_indices, layer_id]

    def transfer_kv_all_layer_lf_pf(self, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, num_layers, **_):
        for pointers, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
            for layer, pointer in enumerate(pointers.tolist()[:num_layers]):
                dst[dst_indices, layer] = self.by_pointer[pointer][src_indices]


@dataclass
class Qwen3NextStack:
    """Qwen3-Next's HiCache stack for one TP rank, as SGLang builds it."""

    layout: str
    io: str
    mtp: bool
    installed: bool
    model_config: Any
    kvcache: Any  # HybridLinearKVPool (the full-attention layers)
    mamba_pool: Any  # MambaPool (the linear-attention layers' states)
    drafts: tuple  # the NextN draft runner's one-layer KV pool, with MTP
    allocator: Any
    req_to_token_pool: Any  # HybridReqToTokenPool
    tree: Any  # UnifiedRadixCache
    controller: Any  # HybridCacheController
    group: Any  # HostPoolGroup
    _exit: contextlib.ExitStack = field(repr=False)

    @property
    def kv_host(self) -> Any:
        return self.group.anchor_entry.host_pool

    @property
    def state_host(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.group.get_pool(PoolName.MAMBA)

    def kv_buffers(self) -> list[torch.Tensor]:
        """The full-attention K and V layers, then each draft's."""
        full = self.kvcache.full_kv_pool
        drafts = [d.full_kv_pool for d in self.drafts]
        return [*full.k_buffer, *full.v_buffer, *(b for d in drafts for b in (d.k_buffer[0], d.v_buffer[0]))]

    def state_buffers(self) -> list[torch.Tensor]:
        """Each state tensor's per-layer (slots, ...) tensors: temporal, then conv."""
        cache = self.mamba_pool.mamba_cache
        return [*cache.temporal.unbind(0), *(layer for conv in cache.conv for layer in conv.unbind(0))]

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> Qwen3NextStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_stack(workdir: Path, layout: str, io: str, *, mtp: bool = False, installed: bool = True, storage: dict | None = None) -> Qwen3NextStack:
    """Build Qwen3-Next's HiCache stack for TP rank 0 the way SGLang's scheduler does, on the CPU.

    `installed` puts portable_kv in first (and takes it out on close); otherwise the host pools are
    SGLang's own, moved by torch stand-ins for its kernels.  `storage`: ServerArgs fields of an L3 tier.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_memory, reset_context

    import portable_kv.engines.sglang as pk_sglang

    exit_stack = contextlib.ExitStack()
    try:
        args = server_args(write_model_config(workdir / "Qwen3-Next-4L"), layout, io, mtp=mtp, storage=storage)
        publish_rank_zero(args, "cpu")
        exit_stack.callback(reset_context)
        _without_triton_warmup(exit_stack)
        model_config = ModelConfig.from_server_args(args)
        target = kv_cache_configurator(args, model_config, "cpu").configure(pre_model_load_memory=0)
        drafts, draft_plan, packed = (), None, ()
        if mtp:
            draft_config = ModelConfig.from_server_args(args, is_draft_model=True)
            drafts = (kv_cache_configurator(args, draft_config, "cpu", target=target).configure(pre_model_load_memory=0).token_to_kv_pool,)
            draft_plan, packed = hicache_draft_plan(target, drafts, draft_config)
        kvcache, allocator = target.token_to_kv_pool, target.token_to_kv_pool_allocator
        mamba_pool = target.req_to_token_pool.mamba_pool
        if installed:
            pk_sglang.install()
            exit_stack.callback(pk_sglang.uninstall)
        else:
            full = kvcache.full_kv_pool
            CpuSymmetricKvcacheio([*full.k_buffer, *full.v_buffer, *(b for d in drafts for b in (*d.full_kv_pool.k_buffer, *d.full_kv_pool.v_buffer))]).bind(exit_stack)
            cache = mamba_pool.mamba_cache
            CpuMambaKvcacheio(*(layer for t in (cache.temporal, *cache.conv) for layer in t.unbind(0))).bind(exit_stack)
            _without_host_registration(exit_stack)

        tree, _ = build_tree_cache(args, model_config, target, draft_plan, packed, exit_stack, "Qwen3-Next")
        return Qwen3NextStack(layout=get_memory().hicache_mem_layout, io=get_memory().hicache_io_backend, mtp=mtp, installed=installed,
                              model_config=model_config, kvcache=kvcache, mamba_pool=mamba_pool, drafts=drafts, allocator=allocator,
                              req_to_token_pool=target.req_to_token_pool, tree=tree, controller=tree.cache_controller,
                              group=tree.host_pool_group, _exit=exit_stack)
    except BaseException:
        exit_stack.close()
        raise


# -- the cycle ---------------------------------------------------------------------------------


@dataclass
class CycleReport:
    """What one cycle moved: the request's KV rows and state slot, written and loaded."""

    tokens: int
    written_rows: torch.Tensor
    written_slot: torch.Tensor
    loaded_rows: torch.Tensor | None = None
    loaded_slots: list = field(default_factory=list)  # device state slots the load wrote: the node's, the request's


def _state_free(stack: Qwen3NextStack) -> tuple[int, int]:
    return stack.allocator.available_size(), stack.req_to_token_pool.mamba_allocator.available_size()


def _host_free(stack: Qwen3NextStack) -> tuple[int, int]:
    return stack.kv_host.available_size(), stack.state_host.available_size()


def run_cycle(stack: Qwen3NextStack, *, tokens: int = 12, seed: int = 0) -> CycleReport:
    """insert (write-through) -> evict device -> load back (per layer, waited as a forward pass waits) -> evict host.

    Every step is the radix tree's own entry point, driven as the scheduler drives it.  Raises
    AssertionError naming the first buffer whose loaded rows differ, or where a row outside the
    transfer changed.
    """
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    tree, kv, states = stack.tree, stack.kv_buffers(), stack.state_buffers()
    device_free, host_free = _state_free(stack), _host_free(stack)
    for buffer in (*kv, *states):
        fill(buffer, generator)
    # Under EAGLE-style drafts the tree keys a prefix by token bigrams: a prompt caches one token fewer than it has.
    boundary = int(tree.tree_core.is_eagle)
    rows = stack.allocator.alloc(tokens + boundary)
    slot = stack.req_to_token_pool.mamba_allocator.alloc(1)
    assert rows is not None and slot is not None
    report = CycleReport(tokens=tokens, written_rows=rows[:tokens].clone(), written_slot=slot.clone())
    token_ids = torch.randint(0, QWEN3_NEXT_CONFIG["vocab_size"], (tokens + boundary,), generator=generator).tolist()
    kv_originals = [buffer[rows[:tokens]].clone() for buffer in kv]
    state_originals = [buffer[slot].clone() for buffer in states]
    # The finished request's prefix and its final state checkpoint into the tree (cache_finished_req's insert).
    tree.insert(InsertParams(key=radix_key(stack, token_ids), value=rows[:tokens].to(torch.int64, copy=True), mamba_value=slot.clone()))
    if boundary:
        stack.allocator.free(rows[tokens:])
    assert tree.ongoing_write_through, "write_through should back the new node up"
    poll(stack, lambda: tree.ongoing_write_through, "the host backup", POLL_TIMEOUT)
    assert _host_free(stack) == (host_free[0] - tokens, host_free[1] - 1), "the backup should hold the prompt's KV and one state slot"
    evicted = tree.evict(EvictParams(num_tokens=tokens, mamba_num=1))
    assert evicted.num_tokens_evicted == tokens, f"device eviction: {evicted}"
    assert _state_free(stack) == device_free, "evicting the node should give its KV rows and state slot back"

    for buffer in (*kv, *states):  # freed rows and slots go to other requests before the prompt comes back
        fill(buffer, generator)
    before = [buffer.clone() for buffer in (*kv, *states)]
    req = Req(rid="qwen3-next", origin_input_text="", origin_input_ids=array("q", token_ids), sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    assert stack.req_to_token_pool.alloc([req]) is not None
    try:
        match = tree.match_prefix(MatchPrefixParams(key=radix_key(stack, token_ids), req=req))
        assert (match.device_prefix_len, match.host_hit_length) == (0, tokens), f"host hit: {match}"
        req.prefix_len, req.host_hit_length, req.mamba_host_hit_length = match.device_prefix_len, match.host_hit_length, match.mamba_host_hit_length
        req.last_node, req.last_host_node, req.best_match_node = match.last_device_node, match.last_host_node, match.best_match_node
        loaded, node = tree.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=tokens, req=req))
        assert loaded == tokens, f"init_load_back took {loaded} of {tokens} tokens"
        report.loaded_rows = tree.path_device_indices(node).to(torch.int64)
        report.loaded_slots = _loaded_slots(stack, node, req)
        producer = tree.ready_to_load_host_cache()
        assert producer >= 0
        stack.controller.layer_done_counter.set_consumer(producer)
        layers = len(LINEAR_LAYERS)
        for layer in range(QWEN3_NEXT_CONFIG["num_hidden_layers"]):
            if layer in FULL_LAYERS:  # a full-attention layer reads its KV through the pool, which waits for its layer
                stack.kvcache.get_key_buffer(layer)
                index = FULL_LAYERS.index(layer)
                for side in (index, len(FULL_LAYERS) + index):
                    assert same(kv[side][report.loaded_rows], kv_originals[side]), f"full layer {layer}: loaded KV rows differ"
            else:  # a linear-attention layer reads its state through the request pool, which waits for its layer
                local = stack.req_to_token_pool.mamba2_layer_index(layer)
                for state in range(len(states) // layers):
                    buffer = states[state * layers + local]
                    for loaded_slot in report.loaded_slots:
                        assert same(buffer[loaded_slot], state_originals[state * layers + local]), f"linear layer {layer} state {state}: loaded state differs"
        poll(stack, lambda: tree.ongoing_load_back, "the load back", POLL_TIMEOUT)
        for depth in range(len(stack.drafts)):  # the draft runner runs after the target's forward
            for side in (2 * len(FULL_LAYERS) + 2 * depth, 2 * len(FULL_LAYERS) + 2 * depth + 1):
                assert same(kv[side][report.loaded_rows], kv_originals[side]), f"MTP draft {depth}: loaded KV rows differ"
        for index, (buffer, old) in enumerate(zip((*kv, *states), before)):
            expected = old.clone()
            if index < len(kv):
                expected[report.loaded_rows] = kv_originals[index]
            else:
                for loaded_slot in report.loaded_slots:
                    expected[loaded_slot] = state_originals[index - len(kv)]
            assert same(buffer, expected), f"buffer {index}: a row outside the transfer changed"
    finally:
        stack.req_to_token_pool.free(req)
    assert tree.evict(EvictParams(num_tokens=tokens, mamba_num=1)).num_tokens_evicted == tokens
    assert tree.evict_host(tokens) == tokens and _host_free(stack) == host_free, "evicting the host copy should give every host slot back"
    return report


def _loaded_slots(stack: Qwen3NextStack, node, req) -> list:
    """The device state slots a load back writes: the node's restored checkpoint, and the request's own copy of it."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    slots = [stack.tree.tree_core.get_component_device_value(node, ComponentType.MAMBA)]
    if req.kv.mamba_pool_idx is not None:
        slots.append(req.kv.mamba_pool_idx.reshape(1))
    return [s.to(torch.int64) for s in slots if s is not None]
