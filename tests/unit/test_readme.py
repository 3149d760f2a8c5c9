"""The documentation holds: the README's first example runs, every setting is
documented, every repository file the docs name exists, and every benchmark
number the docs quote is generated from the results file it comes from.

`python tests/unit/test_readme.py` prints the generated tables, to paste into
the README and docs/PERFORMANCE.md after a new run lands in bench_results/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from portable_kv import config

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench_results"
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
        name = name.rstrip(".,:;").split("::")[0]  # a pytest node id names its file
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
    text = ("see `docs/API.md`, [design](docs/DESIGN.md#why), `tools/gpu_round.sh`, `sglang/srt/mem_cache/pool_host/mha.py`, `torch.bfloat16`, "
            "`tests/unit/test_cli.py::test_info`")
    assert named_paths(text) == {"docs/API.md", "docs/DESIGN.md", "tools/gpu_round.sh", "tests/unit/test_cli.py"}


# The set-up block the README opens with: the main job, then the tests.
SETUP = """```bash
python3 -m pip install torch==2.13.0 -e ".[triton]" && portable-kv check   # the main job, on whatever hardware is here
python3 -m pip install tox && tox -e cpu                                    # the tests (CI runs this, then lint, sglang, vllm)
```"""


def test_readme_opens_with_the_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert "\n".join(lines[2:6]) == SETUP


def section(text: str, heading: str) -> str:
    """The body of a Markdown section, up to the next heading of any level."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"^#", text[start:], re.M)
    return text[start:start + following.start()] if following else text[start:]


def test_readme_headline_is_the_current_run_summary():
    """Every line of the README's headline table, and its ceiling, is a line of bench_results/bench.md."""
    summary = (RESULTS / "bench.md").read_text().splitlines()
    headline = section((ROOT / "README.md").read_text(), "## This release on the H200")
    table = [line for line in headline.splitlines() if line.startswith("|")]
    assert len(table) >= 4, headline
    assert [line for line in table if line not in summary] == []
    assert summary[0] in headline  # the machine and the ceiling of the same run


def test_readme_tree_names_every_module():
    tree = section((ROOT / "README.md").read_text(), "## How it is built")
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "portable_kv").rglob("*.py")
                     if p.stem not in ("__init__", "__main__") and not re.search(rf"\b{p.stem}\b", tree))
    assert modules == [], f"README.md's tree does not name {modules}"


def test_every_file_the_readme_tree_names_exists():
    """A name in the tree is a path under portable_kv/ or, bare, a file anywhere in it."""
    tree = section((ROOT / "README.md").read_text(), "## How it is built")
    package = ROOT / "portable_kv"
    files = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    names = set(re.findall(r"[\w/]+\.(?:py|h|cu|hip)\b", tree))
    missing = sorted(n for n in names if n not in files and not any(f.split("/")[-1] == n.split("/")[-1] for f in files))
    assert missing == [], f"README.md's tree names files that do not exist: {missing}"


