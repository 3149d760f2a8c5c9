"""Every benchmark section smoke-runs on the cpu backend; the parts they share: the section
registry, draws in turn with their median and spread, which path auto took from a pool's
counters, the progress lines, and SGLang's kernels absent with their reason."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest

from portable_kv import backends
from portable_kv.bench import draws, io_paths, registry, run
from portable_kv.bench.progress import Progress
from portable_kv.cli import main

SMOKE = ("--quick", "--page-size", "4", "--pages", "4", "--reps", "2", "--draws", "2", "--backends", "cpu")


@pytest.mark.parametrize("section", [s for s in registry.SECTIONS if s not in ("both-ways", "engine")])
def test_every_section_runs_on_the_cpu_backend(section, tmp_path, capsys):
    path = tmp_path / "run.json"
    assert main(["bench", "--section", section, *SMOKE, "--mla-dim", "40", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert rows[0]["section"] == "ceiling" and len(rows) > 1
    err = capsys.readouterr().err
    assert "left:" in err  # the progress lines count the work and say the time left


def test_every_registered_function_resolves():
    for name, section in registry.SECTIONS.items():
        for spec in filter(None, (section.measure, section.table, section.markdown)):
            assert callable(run.resolve(spec)), (name, spec)


def test_staged_rows_cover_every_io_path_and_say_why_sglang_is_absent(tmp_path):
    path = tmp_path / "staged.json"
    assert main(["bench", "--section", "staged", *SMOKE, "--mla-dim", "40", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    names = {r["name"] for r in rows}
    for path in backends.get("cpu").io_backends:  # every path the backend offers, none hard-coded
        assert f"cpu {path}, allocator host pages" in names, path
        assert f"cpu {path}, MHA 8x128, allocator host pages, layer_first host" in names, path
    absent = [r for r in rows if r["name"].startswith("peer: SGLang JIT kernels")]
    assert absent and all(r["extra"]["absent"] and "\n" not in r["extra"]["absent"] for r in absent)
    assert not any(r["gbps"] for r in absent)  # a reason, never a number


def test_host_cost_reports_small_and_large_calls_for_every_path(tmp_path):
    path = tmp_path / "host_cost.json"
    assert main(["bench", "--section", "host-cost", "--quick", "--reps", "2", "--backends", "cpu", "--json", str(path)]) == 0
    rows = [r for r in json.loads(path.read_text())["rows"] if r["section"] == "host_cost"]
    measured = {(r["extra"]["io"], r["extra"]["pages"]) for r in rows if "io" in r["extra"] and r["extra"]["io"] != "peer"}
    assert measured == {(io, pages) for io in backends.get("cpu").io_backends for pages in (4, 16)}
    apis = {r["extra"]["api"] for r in rows if r["extra"].get("io") == "kernel"}
    assert apis == {"per-layer load", "SGLang hook, load_to_device_per_layer_physical", "prepared plan.load",
                    "per-layer load, 8 index sets in turn", "prepared plan.load, 8 plans in turn"}
    assert all(r["host_us"] > 0 and r["extra"]["draws"] >= 1 for r in rows if "api" in r["extra"] and "absent" not in r["extra"])
    peers = [r for r in rows if r["extra"].get("io") == "peer"]
    assert peers and all("absent" in r["extra"] for r in peers), "SGLang's kernel does not run on the CPU: each size says why"
    assert any(r["name"].startswith("yardstick") for r in rows)


def test_draws_alternate_between_paths():
    order = []

    def draw(path: str) -> dict[str, float]:
        order.append(path)
        return {"gbps": float(len(order))}

    drawn = draws.alternate(["a", "b", "c"], draw, 3, Progress(io.StringIO()), "test")
    assert order == ["a", "b", "c"] * 3
    assert [d["gbps"] for d in drawn["b"]] == [2.0, 5.0, 8.0]


def test_summary_is_median_and_spread():
    summary = draws.summarize([{"gbps": 3.0, "host_us": 10.0}, {"gbps": 1.0, "host_us": 30.0}, {"gbps": 2.0, "host_us": 20.0}])
    assert summary == {"draws": 3, "gbps": 2.0, "gbps_min": 1.0, "gbps_max": 3.0, "host_us": 20.0, "host_us_min": 10.0, "host_us_max": 30.0}
    assert draws.spread_text(summary, "gbps") == "2.0 (1.0 to 3.0)"
    assert draws.spread_text({"gbps": 4.0}, "gbps") == "4.0"  # a row drawn once: its value


def test_progress_counts_and_estimates_the_time_left():
    out = io.StringIO()
    progress = Progress(out)
    progress.expect(4)
    progress.done("first")
    progress.done("second", units=3)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[bench] 1/4, ~") and lines[0].endswith("left: first")
    assert lines[1] == "[bench] 4/4, ~0s left: second"


class CountingPool:
    """A host pool with the counters of `stats()` (docs/API.md): the paths auto took."""

    def __init__(self) -> None:
        self.choices = Counter()

    def stats(self) -> dict:
        return {"load": {}, "backup": {}, "last_error": None,
                "paths": {"auto": {path: {"calls": n, "reason": f"why {path}"} for path, n in self.choices.items()}}}


def test_auto_watch_counts_the_paths_auto_took_over_its_span():
    pool = CountingPool()
    pool.choices["kernel"] = 7  # before the watch: not counted
    watch = io_paths.AutoWatch(pool)
    assert watch.took() == "" and watch.reasons() == {}
    pool.choices["bulk"] += 5
    assert watch.took() == "bulk" and watch.reasons() == {"bulk": "why bulk"}
    pool.choices["kernel"] += 2
    assert watch.took() == "bulk x5, kernel x2"


