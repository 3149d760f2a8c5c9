"""MiMo-V2-Flash's HiCache stack, built by SGLang 0.5.23's own functions, and one write/load/evict cycle through it.

The stack is what SGLang's scheduler builds for a scaled MiMo-V2-Flash: the model's config.json
is published as SGLang's runtime context (so SGLang's own argument hooks, the MiMo overrides and the
HiCache layout/io rewrite among them, run on it); `KVCacheConfigurator.configure` sizes and builds the
device `SWAKVPool` (full and SWA sub-pools with their own heads and dims, layers split by the
hybrid pattern), the request pool and the `SWATokenToKVPoolAllocator`; each MTP draft runner's
configurator builds its one-layer `SWAKVPool` beside the target's allocator; the speculative
worker's HiCache draft plan packs the drafts; and the tree-cache factory (`create_tree_cache`, as
`build_kv_cache` calls it) builds SGLang's `UnifiedRadixCache`, whose `init_hicache` calls
`attach_hybrid_pool_to_unified_cache`: the hybrid-SWA strategy builds the host pool group and
SGLang's `HybridCacheController` (`build_hybrid_swa_stack`), drafts packed into the SWA host pool.

`build_stack(device, layout, io, mtp=..., installed=...)` builds it; `run_cycle(stack)` caches a
request's prefix in the tree (write-through backs it up to host), evicts it from the device, has a
new request for the prompt load it back layer by layer as a forward pass waits for it, and evicts
it from device and host, checking every full, SWA and draft layer bit for bit and every other
device row untouched; `run_file_cycle(stack)` does the same through SGLang's HiCacheFile L3 tier.
Every step is the tree's own entry point, polled as the scheduler polls it.  The device is a
parameter: "cpu" here, a CUDA device for runs on a GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

PAGE = 4
DTYPE = torch.bfloat16
ATTN_TP = 2  # attention tensor parallelism: SGLang divides the KV heads per rank
# MiMo-V2-Flash's three MTP layers (SGLang's day-0 MiMo-V2-Flash support: a 3-layer MTP), served as
# multi-layer EAGLE with one draft runner per step.
MTP_STEPS = 3
# Token budget of the device pools (--max-total-tokens): SGLang's sizer gives the full pool this
# many tokens and the SWA pool its share (swa_full_tokens_ratio), which must hold at least one
# window plus a page.
MAX_TOTAL_TOKENS = 256
CONTEXT_LENGTH = 2048  # keeps the request-to-token table small
HICACHE_RATIO = 2.0
POLL_TIMEOUT = 60.0  # seconds a cycle waits for one transfer before failing

# MiMo-V2-Flash's config.json (huggingface.co/XiaomiMiMo/MiMo-V2-Flash) with the layer count scaled
# from 48 to 6; every other value is the checkpoint's.  Full-attention layers: 4 KV heads, K
# head_dim 192, V head_dim 128 (`num_key_value_heads`, `head_dim`, `v_head_dim`).  Sliding-window
# layers: 8 KV heads, the same dims (`swa_num_key_value_heads`, `swa_head_dim`, `swa_v_head_dim`),
# a 128-token window (`sliding_window`, `sliding_window_size`).  `hybrid_layer_pattern` (0 full,
# 1 sliding window) has full attention at layer 0 and at every sixth layer (layer % 6 == 5), as the
# checkpoint's 48 entries do: layers 0 and 5 of 6.  `moe_layer_freq` (layer 0 dense) and the MoE and
# vocabulary sizes are there because SGLang's config parsing reads them; nothing here uses them.
MIMO_V2_FLASH_CONFIG = {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "model_type": "mimo_v2_flash",
    "num_hidden_layers": 6,
    "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0],
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 192,
    "swa_v_head_dim": 128,
    "sliding_window": 128,
    "sliding_window_size": 128,
    "attention_value_scale": 0.707,
    "moe_layer_freq": [0, 1, 1, 1, 1, 1],
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "intermediate_size": 16384,
    "vocab_size": 152576,
}
FULL_LAYERS = [i for i, kind in enumerate(MIMO_V2_FLASH_CONFIG["hybrid_layer_pattern"]) if kind == 0]
SWA_LAYERS = [i for i, kind in enumerate(MIMO_V2_FLASH_CONFIG["hybrid_layer_pattern"]) if kind == 1]
FULL_HEADS = MIMO_V2_FLASH_CONFIG["num_key_value_heads"] // ATTN_TP
SWA_HEADS = MIMO_V2_FLASH_CONFIG["swa_num_key_value_heads"] // ATTN_TP

# Every (io backend, host layout) pair SGLang carries for an MHA model after its own HiCache
# argument hook (`resolve_layout_io_compatibility`: kernel io with page_first_direct becomes direct
# io, direct io with page_first becomes page_first_direct).  Of what the hook leaves,
# page_first_kv_split is MLA's layout and direct io with page_head is refused by the controller
# (`move_indices`), so neither reaches an MHA host pool.
LAYOUT_IO_CASES = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "page_head"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
# The pairs SGLang's own asymmetric (K dim != V dim) host pool moves: MiMo's K and V widths differ.
SGLANG_ASYMMETRIC_CASES = [("kernel", "page_first"), ("direct", "page_first_direct")]


# -- SGLang's runtime context --------------------------------------------------------------------


def write_model_config(directory: Path) -> Path:
    """The scaled MiMo-V2-Flash config.json in `directory`, which then serves as the model path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MIMO_V2_FLASH_CONFIG))
    return directory


