"""`portable-kv bench --section vllm`, tiny, on the cpu backend (no vllm needed: the spec's host tier is vllm-free)."""

from __future__ import annotations

import json

import numpy as np
import torch

from portable_kv.bench import vllm as bench_vllm
from portable_kv.cli import main


def test_the_vllm_section_runs_tiny_on_the_cpu_backend(tmp_path):
    path = tmp_path / "run.json"
    assert main(["bench", "--section", "vllm", "--quick", "--reps", "2", "--backends", "cpu", "--json", str(path)]) == 0
    rows = [r for r in json.loads(path.read_text())["rows"] if r["section"] == "vllm"]
    cases = {r["name"].split(" portable_kv")[0].split(" peer:")[0] for r in rows}
    assert cases == {f"{m} {k} x{n}" for m in ("Llama-3-8B", "DeepSeek-V3") for k in ("per-layer", "cross-layer") for n in (1, 16)}
    for case in cases:
        mine = [r for r in rows if r["name"].startswith(case) and "portable_kv" in r["name"]]
        assert {r["direction"] for r in mine} == {"h2d", "d2h"} and all(r["gbps"] > 0 for r in mine)
        peer = [r for r in rows if r["name"].startswith(case + " peer: batched memcpy")]
        assert len(peer) == 2 and all(r["extra"]["descriptors"] == 32 * r["extra"]["tensors"] for r in peer)


def test_the_peer_descriptors_are_vllms_block_copies():
    """The batched-memcpy peer copies what the spec moves: each block to its sub-block of its chunk."""
    pages, per_chunk = [64, 64], 4
    tensors = [torch.randint(-128, 128, (16, p), dtype=torch.int8) for p in pages]
    views = [torch.zeros(3, per_chunk * p, dtype=torch.int8) for p in pages]
    blocks, chunks = np.array([9, 2, 5, 14, 7, 0, 11, 3]), np.array([2, 0])
    batch = bench_vllm._descriptors(tensors, views, blocks, chunks, per_chunk, pages, to_device=False)
    import ctypes

    for d, s, n in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
        ctypes.memmove(d, s, n)
    for tensor, view in zip(tensors, views):
        tokens = view.view(-1, 64)
        assert torch.equal(tokens[[8, 9, 10, 11, 0, 1, 2, 3]], tensor[blocks])
        assert not tokens[4:8].any()  # chunk 1 named by no transfer


def test_the_store_and_load_at_once_rows_run_their_own_blocks(monkeypatch):
    """The GPU-only rows of a store and a load at once, their two streams stood in for by running
    one after the other on the cpu backend: a row per path and one for the memcpy, each pair run."""
    from types import SimpleNamespace

    from portable_kv import backends
    from portable_kv.bench.measure import Clock

    pairs = []

    def one_after_the_other(load, store, reps=7):
        pairs.append((load, store))
        load()
        store()
        return 1e-3, 1e-3, 2e-3

    monkeypatch.setattr(bench_vllm, "timed_pair", one_after_the_other)
    backend = backends.use("cpu")
    ctx = SimpleNamespace(gpu=True, reps=2, ceil={"h2d": 1.0, "d2h": 1.0, "both": 2.0}, clock=Clock(backend.device))
    rows = bench_vllm._case(ctx, backend, "tiny", [64, 64], per_chunk=4, blocks=8)
    at_once = [r for r in rows if "at once" in r.name]
    assert len(at_once) == len(backend.io_backends) + 1 == len(pairs)
    assert all(r.direction == "both" and r.extra["h2d_gbps"] > 0 and r.extra["d2h_gbps"] > 0 for r in at_once)
