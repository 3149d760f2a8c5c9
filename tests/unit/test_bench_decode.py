"""`portable-kv bench --section decode`: on the CPU backend the section runs end to end, a row per
io path and peer, the bytes the host tier moved as its pool counts them, and the step's shape."""

from __future__ import annotations

import json
import math

import pytest
import torch

from portable_kv import backends
from portable_kv.bench.decode_step import CPU_MODEL, GPU_MODEL, DecodeStep, run_steps
from portable_kv.bench.rows import Row
from portable_kv.cli import main

CPU_PATHS = backends.get("cpu").io_backends
PAGE = 64
PAGES = 9  # a load of 9 pages a layer; a backup of round(9 / 2 layers) = 4 pages of each of 2 layers: 8 pages' bytes
TOKEN_LAYER_BYTES = 8 * (128 + 128) * 2  # the host tier's pool: 8 KV heads of 128, K and V, bf16


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    path, md = out / "decode.json", out / "decode.md"
    assert main(["bench", "--section", "decode", "--quick", "--backends", "cpu", "--page-size", str(PAGE), "--pages", str(PAGES),
                 "--draws", "2", "--json", str(path)]) == 0
    assert main(["bench", "--from-json", str(path), "--markdown", str(md)]) == 0
    data = json.loads(path.read_text())
    return [Row(**r) for r in data["rows"] if r["section"] == "decode"], md.read_text()


def test_every_io_path_and_the_torch_peer_run_beside_the_step_with_finite_ratios(cpu_run):
    rows, _ = cpu_run
    measured = {r.name: r for r in rows if "p50_x" in r.extra}
    assert set(measured) == {f"cpu {io}" for io in CPU_PATHS} | {"peer: torch copy_ per page"}
    for r in measured.values():
        for key in ("p50_x", "p99_x", "gbps", "host_ms"):
            assert math.isfinite(r.extra[key]) and r.extra[key] > 0, (r.name, key, r.extra[key])
        assert r.extra["draws"] == 2 and r.extra["p50_x_min"] <= r.extra["p50_x"] <= r.extra["p50_x_max"]
        assert r.extra["verified"] is True, r.name
        assert r.gbps == r.extra["gbps"] and r.direction == "both" and r.page_size == PAGE
    assert measured["cpu auto"].extra["auto_took"]


def test_the_host_tier_moves_the_bytes_offered_and_the_pool_counts_them(cpu_run):
    rows, _ = cpu_run
    alone = next(r for r in rows if r.name == "step alone").extra
    assert alone["layers"] == CPU_MODEL.layers and alone["calls_per_step"] == 2
    load, backup = PAGES * PAGE * TOKEN_LAYER_BYTES, 4 * PAGE * CPU_MODEL.layers * TOKEN_LAYER_BYTES
    assert (alone["load_bytes"], alone["backup_bytes"]) == (load, backup)
    offered = alone["steps_per_draw"] * (load + backup)  # a load and a backup before each step
    for r in rows:
        if "p50_x" in r.extra:
            assert r.extra["bytes_min"] == r.extra["bytes_max"] == offered, r.name
            assert r.extra["kept_pct"] == 100  # on the CPU a call's copy is done when it returns
    for io in CPU_PATHS:
        counted = next(r for r in rows if r.name == f"cpu {io}").extra
        assert counted["counted_bytes_min"] == counted["counted_bytes_max"] == offered, io


def test_a_peer_that_cannot_run_here_says_why(cpu_run):
    rows, md = cpu_run
    sglang = next(r for r in rows if r.name == "peer: SGLang JIT kernel")
    assert sglang.extra["absent"] and "p50_x" not in sglang.extra
    assert f"| peer: SGLang JIT kernel | not measured: {sglang.extra['absent']}" in md
    assert "| cpu kernel |" in md and "step alone" in md


def test_steps_count_their_transfers_in_turn():
    step = DecodeStep(CPU_MODEL, 2, 16, 1, torch.device("cpu"))
    issued = []
    out = run_steps(step, 4, False, issued.append, calls=3, call_bytes=lambda n: 10 if n % 2 else 100)
    assert issued == list(range(12))
    assert out["bytes"] == 6 * 100 + 6 * 10 and out["kept_pct"] == 100
    assert out["p99_ms"] >= out["p50_ms"] > 0
    issued.clear()
    out = run_steps(step, 4, False, issued.append, calls=1.5, call_bytes=lambda n: 10 if n % 2 else 100)
    assert issued == list(range(6)) and out["bytes"] == 3 * 100 + 3 * 10  # a call and a half a step, on average


def test_the_gpu_step_reads_llama_3_8b_weights_and_the_batch_kv():
    # 6.98 B parameters a step's layers read (Llama-3-8B without its embeddings), bf16
    assert GPU_MODEL.weight_bytes(32) == 32 * 218_103_808 * 2
    # batch 64 x 4096 tokens: K and V of 8 heads of 128 in 32 layers, bf16: 32 GiB
    assert GPU_MODEL.kv_bytes(32, 64, 4096) == 32 << 30