def server_args(model_dir: Path, device: str, layout: str, io: str, *, mtp: bool, storage_dir: Path | None = None, **fields):
    """The ServerArgs an `sglang serve` of the scaled model would be launched with (not yet resolved)."""
    from sglang.srt.server_args import ServerArgs

    if mtp:
        # MiMo's MTP heads run as multi-layer EAGLE (SGLang's MiMo override turns that on).
        fields.update(speculative_algorithm="EAGLE", speculative_num_steps=MTP_STEPS, speculative_eagle_topk=1, speculative_num_draft_tokens=MTP_STEPS + 1)
    if storage_dir is not None:
        # The tree prefetches from the tier only for at least `prefetch_threshold` tokens (256 by
        # default, more than a cycle writes), and under wait_complete it admits a request only
        # once its prefetch has finished, so the cycle's load finds the whole prompt in host memory.
        extra = {"file_storage_path": str(storage_dir), "prefetch_threshold": PAGE}
        fields.update(hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps(extra), hicache_storage_prefetch_policy="wait_complete")
    return ServerArgs(
        model_path=str(model_dir),
        device=device.split(":")[0],
        dtype="bfloat16",
        tp_size=ATTN_TP,
        page_size=PAGE,
        context_length=CONTEXT_LENGTH,
        max_total_tokens=MAX_TOTAL_TOKENS,
        enable_hierarchical_cache=True,
        hicache_ratio=HICACHE_RATIO,
        hicache_mem_layout=layout,
        hicache_io_backend=io,
        hicache_write_policy="write_through",
        **fields,
    )


def publish_rank_zero(args, device: str) -> None:
    """Resolve `args` (SGLang's argument hooks run here) and publish them as rank 0's runtime context."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=_gpu_id(device)))


def _gpu_id(device: str) -> int | None:
    """The launcher's device index for a CUDA device (None on CPU)."""
    if not device.startswith("cuda"):
        return None
    return torch.device(device).index or 0


def resolved_layout_io(model_dir: Path, device: str, layout: str, io: str) -> tuple[str, str]:
    """The (io backend, host layout) SGLang's argument resolution makes of a requested pair."""
    from sglang.srt.runtime_context import get_memory, reset_context

    publish_rank_zero(server_args(model_dir, device, layout, io, mtp=False), device)
    try:
        return get_memory().hicache_io_backend, get_memory().hicache_mem_layout
    finally:
        reset_context()


# -- Stand-ins for what a CPU run lacks ----------------------------------------------------------


