"""portable_kv/bench/vllm_prefill.py on the cpu backend (no vllm needed: it drives the spec's vllm-free host tier)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from portable_kv.bench import vllm_prefill
from portable_kv.bench.measure import Clock
from portable_kv.bench.progress import Progress
from portable_kv.engines.vllm.host_tier import Slot


def test_the_prefill_rows_run_tiny_on_the_cpu_backend(cpu_backend):
    ctx = SimpleNamespace(gpu=False, quick=True, reps=1, ceil={"memcpy": 10.0}, clock=Clock(cpu_backend.device), device=cpu_backend.device,
                          progress=Progress(io.StringIO()))
    rows = vllm_prefill.measure(ctx)
    hit = vllm_prefill.CPU_HITS[0]
    names = [r.name.split(f"hit {hit} + {vllm_prefill.CPU_NEW_TOKENS} ")[1] for r in rows]
    assert names == ["forward alone", "loads alone (kernel)", "whole hit, then the forward (kernel)",
                     "layer-wise loads beside the forward (kernel)"]
    model = vllm_prefill.CPU_MODEL
    assert all(r.extra["hit_bytes"] == hit * model.kv_bytes * model.layers and r.extra["ms"] > 0 for r in rows)
    assert rows[0].extra["x_bound"] == rows[0].extra["forward_ms"] / rows[0].extra["bound_ms"]
    assert rows[1].gbps > 0 and rows[2].gbps == 0


def test_layerwise_prefill_loads_every_layer_once_in_order_and_waits_before_each_attention(monkeypatch, cpu_backend):
    model = vllm_prefill.CPU_MODEL
    forward = vllm_prefill.Forward(model, 64, 8, cpu_backend.device)
    hit = vllm_prefill.Hit(model, 64, "kernel", cpu_backend.device)
    events: list[tuple] = []
    monkeypatch.setattr(hit.transfer, "run_layers", lambda order: events.append(("loads", tuple(order))))
    monkeypatch.setattr(hit, "wait", lambda *layers: events.append(("wait", *layers)))
    monkeypatch.setattr(forward, "rest", lambda: events.append(("attention",)))
    try:
        vllm_prefill.Prefill(forward, hit, gpu=False).layerwise()
    finally:
        hit.close()
    layers = model.layers
    assert events[0] == ("loads", tuple(Slot(0, i) for i in range(layers)))
    assert events[1:] == [("wait", 0)] + [e for i in range(layers) for e in (("wait", i, i + 1), ("attention",))]


def test_a_hit_moves_the_hit_bytes_to_its_blocks(cpu_backend):
    model = vllm_prefill.CPU_MODEL
    hit = vllm_prefill.Hit(model, 64, "kernel", cpu_backend.device)
    try:
        for t in range(model.layers):
            hit.tier.chunk_view(t).copy_(torch.randint(0, 255, hit.tier.chunk_view(t).shape, dtype=torch.uint8))
        hit.transfer.run()
        # The hit's host chunks land in the layer's blocks in a shuffled order: every block one chunk's bytes.
        for t, tensor in enumerate(hit.tensors):
            host = hit.tier.chunk_view(t)
            assert sorted(map(bytes, tensor.view(torch.uint8).numpy())) == sorted(map(bytes, host.numpy()))
            assert not torch.equal(tensor.view(torch.uint8), host)
    finally:
        hit.close()