def staged_tables(data: dict) -> str:
    """docs/PERFORMANCE.md's tables of the staged section, from its JSON."""
    rows = {(r["name"], r["direction"], r["page_size"]): r for r in data["rows"]}
    ceil = data["meta"]["ceiling"]
    pages = (64, 16, 1)
    hosts = (("page_first_direct", ""), ("layer_first", ", layer_first host"))

    def rate(row: dict) -> str:
        return f"{row['gbps']:.1f} ({row['pct_ceiling']:.1f}%)"

    lines = [f"{data['meta']['gpu']}; ceiling (one bulk page-locked memcpy): {ceil['h2d']:.1f} H2D, {ceil['d2h']:.1f} D2H, "
             f"{ceil['both']:.1f} both ways at once GB/s.", "",
             "| cuda io, host layout | page 64 | page 16 | page 1 | SMs |", "|---|---|---|---|---|"]
    for host, suffix in hosts:
        for io in ("kernel", "direct", "staged", "auto"):
            name = f"cuda {io}, allocator host pages{suffix}"
            cells = [f"{rows[name, 'h2d', page]['gbps']:.1f} / {rate(rows[f'{name}, 8 layers back to back', 'h2d', page])} / "
                     f"{rate(rows[name, 'd2h', page])}" for page in pages]
            sms = f"{rows[name, 'h2d', 64]['extra']['sms']} / {rows[name, 'd2h', 64]['extra']['sms']}"
            lines.append(f"| {io}, `{host}` | " + " | ".join(cells) + f" | {sms} |")
    lines += ["", "| a load and a backup at once, GB/s (`page_first_direct` / `layer_first` host) | page 64 | page 16 | page 1 |",
              "|---|---|---|---|"]
    for label, what in (("load kernel + backup kernel", "load kernel + backup kernel at once"),
                        ("load staged + backup staged", "load staged + backup staged at once"),
                        ("load kernel + backup staged", "load kernel + backup staged at once"),
                        ("load staged + backup kernel", "load staged + backup kernel at once"),
                        ("load auto + backup auto", "load auto + backup auto at once"),
                        ("the same, the backup issued first", "load auto + backup auto at once, the backup issued first"),
                        ("load kernel + backup kernel, from two threads", "load kernel + backup kernel at once from two threads")):
        cells = [" / ".join(f"{rows[f'cuda {what}, allocator host pages{suffix}', 'both', page]['gbps']:.1f}" for _, suffix in hosts)
                 for page in pages]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| loads beside a bf16 matmul loop: load GB/s, matmul slowdown (`page_first_direct` / `layer_first` host) "
                  "| page 64 | page 16 | page 1 |", "|---|---|---|---|"]
    for io in ("kernel", "staged"):
        cells = []
        for page in pages:
            got = [rows[f"cuda {io} load during matmul, interleaved, allocator host pages{suffix}", "h2d", page] for _, suffix in hosts]
            cells.append(" / ".join(f"{r['gbps']:.1f}, {r['extra']['matmul_slowdown_pct']:+.1f}%" for r in got))
        lines.append(f"| {io} loads | " + " | ".join(cells) + " |")
    return "\n".join(lines)


HOST_COST_APIS = ("per-layer load", "SGLang hook, load_to_device_per_layer_physical", "prepared plan.load",
                  "per-layer load, 8 index sets in turn", "prepared plan.load, 8 plans in turn")


def host_cost_table(data: dict) -> str:
    """docs/PERFORMANCE.md's host-cost tables, one per call size: per io path and way of calling,
    the median host us of its draws and their spread; SGLang's JIT kernel as the peer."""
    rows = {(r["extra"]["io"], r["extra"]["api"], r["extra"]["pages"]): r for r in data["rows"]
            if r["section"] == "host_cost" and "api" in r["extra"] and "absent" not in r["extra"]}

    def cell(r: dict) -> str:
        return f"{r['host_us']:.1f} ({r['extra']['host_us_min']:.1f}-{r['extra']['host_us_max']:.1f})"

    tables = []
    for pages in sorted({p for _, _, p in rows}):
        lines = [f"| {pages} pages, host us a call | " + " | ".join(HOST_COST_APIS) + " |", "|---" * (len(HOST_COST_APIS) + 1) + "|"]
        for io in dict.fromkeys(io for io, _, p in rows if p == pages and io != "peer"):
            lines.append(f"| {io} io | " + " | ".join(cell(rows[io, api, pages]) for api in HOST_COST_APIS) + " |")
        peers = {api: r for (io, api, p), r in rows.items() if io == "peer" and p == pages}
        one = next((r for api, r in peers.items() if "in turn" not in api), None)
        turn = next((r for api, r in peers.items() if "in turn" in api), None)
        if one and turn:
            lines.append(f"| peer: SGLang's JIT kernel | {cell(one)} |  |  | {cell(turn)} |  |")
        tables.append("\n".join(lines))
    yardstick = next(r for r in data["rows"] if r["name"] == "yardstick: torch x.add_(1), 1 element")
    return "\n\n".join(tables) + f"\n\nYardstick, torch's one-element `add_`: {yardstick['host_us']:.1f} us."