class CpuKvcacheio:
    """sgl_kernel's KV-cache copy ops that SGLang's asymmetric MHA host pool calls, in torch, for CPU runs.

    On CPU SGLang's host pools find no sgl_kernel (it is built for CUDA and ROCm only), so its own
    pool, the reference the portable_kv pool is checked against, could not move a byte.  These
    follow the kernels' contracts: token `i` of the source rows lands on token `i` of the
    destination rows; page_first hosts are (token, layer, head, dim), page_first_direct hosts are
    (page, layer, token in page, head, dim).  The all-layer ops address device layers through the
    pool's table of data pointers, resolved here through the device buffers the stack registered.
    """

    def __init__(self, device_buffers):
        self.by_pointer = {buffer.data_ptr(): buffer for buffer in device_buffers}

    def transfer_kv_per_layer_mla_pf_lf(self, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
        dst[dst_indices] = src[src_indices, layer_id]

    def transfer_kv_all_layer_mla_lf_pf(self, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_):
        for layer, pointer in enumerate(src_layers.tolist()[:num_layers]):
            dst[dst_indices, layer] = self.by_pointer[pointer][src_indices]

    @staticmethod
    def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
            dst[dst_indices] = src[src_indices // page_size, layer_id, src_indices % page_size]

    @staticmethod
    def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
        layers = len(src_ptrs) // len(dst_ptrs)
        for n, dst in enumerate(dst_ptrs):
            for layer in range(layers):
                dst[dst_indices // page_size, layer, dst_indices % page_size] = src_ptrs[n * layers + layer][src_indices]

    OPS = ("transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")

    def bind(self, stack: contextlib.ExitStack) -> None:
        """Give SGLang's MHA host-pool module the ops it lacks, until `stack` closes."""
        import sglang.srt.mem_cache.pool_host.mha as mha

        for name in self.OPS:
            if not hasattr(mha, name):
                setattr(mha, name, getattr(self, name))
                stack.callback(delattr, mha, name)


def _without_triton_warmup(exit_stack: contextlib.ExitStack) -> None:
    """Skip the Triton warm-up SGLang's device pools run when a draft model is configured, until `exit_stack` closes.

    The warm-up precompiles the KV-move kernel speculative decoding uses to relocate accepted
    tokens; Triton has no CPU driver, and HiCache never calls that kernel.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    original = MHATokenToKVPool._init_kv_copy_and_warmup
    MHATokenToKVPool._init_kv_copy_and_warmup = lambda self: None
    exit_stack.callback(setattr, MHATokenToKVPool, "_init_kv_copy_and_warmup", original)


def _without_host_registration(exit_stack: contextlib.ExitStack) -> None:
    """Let SGLang's own host pools allocate on a machine without CUDA, until `exit_stack` closes.

    SGLang pins its host buffers by registering them with the CUDA driver (cudaHostRegister);
    on a CPU-only machine there is no driver to register with, and pinning changes no byte the
    cycle checks.  The buffers are left marked as registering nothing, as SGLang marks memory it
    did not register.
    """
    from sglang.srt.mem_cache.pool_host import common

    def unregistered(buffer, registration_granularity_bytes=None):
        setattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR, [])

    original = common._cuda_host_register
    common._cuda_host_register = unregistered
    exit_stack.callback(setattr, common, "_cuda_host_register", original)


class WorkerStandIn:
    """The model worker as the tree-cache factory sees it: what the tree registers its layer counter with.

    The factory is handed the worker that runs the model (`TreeCacheBuildContext.tp_worker`), and of
    it `create_unified_radix_cache` calls only `register_hicache_layer_transfer_counter`, here
    TpModelWorker's own.  A real worker loads the model weights, which the cycle has no use for.
    """

    def __init__(self):
        from sglang.srt.managers.tp_worker import TpModelWorker

        self.hicache_layer_transfer_counter = None
        self.register_hicache_layer_transfer_counter = TpModelWorker.register_hicache_layer_transfer_counter.__get__(self)


# -- The stack -----------------------------------------------------------------------------------


@dataclass
class MimoStack:
    """MiMo-V2-Flash's HiCache stack for one rank, as SGLang builds it, and what the cycle needs of it."""

    device: str
    layout: str
    io: str
    mtp: bool
    installed: bool
    server_args: Any
    model_config: Any
    kvcache: Any  # the target's SWAKVPool
    drafts: tuple  # one SWAKVPool per MTP step, each one SWA layer
    allocator: Any  # SWATokenToKVPoolAllocator
    req_to_token_pool: Any
    params: Any  # CacheInitParams
    tree: Any  # SGLang's UnifiedRadixCache, HiCache attached
    group: Any  # HostPoolGroup
    controller: Any  # HybridCacheController
    _exit: contextlib.ExitStack = field(repr=False)

    def host_pools(self) -> dict:
        """Every host pool in the group by pool name (kv = full attention, swa, any draft sidecar)."""
        return {str(name.value if hasattr(name, "value") else name): entry.host_pool for name, entry in self.group.entry_map.items()}

    def device_buffers(self) -> dict:
        """Every device K/V layer buffer, keyed (pool, layer, "k"/"v"): full and SWA by model layer, drafts by MTP depth."""
        buffers = {}
        for pool, name, layer_ids in ((self.kvcache.full_kv_pool, "full", FULL_LAYERS), (self.kvcache.swa_kv_pool, "swa", SWA_LAYERS)):
            for local, layer in enumerate(layer_ids):
                buffers[(name, layer, "k")] = pool.k_buffer[local]
                buffers[(name, layer, "v")] = pool.v_buffer[local]
        for depth, draft in enumerate(self.drafts):
            buffers[("draft", depth, "k")] = draft.swa_kv_pool.k_buffer[0]
            buffers[("draft", depth, "v")] = draft.swa_kv_pool.v_buffer[0]
        return buffers

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> MimoStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kv_cache_configurator(args, model_config, device: str, *, draft_idx: int | None = None, target=None, use_mla_backend: bool = False,
                          kv_cache_dtype: torch.dtype = DTYPE, kv_cache_dtype_str: str = "auto"):
    """SGLang's KV-cache configurator as a model runner makes it (model_runner.init_kv_cache_configurator).

    The device-memory profile is the one thing replaced: a fixed budget stands in for what a GPU
    profile finds, and --max-total-tokens caps the pools well below it, so the sizes are SGLang's
    own arithmetic from there on.  A draft runner shares the target's request pool, allocator and
    pool sizes, as the speculative worker hands them over.  `use_mla_backend` and the KV-cache
    dtype are what a model runner resolves for an MLA model (DeepSeek's) and for `--kv-cache-dtype`.
    """
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import resolve_layer_indices
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import resolve_spec_aux_hidden_state_config
    from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class BudgetedConfigurator(KVCacheConfigurator):
        def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
            return 1 << 30

    is_draft = target is not None  # a draft runner works beside the target's pools
    spec = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    return BudgetedConfigurator(
        device=device,
        gpu_id=_gpu_id(device) or 0,
        attn_dp_size=get_parallel().attn_dp_size,
        pp_size=1,
        pp_group=None,
        model=None,  # read only for quantization scales and fused drafts, neither of which these stacks use
        model_config=model_config,
        server_args=args,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_dtype_str=kv_cache_dtype_str,
        model_dtype=DTYPE,
        page_size=get_schedule().page_size,
        sliding_window_size=model_config.sliding_window_size,
        spec_algorithm=spec,
        is_draft_worker=is_draft,
        post_capture_kv_active=False,
        spec_aux_config=resolve_spec_aux_hidden_state_config(server_args=args, model_config=model_config, spec_algorithm=spec, is_draft_worker=is_draft),
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=use_mla_backend,
        layer_info=resolve_layer_indices(model=None, model_config=model_config, is_draft_worker=is_draft, draft_model_idx=draft_idx),
        forward_stream=None,
        req_to_token_pool=target.req_to_token_pool if target else None,
        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator if target else None,
        memory_pool_config=target.memory_pool_config if target else None,
        draft_model_idx=draft_idx,
    )


def hicache_draft_plan(target, drafts: tuple, draft_config):
    """The speculative worker's HiCache draft plan as SGLang makes it, and the draft pools it packs into the target's.

    `BaseSpecWorker._build_hicache_draft_plan` runs on the worker's model runners, which load the
    target and draft models; it reads only their pools, config and algorithm, so namespaces
    carrying those stand in for them.  It sets the target runner's `mtp_draft_device_pools`, which
    the tree-cache factory then receives, as the real runner does.
    """
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target_runner = SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm),
        req_to_token_pool=target.req_to_token_pool,
        mtp_draft_device_pools=(),
        mtp_draft_mamba_pools=(),
    )
    draft_runners = tuple(SimpleNamespace(token_to_kv_pool=pool, model_config=draft_config, req_to_token_pool=target.req_to_token_pool) for pool in drafts)
    spec_worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=target_runner), _draft_model_runners=lambda: draft_runners)
    plan = BaseSpecWorker._build_hicache_draft_plan(spec_worker)
    return plan, target_runner.mtp_draft_device_pools


