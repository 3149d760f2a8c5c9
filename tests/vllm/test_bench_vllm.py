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
