"""portable-kv bench: how fast this package moves KV pages, against the link's ceiling.

Everything in one run on one machine: the ceiling (bulk page-locked memcpy),
the peers (what engines do today), and every backend x layout x io backend,
for a per-layer load and an all-layer backup of the same random pages.

This module holds the flags and the dispatch only, and imports no torch, so
`portable-kv --help` stays fast.  registry.py is the list of sections (a new section
is one line there); run.py measures the ceiling and hands the section a Context
(context.py).  workload.py (what moves), measure.py (timing), draws.py and beside.py
(rows beside compute, drawn in turn), progress.py, peers.py (the engines' paths) and
sglang_jit.py (SGLang's own kernels), sections.py (the default section's
measurements), host_cost.py, staged*.py and engine*.py (their sections), rows.py and
report.py (table, markdown, plot, JSON); store.py measures an L3 store instead of
the link.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from .draws import DRAWS
from .registry import SECTIONS

DTYPE_NAMES = ("bf16", "fp16", "fp8")
STORES = ("local", "mooncake")


def add_arguments(p: argparse.ArgumentParser) -> None:
    geometry = p.add_argument_group("what moves (the default is MiMo-V2's K 192 / V 128 on one GPU)")
    geometry.add_argument("--heads", type=int, default=4, help="KV heads per GPU, K and V (default: %(default)s)")
    geometry.add_argument("--k-dim", type=int, default=192, help="K head_dim (default: %(default)s)")
    geometry.add_argument("--v-dim", type=int, default=128, help="V head_dim (default: %(default)s)")
    geometry.add_argument("--layers", type=int, default=48, help="layers of the pools; --quick uses 8 (default: %(default)s)")
    geometry.add_argument("--page-size", type=str, default="64,16,1", help="comma-separated page sizes in tokens (default: %(default)s)")
    geometry.add_argument("--pages", type=int, default=0,
                          help="pages per call (default: enough for 100 MB per per-layer load on a GPU, 4 MB on the CPU backend)")
    geometry.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="element type of K and V, and of the MLA latent (default: %(default)s)")
    geometry.add_argument("--mla-dim", type=int, default=576,
                          help="MLA rows beside the MHA ones, against the same ceiling: latent elements per token of an MLA pool "
                               "(DeepSeek-V3/R1, Kimi-K2: 512 + 64); 0 leaves them out; --quick measures page_first_direct only (default: %(default)s)")
    geometry.add_argument("--mla-layers", type=int, default=61, help="layers of the MLA pools; --quick uses 8 (default: %(default)s)")
    how = p.add_argument_group("how")
    how.add_argument("--section", choices=tuple(SECTIONS), default="all",
                     help="what to measure: " + "; ".join(f"{k}: {v.about}" for k, v in SECTIONS.items()) + " (default: %(default)s)")
    how.add_argument("--backends", type=str, default="",
                     help="comma-separated backends to measure, e.g. cuda,triton (default: every GPU backend that can run here, else cpu)")
    how.add_argument("--reps", type=int, default=0, help="timed calls per measurement, median kept (default: 20; 5 with --quick)")
    how.add_argument("--draws", type=int, default=DRAWS,
                     help="draws of each row that runs beside compute, the paths of its table in turn; a row reports the "
                          "median and the spread (default: %(default)s)")
    how.add_argument("--quick", action="store_true",
                     help="a shorter run: 8 layers, 5 repetitions and a 512 MiB ceiling copy on a GPU; the default section "
                          "also leaves out the peers at page 1")
    how.add_argument("--store", choices=STORES, default="",
                     help="benchmark an L3 store instead of the GPU link: put and get of whole pages against the store's own bulk "
                          "transfer (mooncake starts a loopback master); takes --page-size and --reps")
    out = p.add_argument_group("output")
    out.add_argument("--json", type=str, default="", metavar="PATH", help="write every number and the run's settings here")
    out.add_argument("--markdown", type=str, default="", metavar="PATH", help="write the summary tables (as in the README) here")
    out.add_argument("--plot", type=str, default="", metavar="PATH", help="write a PNG of the bandwidths here (needs matplotlib: the bench extra)")
    out.add_argument("--from-json", type=str, default="", metavar="PATH",
                     help="measure nothing: print the table of a saved --json run and write its --markdown / --plot")


def main(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ImportError("--plot needs matplotlib: pip install 'portable-kv[bench]' (or leave --plot out)")
    if not args.store:  # --store refuses these flags itself
        check_outputs(args)
    if args.from_json:
        from . import report

        rows, meta = report.load_json(args.from_json)
        report.write(rows, meta, markdown_path=args.markdown, plot_path=args.plot)
        return 0
    if args.store:
        return store_bench(args)
    from .run import run

    return run(args)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is measured, an output path that could not be written when the run ends."""
    for flag, value in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if not value:
            continue
        path = Path(value)
        directory = path.parent
        if not directory.is_dir():
            raise ValueError(f"{flag}: the directory {str(directory)!r} of {value!r} does not exist; create it or give another path")
        if path.is_dir():
            raise ValueError(f"{flag}: expected a file path, got the directory {value!r}")
        if not os.access(directory, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ValueError(f"{flag}: {value!r} cannot be written (permissions); give another path")


def store_bench(args: argparse.Namespace) -> int:
    """An L3 store's put and get against its own bulk transfer (store.py)."""
    if importlib.util.find_spec("portable_kv.storage") is None:
        raise ImportError(f"--store {args.store}: this install has no storage tier (portable_kv.storage); "
                          "update portable-kv, or leave --store out to measure the GPU link")
    written = [flag for flag, value in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)) if value]
    if written:
        raise ValueError(f"--store prints its own table; {', '.join(written)} belong to the GPU-link benchmark (leave them out)")
    from .run import page_sizes
    from .store import run

    run(args.store, page_sizes=tuple(page_sizes(args.page_size)), repeats=args.reps or 3)
    return 0