def build_tree_cache(args, model_config, target, draft_plan, mtp_draft_device_pools: tuple, exit_stack: contextlib.ExitStack, model: str):
    """SGLang's radix tree over `target`'s pools with HiCache attached, as the scheduler builds it; (tree, CacheInitParams).

    What kv_cache_builder.build_kv_cache hands the tree-cache factory, and the factory itself: it
    builds SGLang's UnifiedRadixCache, whose init_hicache attaches the host pools and the controller
    (attach_hybrid_pool_to_unified_cache), then registers any draft sidecar of `draft_plan`.  One
    process stands for rank 0, so there are no process groups for the tree to reduce over.  The tree
    releases its host pools (and detaches any storage tier) when `exit_stack` closes.
    """
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_auto_size import auto_size_hicache
    from sglang.srt.mem_cache.kv_cache_builder import maybe_register_hicache_draft, uses_ssm_state
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.runtime_context import get_memory, get_parallel, get_schedule, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=target.req_to_token_pool,
        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator,
        page_size=get_schedule().page_size,
        is_eagle=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm).is_eagle(),
        tp_cache_group=None,
        attn_cp_cache_group=None,
        attn_tp_cache_group=None,
        pp_cache_group=None,
        eviction_policy=get_memory().radix_eviction_policy,
        eviction_policy_config=get_memory().radix_eviction_policy_config,
        enable_session_radix_cache=get_memory().enable_session_radix_cache,
        chunked_prefill_size=get_schedule().chunked_prefill_size,
        sliding_window_size=model_config.sliding_window_size,
        mtp_draft_device_pools=mtp_draft_device_pools,
    )
    worker = WorkerStandIn()
    context = TreeCacheBuildContext(
        server_args=args,
        params=params,
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_ssm=uses_ssm_state(model_config),
        enable_hierarchical_cache=get_memory().enable_hierarchical_cache,
        disable_radix_cache=get_memory().disable_radix_cache,
        tp_worker=worker,
        model_config=model_config,
        tp_size=get_parallel().tp_size,
        tp_rank=get_parallel().tp_rank,
        tp_group=None,
        full_tokens_per_layer=target.full_max_total_num_tokens,
    )
    with auto_size_hicache(params, draft_plan, enabled=get_memory().enable_hierarchical_cache):
        tree = create_tree_cache(context)
        if draft_plan is not None:
            maybe_register_hicache_draft(tree_cache=tree, draft_plan=draft_plan)
    # init_hicache registers the storage detach with atexit; the stack detaches on close instead.
    atexit.unregister(tree.shutdown)
    exit_stack.callback(tree.release_host_resources)
    if tree.enable_storage:  # its threads stop before the host pools go
        exit_stack.callback(tree.shutdown)
    assert type(tree).__name__ == "UnifiedRadixCache", f"SGLang built {type(tree).__name__} for {model}"
    assert worker.hicache_layer_transfer_counter is tree.cache_controller.layer_done_counter
    return tree, params


