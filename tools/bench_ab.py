"""The benchmark on two trees of the package in one run, one after the other (old, new,
new, old, so that a drift of the host or the link shows as spread, not as a difference;
--new-first: new, old, old, new, for an effect of the place in the call, such as a GPU that
warms up, which the first order lays on the new tree alone), then every row of the two
side by side.

A row is compared twice: in GB/s, and as a share of the ceiling its own run measured
(the bulk memcpy of the same direction), which takes out a drift of the link between
runs. It is slower when the new tree's mean is below the old one's by more than
max(2%, the run-to-run spread of that row on either tree), the spread being how far a
tree's runs differ; the last column says in which of the two measures. Rows are matched
by section, name, direction and page size; the ceiling rows are compared in GB/s only.

Run: python3 tools/bench_ab.py --old /path/to/old/tree --out DIR [--rounds 2] [--new-first] -- --section staged --quick
     python3 tools/bench_ab.py --compare DIR      (the table again from DIR's JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import mean

NEW = Path(__file__).resolve().parent.parent


def run(tree: Path, label: str, out: Path, bench_args: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")])))
    target = out / f"{label}.json"
    print(f"[ab] {label}: {tree}", flush=True)
    with open(out / f"{label}.txt", "w") as log:
        code = subprocess.call([sys.executable, "-m", "portable_kv", "bench", *bench_args, "--json", str(target)],
                               env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    if code:
        print(f"[ab] {label}: exit status {code} (see {out / (label + '.txt')})", flush=True)


def rows(path: Path) -> dict[tuple, tuple[float, float | None]]:
    """A run's rows: (GB/s, share of that run's ceiling of the row's direction or None)."""
    data = json.loads(path.read_text())
    ceiling = data.get("meta", {}).get("ceiling", {})
    found = {}
    for row in data["rows"]:
        if row.get("gbps"):
            base = ceiling.get(row["direction"]) if row["section"] != "ceiling" else None
            found[(row["section"], row["name"], row["direction"], row["page_size"])] = (row["gbps"], row["gbps"] / base if base else None)
    return found


def slower(old: list[float], new: list[float]) -> tuple[float, float, bool]:
    """new/old of the means, the larger tree's spread, and whether new is slower by more than max(2%, spread)."""
    spread = max((max(v) - min(v)) / mean(v) for v in (old, new))
    ratio = mean(new) / mean(old)
    return ratio, spread, ratio < 1 - max(0.02, spread)


def compare(out: Path) -> list[str]:
    runs = {tree: [rows(p) for p in sorted(out.glob(f"{tree}_*.json"))] for tree in ("old", "new")}
    if not runs["old"] or not runs["new"]:
        raise SystemExit(f"{out}: expected old_*.json and new_*.json")
    keys = [k for k in runs["old"][0] if all(k in r for tree in runs.values() for r in tree)]
    lines = ["| section | row | dir | page | old GB/s | new GB/s | new/old | spread | new/old of % ceiling | spread | slower |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    counts = {"GB/s": 0, "% ceiling": 0, "both": 0}
    for key in keys:
        old, new = ([r[key][0] for r in runs[tree]] for tree in ("old", "new"))
        ratio, spread, by_rate = slower(old, new)
        shares = [[r[key][1] for r in runs[tree]] for tree in ("old", "new")]
        share_cells, by_share = "| - | - |", False
        if all(v is not None for v in (*shares[0], *shares[1])):
            share_ratio, share_spread, by_share = slower(*shares)
            share_cells = f"| {share_ratio:.3f} | {share_spread:.1%} |"
        flag = "both" if by_rate and by_share else "GB/s" if by_rate else "% ceiling" if by_share else ""
        if flag:
            counts[flag] += 1
        section, name, direction, page = key
        lines.append(f"| {section} | {name} | {direction} | {page} | {mean(old):.2f} | {mean(new):.2f} | {ratio:.3f} | {spread:.1%} "
                     f"{share_cells} {flag} |")
    lines.append(f"\n{len(keys)} rows; slower than max(2%, spread) in GB/s and as a share of the run's ceiling: {counts['both']}; "
                 f"in GB/s only: {counts['GB/s']}; as a share only: {counts['% ceiling']}")
    return lines


def run_order(rounds: int, new_first: bool = False) -> list[tuple[str, str]]:
    """(tree, label) of each run: the trees alternate, each round in the other order."""
    first, second = ("new", "old") if new_first else ("old", "new")
    pairs = [(first, second) if i % 2 == 0 else (second, first) for i in range(rounds)]
    return [(tree, f"{tree}_{i}") for i, pair in enumerate(pairs, 1) for tree in pair]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="the old tree (a checkout or `git archive` of it)")
    parser.add_argument("--out", type=Path, default=Path("out/ab"))
    parser.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating")
    parser.add_argument("--new-first", action="store_true", help="new, old, old, new rather than old, new, new, old")
    parser.add_argument("--compare", type=Path, help="only print the table of an earlier run's folder")
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    if args.compare:
        print("\n".join(compare(args.compare)))
        return
    if args.old is None:
        parser.error("--old: expected the old tree's path")
    args.out.mkdir(parents=True, exist_ok=True)
    for tree, label in run_order(args.rounds, args.new_first):
        run(args.old.resolve() if tree == "old" else NEW, label, args.out, bench_args)
    table = compare(args.out)
    (args.out / "ab.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
