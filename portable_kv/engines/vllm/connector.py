"""PortableKVLayerwiseConnector: vLLM 0.33.0's OffloadingConnector whose same-step cache hits load layer by layer.

vLLM's offloading scheduler loads a cache hit in one of two ways, per request:

- Between steps (`get_num_new_matched_tokens` returns load_async=True): the
  scheduler holds the request (WAITING_FOR_REMOTE_KVS) until the load has
  finished and been reported, and runs it in a later step.  No forward waits
  for that load, so there is nothing to overlap: it loads whole, as the
  OffloadingConnector loads it.
- Within the step (a `sync` load job): the hit fits the step's
  `sync_load_budget_bytes` and the request runs in the same step.  vLLM's
  own worker blocks on the whole hit before the forward.  Here
  `start_load_kv` enqueues the hit one layer after another, in the forward's
  layer order, and `wait_for_layer_load` makes the forward's stream wait
  for the layers it needs, so the forward runs as the layers land.

Everything else is the OffloadingConnector's: its scheduler side whole, its
stores (deferred to the next step's start; `save_kv_layer` does nothing, as
there), its metrics.  The spec is portable_kv's (spec.py), implied when
kv_connector_extra_config names none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .host_tier import Slot, TierTransfer
from .worker import PortableKVOffloadingWorker

SPEC_NAME, SPEC_MODULE = "PortableKVOffloadingSpec", "portable_kv.engines.vllm"
# Per worker and step, the KV bytes loaded within the step when kv_connector_extra_config gives no
# sync_load_budget_bytes: one 32K-token Llama-3-8B hit (32768 tokens x 128 KiB).  vLLM's default, 0,
# would load every hit between steps, where no forward waits and layer-wise loading has nothing to do.
SYNC_LOAD_BUDGET_BYTES = 4 << 30


def layerwise_extra_config(extra: dict[str, Any]) -> dict[str, Any]:
    """kv_connector_extra_config with this connector's defaults filled in (in place, so that the scheduler
    and every worker read the same); refuses another spec and a zero budget by name."""
    name, module = extra.setdefault("spec_name", SPEC_NAME), extra.setdefault("spec_module_path", SPEC_MODULE)
    if (name, module) != (SPEC_NAME, SPEC_MODULE):
        raise ValueError(f"kv_connector_extra_config: PortableKVLayerwiseConnector loads through spec_name {SPEC_NAME!r} from "
                         f"{SPEC_MODULE!r} (or leave both out), got {name!r} from {module!r}; another spec runs under "
                         f"OffloadingConnector")
    budget = extra.setdefault("sync_load_budget_bytes", SYNC_LOAD_BUDGET_BYTES)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"kv_connector_extra_config: sync_load_budget_bytes must be a positive int for "
                         f"PortableKVLayerwiseConnector, got {budget!r}: at 0 vLLM loads every hit between steps, holding its "
                         f"request until the whole hit is in, so no layer is waited for; leave it out for "
                         f"{SYNC_LOAD_BUDGET_BYTES} or use OffloadingConnector")
    return extra


class PortableKVLayerwiseConnector(OffloadingConnector):
    """vLLM's OffloadingConnector over portable_kv's spec, loading same-step hits layer by layer (module docstring).

    `{"kv_connector": "PortableKVLayerwiseConnector", "kv_connector_module_path": "portable_kv.engines.vllm",
    "kv_role": "kv_both", "kv_connector_extra_config": {...}}` with the spec's keys; `spec_name` and
    `spec_module_path` are implied, `sync_load_budget_bytes` defaults to SYNC_LOAD_BUDGET_BYTES.  A hit over
    the step's budget loads whole between steps (module docstring).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        layerwise_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            self.connector_worker = LayerwiseConnectorWorker(self.connector_worker.spec, vllm_config, kv_cache_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # The per-layer waits run between graph pieces; a full graph would replay without them.
        return True

    @property
    def layerwise(self) -> LayerwiseConnectorWorker:
        if not isinstance(self.connector_worker, LayerwiseConnectorWorker):
            raise RuntimeError(f"PortableKVLayerwiseConnector: worker-side call on the {self.role.name} role")
        return self.connector_worker

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's stores and between-step loads as vLLM's; its same-step hits enqueued layer by layer."""
        self.layerwise.start_kv_transfers(self._metadata(), forward_layer_names(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the forward's stream wait until the KV that `layer_name` and the next layer read has landed."""
        self.layerwise.wait_for_layer(layer_name)

    def wait_for_save(self) -> None:
        # Whatever no attention layer waited for lands before anything the next step runs.
        self.layerwise.finish_step()
        super().wait_for_save()

    def _metadata(self) -> OffloadingConnectorMetadata:
        if not isinstance(self._connector_metadata, OffloadingConnectorMetadata):
            raise RuntimeError(f"PortableKVLayerwiseConnector: expected bound OffloadingConnectorMetadata, got "
                               f"{type(self._connector_metadata).__name__}")
        return self._connector_metadata


