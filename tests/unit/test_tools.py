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