def build_stack(device: str, layout: str, io: str, *, mtp: bool, installed: bool, workdir: Path | None = None, storage: bool = False) -> MimoStack:
    """Build MiMo-V2-Flash's HiCache stack the way SGLang's scheduler does, on `device`.

    `installed` puts portable_kv in as SGLang's MHA host-pool class first (and takes it out on
    close); otherwise the host pools are SGLang's own.  `mtp` adds the three MTP draft runners' pools,
    packed into the SWA host pool.  `storage` attaches SGLang's HiCacheFile tier under `workdir`.
    The returned stack holds the published runtime context until it is closed.

    What is not SGLang's own is what needs a loaded model or a process group: the model worker and
    runners the factory and the draft plan read a few attributes of (`WorkerStandIn`,
    `hicache_draft_plan`), and the device-memory profile (`kv_cache_configurator`).  On CPU, what SGLang's
    own pools need of CUDA is stood in for too (`CpuKvcacheio`, `_without_host_registration`,
    `_without_triton_warmup`); on a CUDA device it is not, so SGLang's own host pools need
    sgl_kernel there.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_memory, get_spec, reset_context

    import portable_kv.engines.sglang as pk_sglang

    exit_stack = contextlib.ExitStack()
    try:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="mimo-stack-"))
            exit_stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        model_dir = write_model_config(workdir / "MiMo-V2-Flash-6L")
        args = server_args(model_dir, device, layout, io, mtp=mtp, storage_dir=workdir / "hicache" if storage else None)
        publish_rank_zero(args, device)
        exit_stack.callback(reset_context)
        if device == "cpu":
            _without_triton_warmup(exit_stack)

        model_config = ModelConfig.from_server_args(args)
        target = kv_cache_configurator(args, model_config, device).configure(pre_model_load_memory=0)
        drafts = ()
        if mtp:
            # The draft worker's runners, one per MTP step, on the draft form of the same checkpoint.
            draft_config = ModelConfig.from_server_args(args, is_draft_model=True)
            drafts = tuple(
                kv_cache_configurator(args, draft_config, device, draft_idx=depth, target=target).configure(pre_model_load_memory=0).token_to_kv_pool
                for depth in range(get_spec().speculative_num_steps)
            )

        kvcache, allocator = target.token_to_kv_pool, target.token_to_kv_pool_allocator
        if device == "cpu":
            buffers = [b for pool in (kvcache.full_kv_pool, kvcache.swa_kv_pool, *(d.swa_kv_pool for d in drafts)) for b in (*pool.k_buffer, *pool.v_buffer)]
            CpuKvcacheio(buffers).bind(exit_stack)
            _without_host_registration(exit_stack)
        if installed:
            pk_sglang.install()
            exit_stack.callback(pk_sglang.uninstall)

        # The speculative worker's HiCache draft plan (init_hicache_draft_plan): SGLang decides
        # whether the MTP drafts pack into the target's host pools or ride in a sidecar.
        draft_plan, packed_drafts = hicache_draft_plan(target, drafts, draft_config) if mtp else (None, ())
        tree, params = build_tree_cache(args, model_config, target, draft_plan, packed_drafts, exit_stack, "MiMo-V2-Flash")
        controller = tree.cache_controller
        stack = MimoStack(
            device=device,
            layout=get_memory().hicache_mem_layout,
            io=get_memory().hicache_io_backend,
            mtp=mtp,
            installed=installed,
            server_args=args,
            model_config=model_config,
            kvcache=kvcache,
            drafts=drafts,
            allocator=allocator,
            req_to_token_pool=target.req_to_token_pool,
            params=params,
            tree=tree,
            group=tree.host_pool_group,
            controller=controller,
            _exit=exit_stack,
        )
        return stack
    except BaseException:
        exit_stack.close()
        raise


# -- The cycle -----------------------------------------------------------------------------------


@dataclass
class CycleReport:
    """What one cycle did, for assertions beyond bit-exactness."""

    tokens: int
    written_full: torch.Tensor
    written_swa: torch.Tensor
    loaded_full: torch.Tensor
    loaded_swa: torch.Tensor
    # (pool name, host layer, is_draft, device pool) per per-layer load call, in the engine's order
    layer_calls: list = field(default_factory=list)


def _random_bits(shape, generator) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int16)


def _fill(buffer: torch.Tensor, rows: torch.Tensor | None, generator) -> None:
    """Random bits into `rows` of a device layer buffer (all rows if None); bf16 viewed as int16."""
    view = buffer.view(torch.int16)
    if rows is None:
        view.copy_(_random_bits(view.shape, generator))
    else:
        view[rows.to(buffer.device)] = _random_bits((len(rows), *view.shape[1:]), generator).to(buffer.device)


def _rows_of(key, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
    return full if key[0] == "full" else swa


def _alloc_request(stack: MimoStack, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device rows for one new request's prefill, as the scheduler allocates them: full rows, and their SWA peers."""
    zero = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([tokens], dtype=torch.int64)
    last = torch.full((1,), -1, dtype=torch.int64)
    dev = stack.kvcache.device
    full = stack.allocator.alloc_extend(zero.to(dev), zero, seq.to(dev), seq, last.to(dev), tokens)
    assert full is not None, "the device pool should hold the request"
    swa = stack.allocator.translate_swa_indices_for_transfer(full).to(torch.int64)
    return full, swa


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _record_layer_calls(stack: MimoStack, calls: list, exit_stack: contextlib.ExitStack) -> None:
    """Log every per-layer load the transfer engine makes, on each host pool, until `exit_stack` closes."""
    for name, pool in stack.host_pools().items():
        original = pool.load_to_device_per_layer_physical

        def recorded(device_pool, host_indices, device_indices, layer_id, io_backend, *, _name=name, _original=original, **kwargs):
            calls.append((_name, layer_id, bool(kwargs.get("is_draft", False)), device_pool))
            return _original(device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)

        pool.load_to_device_per_layer_physical = recorded
        exit_stack.callback(delattr, pool, "load_to_device_per_layer_physical")


