"""The documentation holds: the README's first example runs, every setting is
documented, and every repository file the docs name exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from portable_kv import config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench_results" / "README.md"]

# Paths the docs name on purpose that are not files of this repository: SGLang's
# and Mooncake's sources, paths on the machine a command runs on, and files a
# command writes (out/, the carried wheels in .whl/).
OUTSIDE = re.compile(
    r"^(sglang/|python/sglang/|mem_cache/|hybrid_cache/|srt/|mooncake|~|/|\$|<)"
    r"|^(cache_controller|mooncake_store|base|mha|memory_pool_host)\.py$"
    r"|^(mi300|bench|out)\.(json|md|png)$|^PATH$|^out/$|^\.whl/$"
)
FILE_SUFFIXES = (".md", ".py", ".sh", ".json", ".txt", ".ini", ".toml")


def readme_example() -> str:
    match = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_readme_first_example_runs_and_is_bit_exact():
    result = subprocess.run([sys.executable, "-c", readme_example()], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bit-exact" in result.stdout, result.stdout


def test_every_setting_is_in_the_api_doc():
    api = (ROOT / "docs" / "API.md").read_text()
    missing = [s.name for s in config.SETTINGS if f"`{s.name}`" not in api]
    assert not missing, f"docs/API.md lacks {missing}; regenerate its settings table from portable_kv.config.table()"


def named_paths(text: str) -> set[str]:
    """Relative paths a Markdown text names in backticks or as link targets."""
    names = set(re.findall(r"`([^`\s]+)`", text)) | set(re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text))
    paths = set()
    for name in names:
        name = name.rstrip(".,:;")
        if "://" in name or "=" in name or "*" in name or "{" in name or OUTSIDE.search(name):
            continue
        if "/" in name or name.endswith(FILE_SUFFIXES):
            paths.add(name)
    return paths


def exists(path: str, doc: Path) -> bool:
    """A path with a folder is relative to the root or to the doc; a bare file name
    (`layout.py`) may live anywhere in the tree."""
    if "/" in path:
        return (ROOT / path).exists() or (doc.parent / path).exists()
    return any(not {".git", ".tox", ".whl"} & set(p.relative_to(ROOT).parts) for p in ROOT.rglob(path))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_exists(doc):
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    text = doc.read_text()
    missing = sorted(path for path in named_paths(text) if not exists(path, doc))
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_path_finder_sees_paths_and_skips_the_outside():
    text = "see `docs/API.md`, [design](docs/DESIGN.md#why), `tools/gpu_round.sh`, `sglang/srt/mem_cache/pool_host/mha.py`, `torch.bfloat16`"
    assert named_paths(text) == {"docs/API.md", "docs/DESIGN.md", "tools/gpu_round.sh"}
