"""The command line: info, check and bench run and say what they should."""

from __future__ import annotations

import json

from portable_kv import backends
from portable_kv.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "io backends" in out and "available" in out


def test_check_passes_every_layout_and_io(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 8 and "8 passed, 0 failed" in out


def test_bench_writes_table_and_json(tmp_path, capsys):
    """The CPU-backend run, on any machine (a GPU machine's full bench belongs to scripts/gpu_round.sh)."""
    path = tmp_path / "bench.json"
    before = backends.current().name
    backends.use("cpu")
    try:
        assert main(["bench", "--quick", "--page-size", "4", "--pages", "4", "--reps", "2", "--backends", "cpu", "--json", str(path)]) == 0
    finally:
        backends.use(before)
    out = capsys.readouterr().out
    assert "say nothing about GPUs" in out and "ceiling" in out
    data = json.loads(path.read_text())
    names = {row["name"] for row in data["rows"]}
    assert any("page_first_direct kernel" in n for n in names) and data["meta"]["ceiling"]["h2d"] > 0
    assert all(row["gbps"] > 0 for row in data["rows"] if row["section"] == "package")