def options_tables(page64: dict, staged: dict, engine_md: str) -> str:
    """docs/OPTIONS.md's tables: each choice's numbers, from the staged section at page 64 (MHA and MLA rows,
    loads beside the matmul), the staged section over page sizes, and the engine section."""
    rows = {(r["name"], r["direction"], r["page_size"]): r for r in page64["rows"]}
    ios = ("kernel", "direct", "staged", "auto")

    def rate(row: dict) -> str:
        return f"{row['gbps']:.1f} ({row['pct_ceiling']:.0f}%)"

    ceil = page64["meta"]["ceiling"]
    lines = [f"{page64['meta']['gpu']}, page 64 (`bench_results/staged_page64.json`; ceiling {ceil['h2d']:.1f} H2D, {ceil['d2h']:.1f} D2H GB/s):", "",
             "| what moves, where the pages lie | kernel | direct | staged | auto |", "|---|---|---|---|---|"]
    for label, name, direction in (
            ("MHA, 8 per-layer loads back to back, `page_first_direct` host", "cuda {io}, allocator host pages, 8 layers back to back", "h2d"),
            ("MHA, 8 per-layer loads back to back, `layer_first` host", "cuda {io}, allocator host pages, layer_first host, 8 layers back to back", "h2d"),
            ("MHA, one all-layer backup, `page_first_direct` host", "cuda {io}, allocator host pages", "d2h"),
            ("MLA, 8 per-layer loads back to back, `page_first_direct` host", "cuda {io}, MLA, allocator host pages, 8 layers back to back", "h2d"),
            ("MLA, one all-layer backup, `page_first_direct` host", "cuda {io}, MLA, allocator host pages", "d2h")):
        lines.append(f"| {label} | " + " | ".join(rate(rows[name.format(io=io), direction, 64]) for io in ios) + " |")
    for label, suffix in (("MHA loads beside a bf16 matmul, `layer_first` host, device pages as SGLang's allocator leaves them",
                           ", engine device pages, layer_first host"),
                          ("MHA loads beside a bf16 matmul, `page_first_direct` host, device pages at random", "")):
        got = [rows[f"cuda {io} load during matmul, interleaved, allocator host pages{suffix}", "h2d", 64] for io in ios]
        lines.append(f"| {label}: GB/s, the matmul's slowdown | " +
                     " | ".join(f"{r['gbps']:.1f}, {r['extra']['matmul_slowdown_pct']:+.1f}%" for r in got) + " |")
    by_page = {(r["name"], r["direction"], r["page_size"]): r for r in staged["rows"]}
    lines += ["", "By page size (`bench_results/staged.json`), MHA, 8 per-layer loads back to back, `page_first_direct` host, device pages at random, GB/s:", "",
              "| io | page 64 | page 16 | page 1 |", "|---|---|---|---|"]
    for io in ios:
        lines.append(f"| {io} | " + " | ".join(
            rate(by_page[f"cuda {io}, allocator host pages, 8 layers back to back", "h2d", page]) for page in (64, 16, 1)) + " |")
    lines += ["", "A cache-hit prefill of MiMo-V2-Flash as SGLang runs it (`bench_results/engine.md`), ms: prefill (its ratio to the bound):",
              "", "| io | prefix 4096 | prefix 65536 |", "|---|---|---|"]
    prefill = {}
    for line in engine_md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| cuda "):
            prefill.setdefault(cells[0].split()[1], {})[cells[1]] = f"{cells[4]} ({cells[11]}x)"
    for io in ios:
        lines.append(f"| {io} | {prefill[io]['4096']} | {prefill[io]['65536']} |")
    return "\n".join(lines)


def vllm_table(data: dict) -> str:
    """The vLLM section's % of the ceiling, store / load, per path and blocks of a transfer."""
    paths = ("kernel", "bulk", "direct", "staged", "auto", "peer")
    cells: dict[str, dict[str, dict[str, float]]] = {}
    for row in data["rows"]:
        name = row["name"]
        if row["section"] != "vllm" or row["direction"] not in ("h2d", "d2h") or "at once" in name:
            continue
        case, path = name.split(" portable_kv ") if " portable_kv " in name else (name.split(" peer: ")[0], "peer")
        cells.setdefault(case, {}).setdefault(path, {})[row["direction"]] = row["pct_ceiling"]
    lines = ["| blocks, chunk | kernel | bulk | direct | staged | auto | peer: batched memcpy |", "|---|---|---|---|---|---|---|"]
    for case, by_path in cells.items():
        lines.append(f"| {case} | " + " | ".join(f"{by_path[p]['d2h']:.0f} / {by_path[p]['h2d']:.0f}" for p in paths) + " |")
    return "\n".join(lines)