def forward_layer_names(forward_context: Any) -> list[str]:
    """The attention layers in the order the model registered them, which is the order its forward runs them."""
    layers = getattr(forward_context, "no_compile_layers", None) or {}
    return list(layers)


class LayerwiseConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker, with same-step loads enqueued per layer and waited per layer.

    A layer's KV is written (the step's new tokens) before its attention calls
    `wait_for_layer_load`, into blocks a hit may share (a partial last block),
    so the wait of layer i covers layer i+1 too, and `start_load_kv` waits for
    the first layer: a load never lands on KV the forward has written.  A layer
    name the tier does not know (one that shares another's KV, a layer of a group
    not offloaded) waits for the whole step's loads.
    """

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self.layer_slots: dict[str, tuple[Slot, ...]] = {}
        self._order: tuple[list[str], list[Slot], dict[str, str]] | None = None
        self._order_key: list[str] = []
        self._step_loads: list[TierTransfer] = []
        self._landed: set[Slot] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if not isinstance(self.worker, PortableKVOffloadingWorker):
            raise ValueError(f"PortableKVLayerwiseConnector: the spec's worker is {type(self.worker).__name__}; "
                             f"per-layer loads need {SPEC_NAME}'s")
        groups = [self.kv_cache_config.kv_cache_groups[g] for g in get_offloading_group_ids(self.kv_cache_config)]
        self.layer_slots = self.worker.tier.layer_slots([group.layer_names for group in groups])

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata, forward_names: list[str] | None = None) -> None:
        same_step = {job_id: job for job_id, job in metadata.load_jobs.items() if job.sync}
        if same_step:
            assert isinstance(self.worker, PortableKVOffloadingWorker)
            names, order, _ = self._forward_order(forward_names or [])
            for job_id, job in same_step.items():
                self._load_jobs[job_id] = None  # its request runs this step: no finished_recving, as vLLM's sync loads
                self._step_loads.append(self.worker.submit_layerwise_load(job_id, job.src_spec, job.dst_spec, order))
            self._wait(self.layer_slots[names[0]])
        super().start_kv_transfers(replace(metadata, load_jobs={j: job for j, job in metadata.load_jobs.items() if not job.sync}))

    def wait_for_layer(self, layer_name: str) -> None:
        if not self._step_loads:
            return
        _, order, following = self._forward_order([])
        if layer_name not in self.layer_slots:
            self._wait(order)
            return
        nxt = following.get(layer_name)
        self._wait(self.layer_slots[layer_name] + (self.layer_slots[nxt] if nxt else ()))

    def finish_step(self) -> None:
        if self._step_loads:
            self._wait(self._forward_order([])[1])
        self._step_loads.clear()
        self._landed.clear()

    def _wait(self, slots: tuple[Slot, ...] | list[Slot]) -> None:
        for slot in slots:
            if slot in self._landed:
                continue
            for transfer in self._step_loads:
                for event in transfer.ready(slot):
                    event.wait()
            self._landed.add(slot)

    def _forward_order(self, forward_names: list[str]) -> tuple[list[str], list[Slot], dict[str, str]]:
        """The tier's layer names in forward order (then any the forward context lacks), their slots in
        that order, and each name's next; kept until a forward context names other layers."""
        if self._order is None or (forward_names and forward_names != self._order_key):
            known = [n for n in forward_names if n in self.layer_slots]
            names = known + [n for n in self.layer_slots if n not in set(known)]
            if not names:
                raise ValueError("PortableKVLayerwiseConnector: no offloaded layer is registered; register_kv_caches first")
            order = list(dict.fromkeys(slot for n in names for slot in self.layer_slots[n]))
            self._order, self._order_key = (names, order, dict(zip(names, names[1:]))), list(forward_names)
        return self._order
