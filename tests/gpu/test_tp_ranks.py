"""tools/tp_ranks.py: tensor-parallel ranks, each with its own host pool, on one host.

The argument checks and the too-few-GPUs exit run everywhere; the two-rank run
needs two visible GPUs (bandwidth is reported, not asserted: it depends on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "tp_ranks.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("tp_ranks", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout)


def test_arguments_have_defaults_and_are_checked():
    tool = load_tool()
    args = tool.parse_args(["--ranks", "2", "--numa", "off", "--l3", "mooncake", "--json", "out.json"])
    assert (args.ranks, args.numa, args.l3, args.json, args.io, args.seconds) == (2, "off", "mooncake", "out.json", "kernel", 3.0)
    assert tool.parse_args([]).ranks is None
    for bad, name in (
        (["--ranks", "0"], "--ranks"),
        (["--seconds", "0"], "--seconds"),
        (["--batch-pages", "0"], "--batch-pages"),
        (["--device-tokens", "64"], "--device-tokens"),
        (["--ranks", "1", "--l3", "mooncake"], "--l3"),
        (["--numa", "remote"], "--numa"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            tool.parse_args(bad)
        assert exit_info.value.code == 2, name


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer than 64 visible GPUs")
def test_too_few_gpus_is_one_line_and_exit_2():
    done = run_tool("--ranks", "64", timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"tp_ranks: --ranks 64 needs 64 GPUs, {torch.cuda.device_count()} visible"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 visible GPUs, {torch.cuda.device_count()} visible")
def test_two_ranks_round_trip_bit_exact_and_report(tmp_path):
    report_path = tmp_path / "tp2.json"
    done = run_tool("--ranks", "2", "--seconds", "0.5", "--device-tokens", "32768", "--batch-pages", "64", "--json", str(report_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert "error" not in rank, rank.get("error")
        assert rank["round_trip_exact"] is True
        for key in ("ceiling_h2d", "ceiling_d2h", "load_alone", "load_together", "backup_alone", "backup_together"):
            assert rank[key] > 0, key
        assert sum(rank["host_page_nodes"].values()) > 0
    assert "bit-exact" in done.stdout and "| 1 |" in done.stdout