def state_table(data: dict) -> str:
    """The state section's GB/s and % of the ceiling per io path, load and backup."""
    rows = {(r["extra"]["io"], r["direction"]): r for r in data["rows"] if r["section"] == "state" and r["direction"] in ("h2d", "d2h")}
    lines = ["| io | load GB/s (% ceiling) | backup GB/s (% ceiling) |", "|---|---|---|"]
    for io in dict.fromkeys(io for io, _ in rows):
        load, backup = rows[io, "h2d"], rows[io, "d2h"]
        lines.append(f"| {io} | {load['gbps']:.1f} ({load['pct_ceiling']:.1f}%) | {backup['gbps']:.1f} ({backup['pct_ceiling']:.1f}%) |")
    return "\n".join(lines)


def host_time_quotes(data: dict) -> str:
    """The kernel path's host time of a 4-page per-layer load back to back, as every doc quotes it."""
    row = next((r for r in data["rows"] if r["section"] == "host_cost" and r["extra"].get("io") == "kernel"
                and r["extra"].get("api") == "per-layer load" and r["extra"].get("pages") == 4), None)
    assert row, "host_cost.json has no 4-page kernel-io row"
    return f"{row['host_us']:.1f} us a call back to back (kernel io"


def generated_tables() -> dict[str, str]:
    return {"staged": staged_tables(json.loads((RESULTS / "staged.json").read_text())),
            "host cost": host_cost_table(json.loads((RESULTS / "host_cost.json").read_text())),
            "vllm": vllm_table(json.loads((RESULTS / "engines.json").read_text())["vllm"]),
            "state": state_table(json.loads((RESULTS / "engines.json").read_text())["state"]),
            "options": options_tables(json.loads((RESULTS / "staged_page64.json").read_text()), json.loads((RESULTS / "staged.json").read_text()),
                                      (RESULTS / "engine.md").read_text())}


@pytest.mark.parametrize("name, doc", [("staged", "PERFORMANCE.md"), ("host cost", "PERFORMANCE.md"), ("vllm", "PERFORMANCE.md"),
                                       ("state", "PERFORMANCE.md"), ("options", "OPTIONS.md")])
def test_performance_tables_are_generated_from_the_results(name, doc):
    table = generated_tables()[name]
    assert table in (ROOT / "docs" / doc).read_text(), (
        f"docs/{doc}'s {name} table differs from bench_results; paste `python tests/unit/test_readme.py`'s output")


def test_the_kernel_paths_host_time_is_quoted_one_way():
    """README, DESIGN and OPTIONS quote the kernel path's host time back to back from host_cost.json, and no other figure that way."""
    quote = host_time_quotes(json.loads((RESULTS / "host_cost.json").read_text()))
    for doc in (ROOT / "README.md", ROOT / "docs" / "DESIGN.md", ROOT / "docs" / "OPTIONS.md"):
        text = doc.read_text()
        assert quote in text, f"{doc.name} does not quote {quote!r}"
        others = set(re.findall(r"([\d.]+(?:-[\d.]+)?) us a call back to back \(kernel io", text)) - {quote.split()[0]}
        assert not others, f"{doc.name} quotes the kernel path's host time as {others} too"


def test_the_readme_one_call_host_time_is_the_bench_runs():
    """The README's "host us per load" is the one-call figure of bench.md's cuda kernel row; the legend says it is one call."""
    row = next(line for line in (RESULTS / "bench.md").read_text().splitlines() if line.startswith("| cuda kernel, page_first_direct |"))
    one_call = row.strip("|").split("|")[-1].strip()
    readme = (ROOT / "README.md").read_text()
    assert f"| {one_call} |" in readme and "enqueue one load timed on its own" in readme


def test_changelog_has_a_section_for_this_version():
    from portable_kv import __version__

    releases = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] in ("Unreleased", __version__) and __version__ in releases[:2], releases
    released = (ROOT / "CHANGELOG.md").read_text().split(f"\n## {__version__}\n")[1].split("\n## ")[0]
    assert "MLA" in released, "the release that ships MLA pools says so"


def test_every_bench_result_is_indexed():
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    index = (RESULTS / "README.md").read_text()
    indexed = set(re.findall(r"^\| `([^`]+)` \|", index, re.M))
    assert indexed == set(files), f"bench_results/README.md indexes {sorted(indexed)}, the folder holds {files}"


if __name__ == "__main__":
    for name, table in generated_tables().items():
        print(f"<!-- {name} -->\n{table}\n")