def poll(stack: Any, pending, what: str, timeout: float) -> None:
    """Run the scheduler's per-step HiCache poll (the tree's check_hicache_events) until `pending()` is false."""
    deadline = time.monotonic() + timeout
    while pending():
        assert time.monotonic() < deadline, f"{what}: not done after {timeout} s"
        stack.tree.check_hicache_events()


def radix_key(stack: Any, token_ids: list):
    """The tree's key for a token sequence, as the scheduler builds it: token bigrams under EAGLE."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", token_ids), is_bigram=stack.tree.tree_core.is_eagle)


def _prefill(stack: MimoStack, tokens: int, generator) -> tuple[CycleReport, dict, list, torch.Tensor]:
    """One request's prefill: device rows in every layer (drafts too) filled with random bits.

    Returns the report, the bits written into the `tokens` rows the tree will hold, the request's
    token ids and all its full-pool rows.  Under EAGLE the tree keys a prefix by token bigrams, so
    a prompt caches one token fewer than it has: the request carries one token past `tokens`.
    """
    buffers = stack.device_buffers()
    for buffer in buffers.values():  # the whole device pool holds other requests' bits
        _fill(buffer, None, generator)
    boundary = int(stack.tree.tree_core.is_eagle)
    rows, swa_rows = _alloc_request(stack, tokens + boundary)
    full, swa = rows[:tokens], swa_rows[:tokens]
    originals = {key: buffer[_rows_of(key, full, swa).to(buffer.device)].clone() for key, buffer in buffers.items()}
    token_ids = torch.randint(0, MIMO_V2_FLASH_CONFIG["vocab_size"], (tokens + boundary,), generator=generator).tolist()
    report = CycleReport(tokens=tokens, written_full=full, written_swa=swa, loaded_full=full, loaded_swa=swa)
    return report, originals, token_ids, rows


def _cache_in_tree(stack: MimoStack, token_ids: list, rows: torch.Tensor, tokens: int, timeout: float) -> None:
    """The finished request's prefix into the tree (checkpoint_into_tree's insert), its device rows past the prefix freed.

    Under write_through the insert backs the new node up to the host pools (BACKUP_HOST: full rows
    through the anchor, SWA rows and packed drafts through the SWA pool); the scheduler's poll
    then takes the write ack, and with a storage tier that ack backs the node up to it.
    """
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    key = radix_key(stack, token_ids).page_aligned(PAGE)
    assert len(key) == tokens
    stack.tree.insert(InsertParams(key=key, value=rows[:tokens].to(torch.int64, copy=True)))
    if len(rows) > tokens:
        stack.allocator.free(rows[tokens:])  # release_kv_cache frees what the tree did not take
    assert stack.tree.ongoing_write_through, "write_through should back the new node up"
    poll(stack, lambda: stack.tree.ongoing_write_through, "the host backup", timeout)


def _evict_device(stack: MimoStack, tokens: int, device_free: tuple) -> None:
    """The tree's device eviction: the node keeps its host copy and gives its device rows back."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evicted = stack.tree.evict(EvictParams(num_tokens=tokens, swa_num_tokens=tokens))
    assert (evicted.num_tokens_evicted, evicted.swa_num_tokens_evicted) == (tokens, tokens), f"device eviction: {evicted}"
    assert _device_free(stack) == device_free, "evicting the node should give every device row back"


