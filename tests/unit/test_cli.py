"""The command line: every command runs and says what it should; expected failures are one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from portable_kv import backends
from portable_kv.cli import main, parser

ROOT = Path(__file__).resolve().parents[2]


def cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m portable_kv ...` in a fresh process, with extra environment variables."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PORTABLE_KV_")} | env
    return subprocess.run([sys.executable, "-m", "portable_kv", *argv], capture_output=True, text=True, env=environ, timeout=120)


def assert_one_line_failure(run: subprocess.CompletedProcess, *words: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "bound backend" in out and "io backends" in out and "backend cpu     can run here" in out
    assert "PORTABLE_KV_BLOCKS" in out and "PORTABLE_KV_DEBUG" in out  # the settings table


@pytest.mark.skipif(backends.unavailable_reason("cuda") is None, reason="cuda can run on this machine: nothing to refuse")
def test_info_reports_a_forced_backend_that_cannot_run():
    run = cli("info", PORTABLE_KV_BACKEND="cuda")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("backend cuda"))
    assert backends.unavailable_reason("cuda") in line and "forced by PORTABLE_KV_BACKEND" in line
    assert "bound backend" in run.stdout and "none: PORTABLE_KV_BACKEND=cuda" in run.stdout


@pytest.mark.skipif(backends.unavailable_reason("cuda") is None, reason="cuda can run on this machine: nothing to refuse")
def test_commands_on_a_forced_backend_that_cannot_run_fail_in_one_line():
    assert_one_line_failure(cli("bench", "--backends", "cuda", "--quick", PORTABLE_KV_BACKEND="cuda"), "--backends", "cuda")
    assert_one_line_failure(cli("check", PORTABLE_KV_BACKEND="cuda"), "PORTABLE_KV_BACKEND=cuda", "PORTABLE_KV_DEBUG=1")


@pytest.mark.skipif(backends.unavailable_reason("cuda") is None, reason="cuda can run on this machine: nothing to refuse")
def test_debug_setting_shows_the_traceback():
    run = cli("check", PORTABLE_KV_BACKEND="cuda", PORTABLE_KV_DEBUG="1")
    assert run.returncode == 1 and "Traceback" in run.stderr


def test_help_and_version_import_no_torch():
    probe = ("import sys; from portable_kv.cli import main\n"
             "for argv in (['--version'], ['--help'], ['bench', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit as exit:\n        assert exit.code == 0, argv\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    from portable_kv import __version__

    assert f"portable-kv {__version__}" in run.stdout


def test_every_flag_has_help():
    def walk(p):
        for action in p._actions:  # argparse keeps no public list of its arguments
            if action.option_strings:
                yield p.prog, action
            for sub in (action.choices or {}).values() if hasattr(action, "add_parser") else ():
                yield from walk(sub)

    flags = list(walk(parser()))
    assert {"--k-dim", "--v-dim", "--layers", "--reps", "--vendor", "--out"} <= {s for _, a in flags for s in a.option_strings}
    assert not [(prog, a.option_strings) for prog, a in flags if not a.help], "flags without help"


def usage_error(capsys, *argv: str) -> str:
    """The one line the command line says on stderr for `argv`, which it must refuse as a usage error."""
    with pytest.raises(SystemExit) as exit:
        main(list(argv))
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n") and "usage:" not in err, err
    return err.strip()


def test_an_unknown_flag_without_a_command_is_named(capsys):
    err = usage_error(capsys, "--frobnicate")
    assert err == "portable-kv: error: unrecognized arguments: --frobnicate (`portable-kv --help` lists the arguments)", err


def test_an_unknown_flag_before_the_command_is_the_top_levels(capsys):
    err = usage_error(capsys, "--frobnicate", "info")
    assert err.startswith("portable-kv: error: unrecognized arguments: --frobnicate "), err


@pytest.mark.parametrize("command", ["bench", "info", "check", "build --vendor cuda"])
def test_an_unknown_flag_after_a_command_is_named_by_that_command(capsys, command):
    err = usage_error(capsys, *command.split(), "--nope")
    command = command.split()[0]
    assert err == f"portable-kv {command}: error: unrecognized arguments: --nope (`portable-kv {command} --help` lists the arguments)", err


@pytest.mark.parametrize("argv, message", [
    (("bench", "--draws", "many"), "portable-kv bench: error: argument --draws: invalid int value: 'many'"),
    (("bench", "--section", "nope"), "portable-kv bench: error: argument --section: invalid choice: 'nope'"),
    (("build",), "portable-kv build: error: the following arguments are required: --vendor"),
    (("frobnicate",), "portable-kv: error: argument COMMAND: invalid choice: 'frobnicate'"),
])
def test_a_usage_error_is_one_line(capsys, argv, message):
    assert usage_error(capsys, *argv).startswith(message)


def test_a_missing_command_is_still_named(capsys):
    err = usage_error(capsys)
    assert "the following arguments are required: COMMAND" in err, err


def test_check_table_columns_line_up():
    from portable_kv.check import CheckResult, table

    lines = table([CheckResult("layer_first", "kernel", True, 2621440, 0.1, pool="MLA"),
                   CheckResult("page_first_direct", "L3 local", False, 5242880, 0.2, "pages read back from the local store differ")])
    header = lines[0]
    starts = [header.index(name) for name in ("io", "result", "detail")]
    assert lines[1].startswith("MLA ") and lines[2].startswith("MHA ") and header.index("layout") == lines[1].index("layer_first")
    assert lines[1][starts[0]:].startswith("kernel") and lines[2][starts[0]:].startswith("L3 local")
    assert lines[1][starts[1]:].startswith("PASS") and lines[2][starts[1]:].startswith("FAIL")
    assert lines[2][starts[2]:].startswith("pages read back")
    end = header.index("bytes moved") + len("bytes moved")
    assert lines[1][:end].endswith("2621440") and lines[2][:end].endswith("5242880")


@pytest.mark.parametrize("error", [ValueError("layout: expected one of ..., got 'x'"), TypeError("host_indices: expected int64"),
                                   MemoryError("pinned allocation of 64 GiB"), ImportError("No module named 'cuda'", name="cuda"),
                                   OSError(13, "Permission denied")])
def test_expected_failures_are_one_line(monkeypatch, capsys, error):
    def fail(_):
        raise error

    monkeypatch.setattr("portable_kv.cli.cmd_info", fail)
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("portable-kv info: ") and "PORTABLE_KV_DEBUG=1" in err[0]


def test_config_and_backend_errors_say_the_fix(monkeypatch, capsys):
    from portable_kv.backends import BackendUnavailable
    from portable_kv.config import ConfigError

    for error, fix in ((ConfigError("PORTABLE_KV_BLOCKS: expected an integer, got 'x'"), "fix or unset the variable"),
                       (BackendUnavailable("nvcc failed for sm_90: nvcc ...\nline 1\nerror: bad"), "error: bad")):
        monkeypatch.setattr("portable_kv.cli.cmd_info", lambda _, error=error: (_ for _ in ()).throw(error))
        assert main(["info"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fix in err[0], err


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr("portable_kv.cli.cmd_info", lambda _: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["info"])


def test_check_passes_every_layout_and_io_and_says_what_ran(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    roundtrips = [line for line in out.splitlines() if line.split()[2:3] in (["kernel"], ["direct"])]
    assert len(roundtrips) == 8 + 6 and all(" PASS " in line for line in roundtrips)  # MHA: 4 layouts; MLA: 3
    assert sum(line.startswith("MLA ") for line in roundtrips) == 6
    header = next(line for line in out.splitlines() if line.startswith("pool "))
    rows = [line for line in out.splitlines() if " PASS " in line or " FAIL " in line]
    assert all(line[header.index("result"):].startswith(("PASS", "FAIL")) for line in rows), out  # the L3 row included
    assert f"on backend {backends.current().name}" in out and " 0 failed" in out
    if backends.current().device.type == "cpu":
        assert "GPU kernels and DMA paths were not exercised" in out and "TRITON_INTERPRET=1 portable-kv check" in out


def test_build_writes_to_the_user_cache_by_default(monkeypatch, tmp_path, capsys):
    import portable_kv.backends.cuda as cuda

    seen = []
    monkeypatch.setenv("PORTABLE_KV_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda, "nvcc_build", lambda out, archs: seen.append((out, archs)) or [out / "kv_copy.cubin"])
    assert main(["build", "--vendor", "cuda", "--arch", "sm_90"]) == 0
    assert seen == [(tmp_path / "prebuilt", ("sm_90",))] and str(tmp_path / "prebuilt") in capsys.readouterr().out


def cpu_bench(*argv: str) -> int:
    before = backends.current().name
    try:
        return main(["bench", "--quick", "--page-size", "4", "--pages", "4", "--reps", "2", "--backends", "cpu", *argv])
    finally:
        backends.use(before)


def test_bench_cpu_run_is_labelled_for_what_it_is(tmp_path, capsys):
    """The CPU-backend run, on any machine (a GPU machine's full bench belongs to tools/gpu_round.sh)."""
    path = tmp_path / "bench.json"
    assert cpu_bench("--json", str(path), "--markdown", str(tmp_path / "bench.md")) == 0
    out = capsys.readouterr().out
    assert "say nothing about GPUs" in out and "host memcpy" in out
    table = out[out.index("section"):]
    for meaningless in ("pinned", "h2d", "d2h", "%ceil", "H2D"):
        assert meaningless not in table, meaningless
    assert "call: load is one per-layer load" in table  # the legend
    data = json.loads(path.read_text())
    assert set(data["meta"]["ceiling"]) == {"memcpy"} and data["meta"]["ceiling"]["memcpy"] > 0
    names = {row["name"] for row in data["rows"]}
    assert any("page_first_direct kernel" in n for n in names)
    assert all(row["gbps"] > 0 and row["pct_ceiling"] == 0 for row in data["rows"] if row["section"] == "package")
    summary = (tmp_path / "bench.md").read_text()
    assert main(["bench", "--from-json", str(path), "--markdown", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == summary  # the same summary from the saved rows
    assert "CPU backend" in summary and "| cpu kernel, page_first_direct | " in summary and "| cpu direct, page_first_direct | " in summary
    assert "%" not in summary and "H2D" not in summary and "ceiling (one host memcpy of the same bytes)" in summary
    # The MLA rows (DeepSeek-V3's latent), --quick: page_first_direct through each io path, a table of their own.
    mla = {(row["name"], row["direction"]) for row in data["rows"] if row["section"] == "mla"}
    assert mla == {(f"cpu page_first_direct {io}", d) for io in ("kernel", "direct") for d in ("h2d", "d2h")}
    mla_table = summary[summary.index("| MLA path, a 576-element latent row | page 4 |"):]
    assert "| cpu kernel, page_first_direct | " in mla_table and "| cpu direct, page_first_direct | " in mla_table


def test_bench_mla_rows_follow_their_flags(tmp_path, capsys):
    """--mla-dim 0 leaves the MLA rows out; the staged section measures every io path on an MLA pool too."""
    path = tmp_path / "bench.json"
    assert cpu_bench("--mla-dim", "0", "--json", str(path)) == 0
    assert not [row for row in json.loads(path.read_text())["rows"] if row["section"] == "mla"]
    assert cpu_bench("--section", "staged", "--mla-dim", "40") == 0
    out = capsys.readouterr().out
    for io in ("kernel", "direct", "staged", "auto"):
        assert f"cpu {io}, MLA, allocator host pages " in out and f"cpu {io}, MLA, random host pages " in out
    assert cpu_bench("--mla-dim", "-1") == 2 and "--mla-dim: expected an integer >= 0" in capsys.readouterr().err


def test_bench_host_cost_section(capsys):
    assert cpu_bench("--section", "host-cost") == 0
    out = capsys.readouterr().out
    assert "cpu per-layer load, kernel io" in out and "cpu per-layer load, direct io" in out and "yardstick" in out


def test_bench_both_ways_section_needs_a_gpu(capsys):
    assert cpu_bench("--section", "both-ways") == 2
    err = capsys.readouterr().err
    assert "--section both-ways" in err and "GPU" in err and "[bench]" not in err


def test_bench_refuses_plot_without_matplotlib_before_measuring(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cpu_bench("--plot", str(tmp_path / "bench.png")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot needs matplotlib" in err[0]  # one line, and no "[bench]" progress: nothing measured


def test_bench_store_without_a_storage_benchmark(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("portable_kv.storage") else real(name, *a))
    assert main(["bench", "--store", "local"]) == 2
    assert "--store local" in capsys.readouterr().err


def test_bench_store_runs_the_storage_benchmark(capsys):
    import importlib.util

    if importlib.util.find_spec("portable_kv.bench.store") is None:
        pytest.skip("this checkout has no storage benchmark")
    assert main(["bench", "--store", "local", "--page-size", "64", "--reps", "1"]) == 0
    assert "| local | page_first_direct | 64 |" in capsys.readouterr().out
    assert main(["bench", "--store", "local", "--json", "x.json"]) == 2  # refused before anything runs
    assert "--json belong to the GPU-link benchmark" in capsys.readouterr().err


def test_bench_rerenders_the_saved_h200_run(tmp_path, capsys):
    """bench_results/bench.md is what `--from-json` makes of bench_results/bench.json: the README quotes the one, generated from the other."""
    saved = ROOT / "bench_results" / "bench.json"
    if not saved.exists():
        pytest.skip("bench_results/bench.json is not in this checkout")
    assert main(["bench", "--from-json", str(saved), "--markdown", str(tmp_path / "bench.md")]) == 0
    summary = (tmp_path / "bench.md").read_text()
    assert summary == (ROOT / "bench_results" / "bench.md").read_text()
    assert summary.startswith("NVIDIA H200; ceiling (one bulk page-locked memcpy): ")
    assert "h2d is one per-layer load" in capsys.readouterr().out  # the GPU legend


def test_bench_help_quotes_no_durations():
    """How long a run takes depends on the machine; the help says what a run does."""
    bench = next(action for action in parser()._actions if hasattr(action, "add_parser")).choices["bench"]  # noqa: SLF001
    text = bench.format_help()
    for word in re.findall(r"\b\d+(?:\.\d+)?\s*(?:s|seconds?|min|minutes?|hours?)\b", text) + re.findall(r"\babout \d", text):
        raise AssertionError(f"bench --help quotes a duration: {word!r}")


def test_markdown_summary_of_gpu_sections():
    from portable_kv.bench.report import Row, markdown

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
        Row("interference", "cuda kernel load during matmul", "h2d", 64, 32.0, host_us=118.4, extra={"matmul_slowdown_pct": 4.25}),
    ]
    meta = {"gpu": "NVIDIA H200", "device": "cuda:0", "ceiling": {"h2d": 55.3, "d2h": 55.2, "both": 99.7}}
    text = markdown(rows, meta)
    assert "55.3 H2D, 55.2 D2H, 99.7 both ways at once GB/s" in text
    assert "| cuda kernel, page_first_direct | 50.4 (91%) / 51.8 (94%) | 50.2 (91%) | 10 |" in text
    assert "page_first kernel" not in text  # the README table is the page_first_direct one
    assert "| peer: per-page copy_ loop | 8.6 (16%) |  | 11500 |" in text
    assert "| 8 blocks | 16 blocks |" in text and "| cuda, page 64 | 41.2 / 52.3 | 50.4 |" in text
    assert "| cuda load kernel + backup kernel at once | 61.3 | 62% |" in text and "| +4.2% |  | 118 |" in text
    tables = text.split("\n\n")
    assert all(block.startswith("|") is False or next_block[0] != "|" for block, next_block in zip(tables, tables[1:] + ["x"]))


def test_every_test_file_is_collected_and_tracked():
    """tests/build/ once held the toolchain tests: pytest's default norecursedirs skips
    'build' and .gitignore dropped it, so CI compiled no kernel until this test existed."""
    root = ROOT
    skipped_by_pytest = {"build", "dist", "venv", "node_modules", "CVS", "_darcs"}
    files = sorted(p.relative_to(root) for p in (root / "tests").rglob("test_*.py"))
    assert any(p.parts[1] == "toolchains" for p in files)
    for path in files:
        assert not skipped_by_pytest & set(path.parts), f"{path} sits where pytest does not look"
    if (root / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", *map(str, files)], cwd=root, capture_output=True, text=True).stdout.split()
        assert not ignored, f"test files ignored by git: {ignored}"


def test_bench_rows_carry_the_sm_clock_where_it_can_be_read(monkeypatch):
    """A staged row's rate depends on the SM clock (its kernel is bound per SM): the bench
    reads it through torch while the timed calls run, and leaves it out where it cannot."""
    import torch

    from portable_kv.bench.measure import Clock
    from portable_kv.bench.sections import with_clock

    clock = Clock(torch.device("cpu"))
    clock.time(lambda: None, 3)
    assert clock.sm_mhz is None and with_clock(clock) == {}
    clock._clock_readable = True  # noqa: SLF001 -- as on a GPU host
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1980)
    assert clock._sm_clock() == 1980  # noqa: SLF001
    clock.sm_mhz = 1980
    assert with_clock(clock) == {"sm_mhz": 1980}

    def unreadable(device=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", unreadable)
    assert clock._sm_clock() is None and not clock._clock_readable  # noqa: SLF001 -- tried once, then left alone


def test_check_with_a_malformed_setting_is_one_line_not_a_fail_per_row():
    run = cli("check", PORTABLE_KV_HOST_RESERVE="-5")
    assert_one_line_failure(run, "PORTABLE_KV_HOST_RESERVE: expected an integer >= 0, got -5", "fix or unset the variable")
    assert "FAIL" not in run.stdout and run.stdout == ""


def test_info_marks_a_malformed_setting_and_says_where_each_comes_from():
    run = cli("info", "--set", "PORTABLE_KV_LOG_LEVEL=info", PORTABLE_KV_BLOCKS="abc", PORTABLE_KV_DMA_STREAMS="0")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith("PORTABLE_KV_")}
    assert "abc (env) INVALID: expected an integer, got 'abc'" in rows["PORTABLE_KV_BLOCKS"]
    assert "0 (env) INVALID: expected an integer >= 1, got 0" in rows["PORTABLE_KV_DMA_STREAMS"]
    assert "info (argument);" in rows["PORTABLE_KV_LOG_LEVEL"] and "INVALID" not in rows["PORTABLE_KV_LOG_LEVEL"]
    assert "4 (default)" not in rows["PORTABLE_KV_DMA_STREAMS"] and "8388608" not in rows["PORTABLE_KV_STAGING_BYTES"]
    assert "67108864 (default);" in rows["PORTABLE_KV_STAGING_BYTES"]
    assert "2 settings cannot be used: PORTABLE_KV_BLOCKS, PORTABLE_KV_DMA_STREAMS." in run.stdout


def test_info_refuses_a_set_of_an_unknown_variable_in_one_line():
    assert_one_line_failure(cli("info", "--set", "PORTABLE_KV_FAST=1"), "--set: expected NAME=VALUE with NAME one of PORTABLE_KV_BACKEND")


def test_info_shows_numa_placement_and_the_kernel_cache(tmp_path):
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / "kv_copy-sm_90.cubin").write_bytes(b"\0" * 1000)
    (tmp_path / "kv_copy-abc.cubin").write_bytes(b"\0" * 2000)
    run = cli("info", PORTABLE_KV_CACHE=str(tmp_path), PORTABLE_KV_BACKEND="cpu")

    def row(key: str) -> str:
        return next(line[len(key):].strip() for line in run.stdout.splitlines() if line.startswith(key + " "))

    assert row("numa placement") == "cpu backend: no device" and row("numa nodes")
    assert row("kernel cache") == f"{tmp_path}: 1 compiled kernels, 1 ahead-of-time code objects in prebuilt/, 0.0 MB"
    missing = cli("info", PORTABLE_KV_CACHE=str(tmp_path / "none"))
    assert f"{tmp_path / 'none'} (not created yet: kernels are compiled at first use)" in missing.stdout


def test_check_under_the_triton_interpreter_does_not_recommend_itself():
    from portable_kv.cli import not_exercised

    interpreted = not_exercised("triton", "cpu")
    assert "Triton kernel logic ran in its CPU interpreter" in interpreted and "TRITON_INTERPRET=1 portable-kv check" not in interpreted
    assert "TRITON_INTERPRET=1 portable-kv check" in not_exercised("cpu", "cpu")
    assert not_exercised("cuda", "cuda") is None
