"""PortableKVLayerwiseConnector as vLLM 0.33.0 builds and steps it: its factory, its scheduler, a forward's layers.

vllm_engine.py steps vLLM's own `Scheduler` and a worker-side connector the
way vLLM's model runner does.  Request "a" computes a prompt, its blocks are
stored to the host tier, the GPU prefix cache is reset, and request "b" with
the same first 64 tokens gets them as a cache hit from the host tier.  Every
plan the host pools prepare is recorded (calls and waits), so the tests see
which layer each call moved and when the forward waited for it.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM's scheduler does not import here (tox -e vllm installs it)")

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_engine import BLOCK, LAYERS, Engine, engine, layerwise_config, token_kv, whole_hit_config  # noqa: E402

from portable_kv.engines.vllm import PortableKVLayerwiseConnector  # noqa: E402
from portable_kv.engines.vllm.connector import SYNC_LOAD_BUDGET_BYTES  # noqa: E402
from portable_kv.engines.vllm.host_tier import Slot  # noqa: E402
from portable_kv.engines.vllm.worker import PortableKVOffloadingWorker  # noqa: E402
from portable_kv.mla import MLAHostPool  # noqa: E402

PROMPT = [(7 * i) % 991 + 1 for i in range(70)]
HIT = 64  # four whole blocks of "a"'s prompt are stored: the hit "b" gets


class RecordedPlan:
    """A host pool's plan, its calls and its waits appended to the engine's trace."""

    def __init__(self, plan: Any, trace: list[tuple], background: bool) -> None:
        self.plan, self.trace, self.background = plan, trace, background

    def load(self, layer_id: int) -> None:
        self.trace.append(("load", layer_id))
        self.plan.load(layer_id)

    def load_all(self) -> None:
        self.trace.append(("load_all",))
        self.plan.load_all()

    def backup(self, layer_id: int | None = None) -> None:
        self.trace.append(("backup", layer_id))
        self.plan.backup(layer_id)

    def ready(self, layer_id: int) -> Any:
        landed, trace = self.plan.ready(layer_id), self.trace

        class Recorded:
            def wait(self, stream: Any = None) -> None:
                trace.append(("landed", layer_id))
                landed.wait(stream)

        return Recorded()


def recorded(monkeypatch: pytest.MonkeyPatch, run: Engine) -> list[dict]:
    """Record every plan the host pools prepare from now on; returns what each prepare was asked."""
    prepared: list[dict] = []
    prepare = MLAHostPool.prepare

    def recording(pool: Any, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any = None, background: bool = False) -> Any:
        prepared.append({"tokens": len(host_indices), "background": background, "io": io_backend})
        return RecordedPlan(prepare(pool, device_pool, host_indices, device_indices, io_backend, background), run.trace, background)

    monkeypatch.setattr(MLAHostPool, "prepare", recording)
    return prepared


def hit_after_store(run: Engine) -> None:
    """'a' computes and stores its prompt; with the GPU prefix cache reset, 'b' meets those blocks only on the host."""
    run.add("a", PROMPT)
    run.run()
    assert run.scheduler.reset_prefix_cache()
    run.add("b", PROMPT[:HIT] + [5] * 20)
    run.run()


def hit_step(run: Engine) -> Any:
    (step,) = [s for s in run.steps if any(job.req_id == "b" for job in s.kv_connector_metadata.load_jobs.values())]
    return step


def test_vllms_factory_builds_the_connector_by_name_on_both_sides(tmp_path):
    run = engine(tmp_path, layerwise_config())
    assert type(run.scheduler.connector) is PortableKVLayerwiseConnector
    assert type(run.connector) is PortableKVLayerwiseConnector
    assert isinstance(run.connector.connector_worker.worker, PortableKVOffloadingWorker)
    extra = run.scheduler.connector._kv_transfer_config.kv_connector_extra_config
    assert (extra["spec_name"], extra["spec_module_path"]) == ("PortableKVOffloadingSpec", "portable_kv.engines.vllm")
    assert run.scheduler.connector.scheduler.config.sync_load_budget_bytes == SYNC_LOAD_BUDGET_BYTES
    assert PortableKVLayerwiseConnector.requires_piecewise_for_cudagraph(extra)
    # One slot a layer: the four per-layer tensors are the four layers of one device pool.
    assert [run.connector.layerwise.layer_slots[name] for name in LAYERS] == [(Slot(0, i),) for i in range(4)]


def test_a_hit_loads_layer_by_layer_and_each_layer_waits_for_its_own_and_the_next(monkeypatch, tmp_path):
    run = engine(tmp_path, layerwise_config())
    prepared = recorded(monkeypatch, run)
    hit_after_store(run)

    step = hit_step(run)
    (job,) = step.kv_connector_metadata.load_jobs.values()
    assert job.sync and step.has_sync_kv_loads  # vLLM runs "b" in the step that loads its hit
    start = run.trace.index(("start_load_kv",))
    forward = run.trace[start:]
    forward = forward[: forward.index(("wait", LAYERS[-1])) + 1]
    # Every layer's load is enqueued, in the forward's layer order, before the forward's first layer runs.
    assert forward[1:5] == [("load", 0), ("load", 1), ("load", 2), ("load", 3)]
    # Layer i+1's load has landed before layer i+1 writes its new KV (the write comes before its attention's wait),
    # and each layer's own load before its attention: layer 0's at start_load_kv.
    assert forward[5:] == [("landed", 0), ("write", LAYERS[0]), ("wait", LAYERS[0]),
                           ("landed", 1), ("write", LAYERS[1]), ("wait", LAYERS[1]),
                           ("landed", 2), ("write", LAYERS[2]), ("wait", LAYERS[2]),
                           ("landed", 3), ("write", LAYERS[3]), ("wait", LAYERS[3])]
    loads = [p for p in prepared if not p["background"]]
    assert [p["tokens"] for p in loads] == [HIT // BLOCK]  # one plan for the job: its four blocks
    assert not [e for e in run.trace if e == ("load_all",)]
    stores = [p for p in prepared if p["background"]]
    assert stores and all(p["tokens"] > 0 for p in stores)


def test_a_layer_the_connector_does_not_know_waits_for_the_whole_hit(monkeypatch, tmp_path):
    run = engine(tmp_path, layerwise_config())
    run.leading_layers = ["model.shared.attn"]  # e.g. a layer reading another layer's KV (vLLM's KV sharing)
    recorded(monkeypatch, run)
    hit_after_store(run)

    forward = run.trace[run.trace.index(("start_load_kv",)):]
    forward = forward[: forward.index(("wait", LAYERS[-1])) + 1]
    assert forward[5:11] == [("landed", 0), ("wait", "model.shared.attn"), ("landed", 1), ("landed", 2), ("landed", 3),
                             ("write", LAYERS[0])]
    assert not [e for e in forward[11:] if e[0] == "landed"]  # every layer had landed: nothing left to wait for


def final_caches(tmp_path, connector: dict[str, Any], **extra: Any) -> tuple[Engine, dict[str, torch.Tensor]]:
    run = engine(tmp_path, connector, **extra)
    hit_after_store(run)
    return run, {name: t.clone() for name, t in run.kv_caches.items()}


def test_the_hit_bytes_are_the_whole_hit_offloading_connectors(tmp_path):
    layerwise, got = final_caches(tmp_path / "layerwise", layerwise_config())
    whole, want = final_caches(tmp_path / "whole", whole_hit_config(), sync_load_budget_bytes=SYNC_LOAD_BUDGET_BYTES)
    assert hit_step(whole).has_sync_kv_loads and hit_step(layerwise).has_sync_kv_loads
    for name in LAYERS:
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), f"{name}: blocks differ from the whole-hit path"
    # "b"'s step wrote tokens 64..83 only: its first four blocks hold "a"'s KV because the host tier loaded them.
    (job,) = hit_step(layerwise).kv_connector_metadata.load_jobs.values()
    blocks = [int(b) for b in job.dst_spec.block_ids]
    assert len(blocks) == HIT // BLOCK
    for layer, name in enumerate(LAYERS):
        for position in (0, 17, HIT - 1):
            loaded = got[name][blocks[position // BLOCK], :, position % BLOCK]
            assert torch.equal(loaded, token_kv(layer, PROMPT[position], position)), f"{name} token {position}"


def test_a_hit_over_the_steps_budget_loads_whole_between_steps(monkeypatch, tmp_path):
    run = engine(tmp_path, layerwise_config(), sync_load_budget_bytes=1)
    seen: list[RequestStatus] = []
    run.on_step = lambda out: seen.append(run.scheduler.requests["b"].status) if "b" in run.scheduler.requests else None
    recorded(monkeypatch, run)
    hit_after_store(run)

    step = hit_step(run)
    (job,) = step.kv_connector_metadata.load_jobs.values()
    assert not job.sync and not step.has_sync_kv_loads and "b" not in step.num_scheduled_tokens
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in seen  # vLLM held "b" until its whole hit was in
    assert ("load_all",) in run.trace and not [e for e in run.trace if e[0] == "load"]
    assert not [e for e in run.trace if e[0] == "landed"]  # no forward waited on a layer


def test_a_zero_budget_and_another_spec_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="sync_load_budget_bytes must be a positive int.*OffloadingConnector"):
        engine(tmp_path, layerwise_config(), sync_load_budget_bytes=0)
    with pytest.raises(ValueError, match="spec_name 'PortableKVOffloadingSpec'.*'CPUOffloadingSpec'"):
        engine(tmp_path, layerwise_config(), spec_name="CPUOffloadingSpec")