def _evict_host(stack: MimoStack, tokens: int, host_free: dict) -> None:
    """The tree's host eviction of the (device-evicted) node: every host slot, SWA and drafts too, goes back."""
    assert stack.tree.evict_host(tokens) == tokens
    assert _host_free(stack) == host_free, "evicting the host copy should give every host slot back"


def _request(stack: MimoStack, token_ids: list):
    """A new request for the same prompt, with its request-pool row, as the scheduler admits it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid="mimo", origin_input_text="", origin_input_ids=array("q", token_ids), sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    assert stack.req_to_token_pool.alloc([req]) is not None
    return req


def _match(stack: MimoStack, req, token_ids: list):
    """match_prefix for the request, its result recorded on the request as init_next_round_input records it."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    match = stack.tree.match_prefix(MatchPrefixParams(key=radix_key(stack, token_ids), req=req))
    req.prefix_len = match.device_prefix_len
    req.last_node, req.last_host_node, req.best_match_node = match.last_device_node, match.last_host_node, match.best_match_node
    req.host_hit_length, req.swa_host_hit_length, req.mamba_host_hit_length = match.host_hit_length, match.swa_host_hit_length, match.mamba_host_hit_length
    return match


def _load_and_check(stack: MimoStack, token_ids: list, originals: dict, report: CycleReport, generator, timeout: float) -> None:
    """A request for the prompt loads its host hit back (init_load_back), layer by layer as the forward pass consumes it; every buffer checked."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    buffers = stack.device_buffers()
    # The freed rows go to other requests before this one comes back: scribble on them, so a
    # load that writes nothing cannot pass on stale bits.
    for key, buffer in buffers.items():
        _fill(buffer, _rows_of(key, report.written_full, report.written_swa), generator)
    before = {key: buffer.clone() for key, buffer in buffers.items()}

    req = _request(stack, token_ids)
    try:
        match = _match(stack, req, token_ids)
        assert (match.device_prefix_len, match.host_hit_length, match.swa_host_hit_length) == (0, report.tokens, report.tokens), f"host hit: {match}"
        loaded, node = stack.tree.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
        assert loaded == report.tokens, f"init_load_back took {loaded} of {report.tokens} tokens"
        report.loaded_full = stack.tree.path_device_indices(node).to(torch.int64)
        report.loaded_swa = stack.allocator.translate_swa_indices_for_transfer(report.loaded_full).to(torch.int64)

        with contextlib.ExitStack() as recording:
            _record_layer_calls(stack, report.layer_calls, recording)
            producer = stack.tree.ready_to_load_host_cache()
            assert producer >= 0
            # The scheduler points the forward batch at this load, and the model worker hands the
            # index to the counter the tree registered with it (TpModelWorker.set_hicache_consumer);
            # each attention layer then reads its buffers through the pool, which waits for that
            # layer's event first.
            stack.controller.layer_done_counter.set_consumer(producer)
            for layer in range(len(FULL_LAYERS) + len(SWA_LAYERS)):
                stack.kvcache.get_key_buffer(layer)
                stack.kvcache.get_value_buffer(layer)
                kind = "full" if layer in FULL_LAYERS else "swa"
                rows = report.loaded_full if kind == "full" else report.loaded_swa
                for part in ("k", "v"):
                    got = buffers[(kind, layer, part)][rows.to(stack.kvcache.device)]
                    assert _equal(got, originals[(kind, layer, part)]), f"{kind} layer {layer} {part.upper()}: loaded rows differ from the written ones"
            # Draft runners run after the target's forward, which has waited for every layer.
            for depth in range(len(stack.drafts)):
                for part in ("k", "v"):
                    got = buffers[("draft", depth, part)][report.loaded_swa.to(stack.kvcache.device)]
                    assert _equal(got, originals[("draft", depth, part)]), f"MTP draft {depth} {part.upper()}: loaded rows differ from the written ones"
            poll(stack, lambda: stack.tree.ongoing_load_back, "the load back", timeout)
    finally:
        stack.req_to_token_pool.free(req)

    for key, buffer in buffers.items():
        expected = before[key].clone()
        expected[_rows_of(key, report.loaded_full, report.loaded_swa).to(buffer.device)] = originals[key]
        assert _equal(buffer, expected), f"{key}: a row outside the loaded ones changed"


def _host_free(stack: MimoStack) -> dict:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return {name: stack.group.available_size(pool=name) for name in (PoolName.KV, PoolName.SWA)}


def _device_free(stack: MimoStack) -> tuple:
    return stack.allocator.full_available_size(), stack.allocator.swa_available_size()


def _record_puts(queue, exit_stack: contextlib.ExitStack) -> list:
    """Every item put on one of the controller's queues, until `exit_stack` closes; the tree still gets them all."""
    items = []
    original = queue.put

    def put(item, *args, **kwargs):
        items.append(item)
        return original(item, *args, **kwargs)

    queue.put = put
    exit_stack.callback(delattr, queue, "put")
    return items


