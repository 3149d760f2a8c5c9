"""`portable-kv bench --section engine`: the CPU run's rows and columns, the bytes a cache-hit
prefill loads for MiMo-V2-Flash's hybrid geometry, and the bound and break-even formulas."""

from __future__ import annotations

import json

import pytest
import torch

from portable_kv import backends
from portable_kv.bench import engine_geometry as geometry
from portable_kv.bench import engine_report as report
from portable_kv.bench import engine_schedule as schedule
from portable_kv.bench.engine_forward import Forward
from portable_kv.bench.engine_geometry import CPU_MODEL, CPU_QUICK, MIMO_V2_FLASH
from portable_kv.cli import main

CPU_PATHS = backends.get("cpu").io_backends

COLUMNS = ("prefix", "new", "bytes_loaded", "full_bytes", "swa_bytes", "prefill_ms", "compute_ms", "loads_ms", "exposed_ms",
           "recompute_ms", "bound_ms", "prefill_vs_bound", "last_layer_ms", "gflop_full_layer", "gflop_swa_layer", "verified")


def prefill_bytes(model: geometry.Model, prefix: int, page_size: int) -> tuple[int, int]:
    """Written out from the geometry: every full layer the whole prefix; every SWA layer the
    pages of the prefix's last `window` tokens."""
    itemsize = {"bf16": 2, "fp32": 4}[model.dtype]
    full_layers = [i for i in range(model.layers) if i == 0 or (i + 1) % 6 == 0]
    swa_layers = model.layers - len(full_layers)
    window = min(prefix, -(-model.window // page_size) * page_size)
    return (len(full_layers) * prefix * model.full_kv_heads * (model.k_dim + model.v_dim) * itemsize,
            swa_layers * window * model.swa_kv_heads * (model.swa_k_dim + model.swa_v_dim) * itemsize)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "engine.json"
    assert main(["bench", "--section", "engine", "--quick", "--backends", "cpu", "--page-size", "16", "--reps", "3", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    return path, data["rows"], data["meta"]


def test_cpu_run_has_a_row_per_case_and_io_path(cpu_run):
    _, rows, meta = cpu_run
    measured = [r for r in rows if r["section"] == "engine" and "prefill_ms" in r["extra"]]
    assert sorted((r["extra"]["prefix"], r["extra"]["new"], r["extra"]["io"]) for r in measured) == \
        sorted((p, n, io) for p, n in CPU_QUICK for io in CPU_PATHS)
    for r in measured:
        assert set(COLUMNS) <= set(r["extra"]), set(COLUMNS) - set(r["extra"])
    geometry = next(r for r in rows if r["name"] == "geometry")["extra"]
    assert geometry["full_layers"] == [0, 5] and geometry["window"] == CPU_MODEL.window and geometry["sources"]
    assert {r["name"] for r in rows if "break_even_tokens" in r["extra"]} == {f"cpu {io} break-even" for io in CPU_PATHS}
    assert meta["ceiling"]["memcpy"] > 0
    # the auto rows say which path auto took for each pool's loads; the other rows do not
    for r in measured:
        took = r["extra"].get("auto_took")
        if r["extra"]["io"] == "auto":
            assert set(took) == {"full", "swa"} and set(took.values()) <= {"indexing", "direct", "staged"}, took  # the cpu backend's kernel path is torch indexing
        else:
            assert took is None


def test_cpu_run_loads_the_prefix_for_full_layers_and_the_window_for_swa_layers(cpu_run):
    _, rows, _ = cpu_run
    for r in (r for r in rows if "prefill_ms" in r["extra"]):
        e = r["extra"]
        full, swa = prefill_bytes(CPU_MODEL, e["prefix"], r["page_size"])
        assert (e["full_bytes"], e["swa_bytes"], e["bytes_loaded"]) == (full, swa, full + swa)
        assert e["swa_bytes"] < e["full_bytes"]  # the window (16 tokens) is shorter than every prefix
        assert e["verified"] is True, f"{r['name']}: the device slots did not hold the host's K and V after the loads"
        assert r["gbps"] == pytest.approx(e["bytes_loaded"] / (e["loads_ms"] / 1e3) / 1e9, rel=1e-6)


def test_cpu_run_times_against_the_bound(cpu_run):
    _, rows, meta = cpu_run
    rate = meta["ceiling"]["memcpy"] * 1e9
    for r in (r for r in rows if "prefill_ms" in r["extra"]):
        e = r["extra"]
        assert min(e["prefill_ms"], e["compute_ms"], e["loads_ms"], e["recompute_ms"], e["last_layer_ms"]) > 0
        assert e["bound_ms"] >= e["compute_ms"] and e["bound_ms"] / 1e3 >= e["bytes_loaded"] / rate
        assert e["prefill_vs_bound"] == pytest.approx(e["prefill_ms"] / e["bound_ms"], rel=1e-6)
        assert e["exposed_ms"] == pytest.approx(e["prefill_ms"] - e["compute_ms"], abs=1e-9)
        # On the CPU the prefill is the loads then the forward, so it takes at least the forward; a
        # third leaves room for a busy runner's noise (0.6 seen).  What it runs: test_cpu_prefill_schedule.
        assert e["prefill_ms"] >= e["compute_ms"] / 3
        # recomputing the prefix does more work than the cache hit's forward
        assert e["gflop_recompute"] > e["gflop_forward"]


def test_cpu_table_says_where_numbers_come_from_and_rerenders(cpu_run, capsys):
    path, _, _ = cpu_run
    assert main(["bench", "--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not meaningful" in out and "source, scaled" in out and "window 16" in out
    assert "FLOPs per layer, prefix 256 + 32 new" in out and "at the measured link rate" in out
    assert out.count("\ncpu kernel ") == len(CPU_QUICK)


def test_cpu_prefill_schedule():
    """Every layer's load, then every layer's forward, once each, in layer order; the loads bring
    the host's K and V into the prefix's device slots of both pools."""
    before = backends.current().name
    backends.use("cpu")
    pools = schedule.Pools(CPU_MODEL, 16, 64, 16, torch.device("cpu"))
    side = schedule.HostSide(pools)
    try:
        run = schedule.Engine(pools, side, Forward(CPU_MODEL, torch.device("cpu")), "kernel", gpu=False)
        events = []
        loads = [(full, j) for full, j in (pools.slot[i] for i in range(CPU_MODEL.layers))]
        run.load = lambda i, load=run.load: (events.append(("load", i)), load(i))
        run.layers = [lambda i=i, layer=layer: (events.append(("layer", i)), layer()) for i, layer in enumerate(run.layers)]
        run.clear_loaded()
        assert not run.loaded_correctly()
        run.prefill()
        assert events == [("load", i) for i in range(CPU_MODEL.layers)] + [("layer", i) for i in range(CPU_MODEL.layers)]
        assert run.loaded_correctly()
        assert [full for full, _ in loads] == [True, False, False, False, False, True]  # layers 0 and 5 are full
        assert pools.bytes() == prefill_bytes(CPU_MODEL, 64, 16)
    finally:
        side.close()
        backends.use(before)


def test_mimo_geometry_per_gpu():
    m = MIMO_V2_FLASH
    assert m.full_layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert (m.q_heads, m.full_kv_heads, m.swa_kv_heads) == (16, 1, 2)  # 64, 4, 8 heads over attention TP 4
    assert (m.token_layer_bytes(True), m.token_layer_bytes(False)) == (640, 1280)
    full, swa = geometry.expected_bytes(m, 65536, 64)
    assert (full, swa) == prefill_bytes(m, 65536, 64) == (9 * 65536 * 640, 39 * 128 * 1280)
    # a page of 1 or 64 holds the window exactly; a page of 256 loads the window's whole page
    assert geometry.window_tokens(m, 65536, 1) == 128 and geometry.window_tokens(m, 65536, 256) == 256
    assert geometry.window_tokens(m, 64, 64) == 64  # a prefix shorter than the window loads all of it


@pytest.mark.parametrize("prefix,new", [(4096, 512), (65536, 512), (16384, 4096), (0, 16384)])
def test_layer_plan_flops(prefix, new):
    m = MIMO_V2_FLASH
    for layer in (0, 1, 5):
        plan = geometry.layer_plan(m, layer, prefix, new)
        kv = m.kv_heads(layer)
        assert geometry.plan_flops(plan, ("qkv",)) == 2 * new * 4096 * (16 * 192 + kv * (192 + 128))
        assert geometry.plan_flops(plan, ("o",)) == 2 * new * 16 * 128 * 4096
        mlp = 6 * new * 4096 * 2048 + (0 if layer == 0 else 2 * new * 4096 * 256)
        assert geometry.plan_flops(plan, ("router", "gate_up", "down")) == mlp
        exact = geometry.attention_flops(m, layer, prefix, new)
        assert geometry.plan_flops(plan, ("qk", "pv")) == pytest.approx(exact, rel=5e-3)
        for op in plan:
            if op.op == "qk":  # every score tile within its bound, every key inside the layer's pool
                assert op.m * op.n <= geometry.SCORE_ELEMENTS
                assert op.key_start + op.n <= (prefix + new if m.is_full(layer) else m.window)
    assert geometry.attention_flops(m, 1, prefix, new) <= 2 * 16 * 320 * new * 128  # SWA: the window at most


def test_recompute_chunks_cover_the_prompt():
    chunks = geometry.recompute_chunks(MIMO_V2_FLASH, 65536 + 512)
    assert chunks == [(0, 16384), (16384, 16384), (32768, 16384), (49152, 16384), (65536, 512)]


def test_bound_formula():
    # compute-bound: the forward, delayed by the first layer's load
    assert report.bound(compute_s=10.0, first_load_s=1.0, all_loads_s=5.0, last_compute_s=2.0) == 11.0
    # link-bound: every load at the ceiling, then the last layer's compute
    assert report.bound(compute_s=1.0, first_load_s=0.5, all_loads_s=5.0, last_compute_s=0.25) == 5.25


def test_break_even_formula():
    # 1 ms fixed, 0.1 us a token to load, 1 us a token to recompute: 1e-3 / 0.9e-6 tokens
    assert report.break_even_tokens(1e-3, 1e-7, 1e-6) == pytest.approx(1111.1, rel=1e-4)
    assert report.break_even_tokens(0.0, 1e-7, 1e-6) == 0.0
    assert report.break_even_tokens(-1e-4, 1e-7, 1e-6) == 0.0  # a fit's negative intercept is no gain
    assert report.break_even_tokens(1e-3, 1e-6, 1e-6) is None  # loading never wins
    assert report.fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert report.fit_line([4.0], [2.0]) == (0.0, 0.5)
