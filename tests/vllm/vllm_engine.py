"""vLLM 0.33.0's own scheduler and a KV connector built by its factory, stepped as its engine steps them, on the CPU.

A tiny Llama-shaped model (4 layers, block_size 16) whose config is a local
config.json.  The scheduler is vLLM's `Scheduler`, which builds the
scheduler-side connector itself from `kv_transfer_config`; the worker-side
connector comes from vLLM's `KVConnectorFactory` with the same config.  A
step does what vLLM's model runner does around a forward
(kv_connector_model_runner_mixin.py): bind the step's metadata, start the
loads before the forward where the step has same-step loads (after it
otherwise), run the attention layers (each: `wait_for_layer_load`, write the
scheduled tokens' KV into the paged buffers, `save_kv_layer`), `wait_for_save`,
collect finished transfers and the worker metadata, hand them back to the
scheduler.  The "model" writes KV that is a function of the layer, the token
and its position, so a token's KV is the same whichever request computed it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM's scheduler does not import here (tox -e vllm installs it)")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
KV_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 64, 64
EOS = 999


def layerwise_config() -> dict[str, Any]:
    return {"kv_connector": "PortableKVLayerwiseConnector", "kv_connector_module_path": "portable_kv.engines.vllm"}


def whole_hit_config() -> dict[str, Any]:
    """vLLM's own OffloadingConnector over portable_kv's spec, hits in budget loaded within the step, whole."""
    return {"kv_connector": "OffloadingConnector",
            "extra": {"spec_name": "PortableKVOffloadingSpec", "spec_module_path": "portable_kv.engines.vllm"}}


def vllm_config(tmp_path: Path, connector: dict[str, Any], **extra: Any) -> VllmConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * 2 * HEAD_DIM, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": KV_HEADS, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)
    transfer = KVTransferConfig(kv_connector=connector["kv_connector"], kv_connector_module_path=connector.get("kv_connector_module_path"),
                                kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22, **connector.get("extra", {}), **extra})
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                        kv_transfer_config=transfer,
                        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=2048,
                                                         is_encoder_decoder=False))
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    return KVCacheConfig(num_blocks=NUM_BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS * len(LAYERS), layers=list(LAYERS),
                                                         layer_stride=page * NUM_BLOCKS, block_stride=page)],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def token_kv(layer: int, token: int, position: int) -> torch.Tensor:
    """What the model writes for one token of one layer: K and V of every head, a function of its arguments."""
    gen = torch.Generator().manual_seed(layer * 1_000_003 + token * 4099 + position)
    return torch.randn(2, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)


@dataclass
class Engine:
    """vLLM's scheduler and a worker-side connector over one set of paged KV buffers."""

    scheduler: Scheduler
    connector: Any  # the worker-side connector
    kv_caches: dict[str, torch.Tensor]
    # What happened, in order: ("start_load_kv",), ("write", layer name), ("wait", layer name); tests add the plans' calls.
    trace: list[tuple] = field(default_factory=list)
    steps: list[SchedulerOutput] = field(default_factory=list)
    on_step: Callable[[SchedulerOutput], None] | None = None
    # Attention layers the forward runs before the model's own (a name the connector may not know), each called as a layer is.
    leading_layers: list[str] = field(default_factory=list)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, prompt, params, None, block_hasher=get_request_block_hasher(BLOCK, sha256)))

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.steps.append(out)
        if self.on_step is not None:
            self.on_step(out)
        connector = self.connector
        connector.bind_connector_metadata(out.kv_connector_metadata)
        context = ForwardContext(no_compile_layers={name: None for name in LAYERS}, attn_metadata={name: object() for name in LAYERS},
                                 slot_mapping={})
        if out.has_sync_kv_loads:
            self.trace.append(("start_load_kv",))
            connector.start_load_kv(context)
        for name in self.leading_layers if out.total_num_scheduled_tokens else []:
            self.trace.append(("wait", name))
            connector.wait_for_layer_load(name)
        for layer, name in enumerate(LAYERS):
            if out.total_num_scheduled_tokens:
                # vLLM writes the layer's new KV (unified_kv_cache_update) before its attention waits.
                self._write(out, layer, name)
                self.trace.append(("wait", name))
                connector.wait_for_layer_load(name)
                connector.save_kv_layer(name, self.kv_caches[name], None)
        if not out.has_sync_kv_loads:
            connector.start_load_kv(context)
        connector.wait_for_save()
        _, recving = connector.get_finished(out.finished_req_ids)
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[EOS] if self._prefilled(out, r) else [] for r in req_ids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)))
        return out

    def run(self, max_steps: int = 20) -> None:
        """Step until no request is left and the connector has no transfer in flight."""
        for _ in range(max_steps):
            self.step()
            if not self.scheduler.has_requests() and not self.scheduler.connector.has_pending_push_work():
                return
        raise AssertionError(f"still busy after {max_steps} steps")

    def _blocks_and_start(self, out: SchedulerOutput, req_id: str) -> tuple[list[int], int]:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.block_ids[0], new.num_computed_tokens
        request = self.scheduler.requests[req_id]
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)[0], request.num_computed_tokens - out.num_scheduled_tokens[req_id]

    def _prefilled(self, out: SchedulerOutput, req_id: str) -> bool:
        """Whether the step computed the request's last prompt token, so that it samples one."""
        _, start = self._blocks_and_start(out, req_id)
        return start + out.num_scheduled_tokens[req_id] >= self.scheduler.requests[req_id].num_prompt_tokens

    def _write(self, out: SchedulerOutput, layer: int, name: str) -> None:
        self.trace.append(("write", name))
        cache = self.kv_caches[name]  # (num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM)
        for req_id, count in out.num_scheduled_tokens.items():
            blocks, start = self._blocks_and_start(out, req_id)
            tokens = self.scheduler.requests[req_id].all_token_ids
            for position in range(start, start + count):
                cache[blocks[position // BLOCK], :, position % BLOCK] = token_kv(layer, tokens[position], position)


def engine(tmp_path: Path, connector: dict[str, Any], **extra: Any) -> Engine:
    init_none_hash(sha256)
    config = vllm_config(tmp_path, connector, **extra)
    kv_config = kv_cache_config()
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, log_stats=True)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
    kv_caches = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for name in LAYERS}
    worker.register_kv_caches(kv_caches)
    return Engine(scheduler, worker, kv_caches)
