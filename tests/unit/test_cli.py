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
        assert main(["bench", "--quick", "--page-size", "4", "--pages", "4", "--reps", "2", "--backends", "cpu", "--json", str(path),
                     "--markdown", str(tmp_path / "bench.md")]) == 0
    finally:
        backends.use(before)
    out = capsys.readouterr().out
    assert "say nothing about GPUs" in out and "ceiling" in out
    data = json.loads(path.read_text())
    names = {row["name"] for row in data["rows"]}
    assert any("page_first_direct kernel" in n for n in names) and data["meta"]["ceiling"]["h2d"] > 0
    assert all(row["gbps"] > 0 for row in data["rows"] if row["section"] == "package")
    table = (tmp_path / "bench.md").read_text()
    assert main(["bench", "--from-json", str(path), "--markdown", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == table  # the same summary from the saved rows
    assert "CPU backend" in table and "| cpu kernel, page_first_direct | " in table and "| cpu direct, page_first_direct | " in table


def test_markdown_summary_of_gpu_sections():
    from portable_kv.bench import Row, markdown

    rows = [
        Row("package", "cuda page_first_direct kernel", "h2d", 64, 50.4, 91.2, 9.8, 16),
        Row("package", "cuda page_first_direct kernel", "d2h", 64, 51.8, 93.7, 12.0, 16),
        Row("package", "cuda page_first_direct kernel", "h2d", 1, 50.2, 90.9, 10.1, 16),
        Row("package", "cuda page_first kernel", "h2d", 64, 40.0, 72.0, 9.0, 16),
        Row("peer", "per-page copy_ loop", "h2d", 64, 8.6, 15.5, 11500.0),
        Row("block_quota", "cuda kernel, 8 blocks", "h2d", 64, 41.2, 74.4, grid=8, extra={"block_quota": 8}),
        Row("block_quota", "cuda kernel, 8 blocks", "d2h", 64, 52.3, 94.7, grid=8, extra={"block_quota": 8}),
        Row("block_quota", "cuda kernel, 16 blocks", "h2d", 64, 50.4, 91.2, grid=16, extra={"block_quota": 16}),
        Row("both", "cuda load kernel + backup kernel at once", "both", 64, 61.3, 61.5),
        Row("interference", "cuda kernel load during matmul", "h2d", 64, 32.0, extra={"matmul_slowdown_pct": 4.25}),
    ]
    text = markdown(rows, {"h2d": 55.3, "d2h": 55.2, "both": 99.7}, "NVIDIA H200")
    assert "55.3, 55.2, 99.7 GB/s" in text
    assert "| cuda kernel, page_first_direct | 50.4 (91%) / 51.8 (94%) | 50.2 (91%) | 10 |" in text
    assert "page_first kernel" not in text  # the README table is the page_first_direct one
    assert "| peer: per-page copy_ loop | 8.6 (16%) |  | 11500 |" in text
    assert "| 8 blocks | 16 blocks |" in text and "| cuda, page 64 | 41.2 / 52.3 | 50.4 |" in text
    assert "| cuda load kernel + backup kernel at once | 61.3 | 62% |" in text and "| +4.2% |  |" in text


def test_every_test_file_is_collected_and_tracked():
    """tests/build/ once held the toolchain tests: pytest's default norecursedirs skips
    'build' and .gitignore dropped it, so CI compiled no kernel until this test existed."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    skipped_by_pytest = {"build", "dist", "venv", "node_modules", "CVS", "_darcs"}
    files = sorted(p.relative_to(root) for p in (root / "tests").rglob("test_*.py"))
    assert any(p.parts[1] == "toolchains" for p in files)
    for path in files:
        assert not skipped_by_pytest & set(path.parts), f"{path} sits where pytest does not look"
    if (root / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", *map(str, files)], cwd=root, capture_output=True, text=True).stdout.split()
        assert not ignored, f"test files ignored by git: {ignored}"