def run_cycle(stack: MimoStack, *, pages: int = 5, seed: int = 0) -> CycleReport:
    """insert (write-through) -> evict device -> load back (per layer, waited as a forward pass waits) -> evict host, checked bit for bit.

    Every step is the radix tree's own entry point, driven as the scheduler drives it.  Raises
    AssertionError naming the pool, layer and K/V side of the first mismatch, or the first
    buffer where a row outside the loaded ones changed.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = pages * PAGE
    host_free, device_free = _host_free(stack), _device_free(stack)
    report, originals, token_ids, rows = _prefill(stack, tokens, generator)
    _cache_in_tree(stack, token_ids, rows, tokens, POLL_TIMEOUT)
    _evict_device(stack, tokens, device_free)
    _load_and_check(stack, token_ids, originals, report, generator, POLL_TIMEOUT)
    _evict_device(stack, tokens, device_free)
    _evict_host(stack, tokens, host_free)
    return report


def run_file_cycle(stack: MimoStack, *, pages: int = 5, seed: int = 1, timeout: float = 60.0) -> CycleReport:
    """insert -> back up to HiCacheFile -> evict device and host (host bits wiped) -> prefetch from the files -> load, checked bit for bit.

    The write ack backs the node up to the tier (BACKUP_STORAGE: the full pages, and the SWA
    pool's trailing pages under the same page hashes); a request for the prompt then misses in
    memory, the tree prefetches it from the files (host rows for the hit, SWA staging for the
    trailing pages) and loads it back as in `run_cycle`.
    """
    from sglang.srt.mem_cache.hicache_storage import PoolName

    tree = stack.tree
    assert stack.controller.enable_storage, "build the stack with storage=True"
    generator = torch.Generator().manual_seed(seed)
    tokens = pages * PAGE
    host_free, device_free = _host_free(stack), _device_free(stack)
    report, originals, token_ids, rows = _prefill(stack, tokens, generator)
    with contextlib.ExitStack() as recording:
        backups = _record_puts(stack.controller.ack_backup_queue, recording)
        _cache_in_tree(stack, token_ids, rows, tokens, timeout)
        assert tree.ongoing_backup, "the write ack should back the node up to the file tier"
        poll(stack, lambda: tree.ongoing_backup, "the backup to the file tier", timeout)
    assert sum(backup.completed_tokens for backup in backups) == tokens, f"backed up {[b.completed_tokens for b in backups]} of {tokens} tokens to the file tier"
    assert sum(_swa_pages(backup.pool_storage_result.extra_pool_hit_pages) or 0 for backup in backups) == pages, "SWA pages backed up: " + str([b.pool_storage_result.extra_pool_hit_pages for b in backups])

    _evict_device(stack, tokens, device_free)
    _evict_host(stack, tokens, host_free)
    for pool in stack.host_pools().values():  # nothing may come back from host memory
        for buffer in (pool.k_buffer, pool.v_buffer):
            buffer.view(torch.int16).fill_(0x5A5A)

    # The request misses in device and host memory; the scheduler has the tree prefetch it from
    # the tier (_prefetch_kvcache) and admits it once check_prefetch_progress says the prefetch is done.
    req = _request(stack, token_ids)
    try:
        match = _match(stack, req, token_ids)
        assert (match.device_prefix_len, match.host_hit_length) == (0, 0), f"nothing should be left in memory: {match}"
        handle = req.cache_request_handle
        with contextlib.ExitStack() as recording:
            acks = _record_puts(stack.controller.ack_prefetch_queue, recording)
            tree.prefetch_from_storage(handle, match.last_host_node, array("q", token_ids), tree.get_last_hash_value(match.last_host_node), matched_prefix_tokens=array("q"))
            assert tree.ongoing_prefetch, "the tree should prefetch the prompt from the file tier"
            poll(stack, lambda: not tree.check_prefetch_progress(handle), "the prefetch from the file tier", timeout)
        loaded, _ = tree.pop_prefetch_loaded_span(handle)
    finally:
        stack.req_to_token_pool.free(req)
    assert loaded == tokens, f"prefetched {loaded} of {tokens} tokens from the file tier"
    assert max((ack.completed_tokens or 0 for ack in acks), default=0) == tokens and any(ack.completed_req for ack in acks)
    pool_hits = {}
    for ack in acks:
        pool_hits.update(ack.pool_hits or {})
    assert _swa_pages(pool_hits) == pages, f"SWA pages prefetched: {pool_hits}"
    assert _host_free(stack)[PoolName.KV] == host_free[PoolName.KV] - tokens, "the prefetch should hold the prompt in host rows"

    _load_and_check(stack, token_ids, originals, report, generator, timeout)
    _evict_device(stack, tokens, device_free)
    _evict_host(stack, tokens, host_free)
    return report


def _swa_pages(pool_hits: dict) -> int | None:
    """The SWA pool's page count in a per-pool hit map (keyed by pool name or its string)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    for key, pages in pool_hits.items():
        if key in (PoolName.SWA, PoolName.SWA.value):
            return pages
    return None
