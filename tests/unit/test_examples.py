"""The examples run as written: each that needs neither a GPU nor a model runs as a
program of its own and ends with its bit-exact line."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from portable_kv.storage.master import master_binary

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MOONCAKE_MISSING = importlib.util.find_spec("mooncake") is None or master_binary() is None


def run_example(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", [
    "quickstart.py",
    "l3_local_share.py",
    pytest.param("l3_mooncake_share.py", marks=pytest.mark.skipif(
        MOONCAKE_MISSING, reason="Mooncake is not installed (pip install 'portable-kv[mooncake]'; its binaries need libibverbs1)")),
])
def test_example_runs_and_is_bit_exact(name):
    result = run_example(name)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.endswith("bit-exact") or ", bit-exact;" in last, result.stdout


def test_quickstart_is_the_readme_example():
    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert (EXAMPLES / "quickstart.py").read_text().endswith(example)


def test_every_example_is_named_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".md") and p.name not in readme) == []


def test_the_sglang_example_is_documentation_whose_launcher_compiles():
    text = (EXAMPLES / "sglang_server.md").read_text()
    assert text.splitlines()[2].startswith("Documentation, not a program")
    launchers = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "portable_kv.engines.sglang.install()" in block]
    assert launchers, "sglang_server.md shows no launcher that calls install()"
    for block in launchers:
        compile(block, "sglang_server.md", "exec")  # SGLang itself is not needed to check the syntax


def test_the_mooncake_example_without_mooncake_names_the_extra_in_one_line():
    """Mooncake hidden from the example's process (installed here or not): one line naming the extra, exit 2, no traceback."""
    hide = ("import runpy, sys; sys.modules['mooncake'] = None; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide, str(EXAMPLES / "l3_mooncake_share.py")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pip install 'portable-kv[mooncake]'" in lines[0] and 'pip install -e ".[mooncake]"' in lines[0]


def test_the_readme_line_that_runs_the_mooncake_example_names_its_extra():
    readme = (ROOT / "README.md").read_text()
    sentence = readme[readme.index("`l3_mooncake_share.py`"):].split(";")[0]
    assert 'pip install -e ".[mooncake]"' in sentence, sentence
