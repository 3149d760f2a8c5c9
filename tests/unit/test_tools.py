"""tools/: its README names exactly the scripts there, each Python tool starts (`--help`),
and no tool reaches into the package's private names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
SCRIPTS = sorted(p.name for p in TOOLS.iterdir() if p.suffix in (".py", ".sh"))
# import_graph.py takes no flags (it prints the graph, `tox -e lint` runs it); the rest parse theirs.
WITH_HELP = [name for name in SCRIPTS if name.endswith(".py") and name != "import_graph.py"]
# Private names a tool reads on purpose, each with its reason in a comment beside it: torch's,
# never the package's.
ALLOWED_PRIVATE = {("host_memory_probe.py", "_base"), ("host_memory_probe.py", "_use_count")}


def test_readme_lists_exactly_the_scripts():
    listed = re.findall(r"^\*\*`([^`]+)`\*\*", (TOOLS / "README.md").read_text(), re.M)
    assert sorted(listed) == SCRIPTS, f"tools/README.md lists {sorted(listed)}, tools/ holds {SCRIPTS}"
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("name", WITH_HELP)
def test_tool_help_runs(name):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(TOOLS / name), "--help"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.parametrize("name", [name for name in SCRIPTS if name.endswith(".py")])
def test_tool_uses_public_names(name):
    tree = ast.parse((TOOLS / name).read_text())
    private = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("portable_kv"):
            private |= {alias.name for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")}
            private |= {part for part in node.module.split(".") if part.startswith("_")}
            continue
        else:
            continue
        if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")) and (name, attr) not in ALLOWED_PRIVATE:
            private.add(attr)
    assert not private, f"tools/{name} reaches into private names {sorted(private)}: use the public API (docs/API.md)"


def _bench_ab():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_ab", TOOLS / "bench_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(path: Path, ceiling: float, rate: float) -> None:
    import json
    rows = [{"section": "ceiling", "name": "bulk", "direction": "h2d", "page_size": 0, "gbps": ceiling},
            {"section": "staged", "name": "cuda kernel", "direction": "h2d", "page_size": 64, "gbps": rate}]
    path.write_text(json.dumps({"meta": {"ceiling": {"h2d": ceiling}}, "rows": rows}))


def test_bench_ab_tells_a_drift_of_the_link_from_a_slower_row(tmp_path):
    compare = _bench_ab().compare
    drift, slower = tmp_path / "drift", tmp_path / "slower"
    for folder in (drift, slower):
        folder.mkdir()
    # The link drifted down 10% for the new tree's runs; the row followed it.
    for name, ceiling, rate in (("old_1", 55.0, 50.0), ("old_2", 55.0, 50.1), ("new_1", 49.5, 45.0), ("new_2", 49.5, 45.1)):
        _run(drift / f"{name}.json", ceiling, rate)
    # The same ceiling for all four runs; the row 10% slower with the new tree.
    for name, rate in (("old_1", 50.0), ("old_2", 50.1), ("new_1", 45.0), ("new_2", 45.1)):
        _run(slower / f"{name}.json", 55.0, rate)
    drifted = {line.split("|")[2].strip(): line.rstrip(" |").rsplit("|", 1)[-1].strip() for line in compare(drift) if line.startswith("| ")}
    assert drifted["bulk"] == "GB/s"  # the ceiling row is compared in GB/s only
    assert drifted["cuda kernel"] == "GB/s"  # slower in GB/s, not as a share of its run's ceiling
    assert compare(slower)[-1].endswith("in GB/s and as a share of the run's ceiling: 1; in GB/s only: 0; as a share only: 0")


def test_bench_ab_run_order_puts_each_tree_first_and_last_in_turn():
    run_order = _bench_ab().run_order
    assert [t for t, _ in run_order(2)] == ["old", "new", "new", "old"]
    assert run_order(2, new_first=True) == [("new", "new_1"), ("old", "old_1"), ("old", "old_2"), ("new", "new_2")]
    assert [label for _, label in run_order(3)] == ["old_1", "new_1", "new_2", "old_2", "old_3", "new_3"]
