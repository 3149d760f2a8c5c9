"""What a run leaves: the terminal table, the README's markdown summary, a plot, the JSON.

Every renderer takes the rows and the run's metadata only, so a fresh run and
`--from-json` of a saved one print and write the same thing.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .draws import spread_text
from .registry import SECTIONS
from .rows import Row, ceiling_text, device_label, on_gpu

# The direction column names the call on the CPU backend, where there is no link.
CPU_CALLS = {"h2d": "load", "d2h": "backup"}


def own_renderer(meta: dict, kind: str) -> Callable[[list[Row], dict], str] | None:
    """The renderer (`kind`: "table" or "markdown") registry.py names for the run's section, if any."""
    section = SECTIONS.get(meta.get("args", {}).get("section", "all"))
    name = getattr(section, kind, "") if section is not None else ""
    if not name:
        return None
    module, function = name.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def table(rows: list[Row], meta: dict) -> str:
    own = own_renderer(meta, "table")
    if own is not None:
        return own(rows, meta)
    gpu = on_gpu(meta)
    head = f"{'section':<12} {'what':<46} {'dir' if gpu else 'call':<6} {'page':>4} {'GB/s':>7} "
    head += f"{'%ceil':>6} {'host us':>9} {'blocks':>6}  extra" if gpu else f"{'host us':>9}  extra"
    lines = [head]
    for r in rows:
        extra = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        direction = r.direction if gpu else CPU_CALLS.get(r.direction, r.direction)
        rate, pct, host_us = (f"{value:.1f}" if value else "-" for value in (r.gbps, r.pct_ceiling, r.host_us))
        line = f"{r.section:<12} {r.name:<46} {direction:<6} {r.page_size or '-':>4} {rate:>7} "
        line += f"{pct:>6} {host_us:>9} {r.grid or '-':>6}  {extra}" if gpu else f"{host_us:>9}  {extra}"
        lines.append(line.rstrip())
    lines += ["", device_label(meta) + "; " + ceiling_text(meta) + "."]
    if gpu:
        lines += ["dir: h2d is one per-layer load (host to GPU; \"layers back to back\": every layer's load in turn, as an engine",
                  "issues them, host us per call), d2h one all-layer backup (GPU to host), both: a load and a",
                  "backup at once on two streams; GB/s over the device time (events), median; %ceil: of the ceiling of the",
                  "same direction; host us: host CPU time to enqueue one call, median (host_cost: back to back); blocks: the kernel path's block quota",
                  "(the most SMs a call occupies); peers: what engines do today; extra: the setting a sweep changed; -: not measured."]
    else:
        lines += ["call: load is one per-layer load (\"layers back to back\": every layer's in turn, host us per call),",
                  "backup one all-layer backup, here both between two host buffers;",
                  "GB/s over the wall time, median; host us: the same call's host time (on the CPU backend the call is the copy);",
                  "no GPU was used: run `portable-kv bench` on a GPU host for link bandwidths."]
    return "\n".join(lines)


def markdown(rows: list[Row], meta: dict) -> str:
    """The summary tables for a README: page_first_direct paths and peers by page size, the block
    quota sweep, both ways at once, interference; a legend under each."""
    own = own_renderer(meta, "markdown")
    if own is not None:
        return own(rows, meta)
    gpu = on_gpu(meta)
    pages = sorted({r.page_size for r in rows if r.section in ("package", "peer", "mla")}, reverse=True)

    def cell(name: str, section: str, page: int) -> str:
        found = {r.direction: r for r in rows if r.section == section and r.name == name and r.page_size == page}
        return " / ".join((f"{found[d].gbps:.1f} ({found[d].pct_ceiling:.0f}%)" if gpu else f"{found[d].gbps:.1f}")
                          for d in ("h2d", "d2h") if d in found)

    def host_us(name: str, section: str) -> str:
        found = [r.host_us for r in rows if r.section == section and r.name == name and r.direction == "h2d" and r.host_us]
        if not found:
            return ""
        low, high = f"{min(found):.0f}", f"{max(found):.0f}"
        return low if low == high else f"{low}-{high}"

    names = [(r.section, r.name) for r in rows if (r.section == "package" and " page_first_direct " in f" {r.name} ") or r.section == "peer"]
    lines = [f"{device_label(meta)}; {ceiling_text(meta)}.", "",
             "| path | " + " | ".join(f"page {p}" for p in pages) + " | host us per load |",
             "|---|" + "---|" * len(pages) + "---|"]
    for section, name in dict.fromkeys(names):
        if section == "package":
            backend, layout, io = name.split()
            label = f"{backend} {io}, {layout}"
        else:
            label = f"peer: {name}"
        lines.append(f"| {label} | " + " | ".join(cell(name, section, p) for p in pages) + f" | {host_us(name, section)} |")
    legend = ("A cell: one per-layer load H2D / one all-layer backup D2H, GB/s (% of the ceiling of that direction); "
              "one number: H2D only; empty: not measured. Host us: host CPU time to enqueue one load, over the page sizes.") if gpu else (
              "A cell: one per-layer load / one all-layer backup, GB/s, both between host buffers (no GPU, no link). "
              "Host us: the load's time on the host, which on the CPU backend is the copy itself.")
    lines += ["", legend]
    mla = list(dict.fromkeys(r.name for r in rows if r.section == "mla"))
    if mla:
        latent = meta.get("args", {}).get("mla_dim", "")
        lines += ["", f"| MLA path, a {latent}-element latent row | " + " | ".join(f"page {p}" for p in pages) + " | host us per load |",
                  "|---|" + "---|" * len(pages) + "---|"]
        for name in mla:
            backend, layout, io = name.split()
            lines.append(f"| {backend} {io}, {layout} | " + " | ".join(cell(name, "mla", p) for p in pages) + f" | {host_us(name, 'mla')} |")
        lines += ["", legend.replace("A cell:", "An MLA pool (one latent buffer a layer, as DeepSeek-V3 keeps it), against the same ceiling. A cell:")]
    quota = [r for r in rows if r.section == "block_quota"]
    if quota:
        counts = sorted({r.extra.get("block_quota", r.grid) for r in quota})
        lines += ["", "| kernel path against its block quota (H2D / D2H GB/s) | " + " | ".join(f"{c} blocks" for c in counts) + " |",
                  "|---|" + "---|" * len(counts)]
        for backend in dict.fromkeys(r.name.split()[0] for r in quota):
            for page in sorted({r.page_size for r in quota}, reverse=True):
                by = {(r.extra.get("block_quota", r.grid), r.direction): r.gbps for r in quota if r.page_size == page and r.name.startswith(backend + " ")}
                cells = [" / ".join(f"{by[c, d]:.1f}" for d in ("h2d", "d2h") if (c, d) in by) for c in counts]
                lines.append(f"| {backend}, page {page} | " + " | ".join(cells) + " |")
        lines += ["", "A cell: the kernel path with the block quota of its column (`PORTABLE_KV_BLOCKS`), per-layer load H2D / all-layer backup D2H, GB/s."]
    both_rows = [r for r in rows if r.section == "both"]
    if both_rows:
        lines += ["", "| both directions at once (50 MB each way) | GB/s | % of the both-ways ceiling |", "|---|---|---|"]
        lines += [f"| {r.name} | {r.gbps:.1f} | {r.pct_ceiling:.0f}% |" for r in both_rows]
        lines += ["", "GB/s: the bytes of a per-layer load and a per-layer backup on two streams, over the span of both."]
    inter = [r for r in rows if r.section == "interference" and r.direction == "h2d"]
    if inter:
        lines += ["", "| during a bf16 matmul loop | load GB/s | matmul slowdown | loads' span under the matmuls | host us a load |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r.name} | {spread_text(r.extra, 'gbps', '.1f', r.gbps)} | {spread_text(r.extra, 'matmul_slowdown_pct', '+.1f')}% | "
                  + (f"{r.extra['overlap_pct']:.0f}%" if "overlap_pct" in r.extra else "")
                  + (f" | {spread_text(r.extra, 'host_us', '.0f', r.host_us)} |" if r.host_us else " |  |") for r in inter]
        lines += ["", "Load GB/s: per-layer loads on a side stream while the matmuls run; slowdown: the matmuls' time against "
                  "the same loop alone; span: how much of the loads' time the matmuls covered (a low share says little about interference); "
                  "host us: the caller's time in a load call (empty: not recorded)."
                  + (" Drawn several times, the rows in turn: the median, and in brackets the least and the most of the draws."
                     if any("draws" in r.extra for r in inter) else "")]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = on_gpu(meta)
    main = [r for r in rows if r.section in ("package", "peer", "mla") and r.gbps > 0]
    fig, ax = plt.subplots(figsize=(12, max(4, 0.22 * len(main))))
    labels = [f"{'MLA ' if r.section == 'mla' else ''}{r.name} {r.direction if gpu else CPU_CALLS.get(r.direction, r.direction)} p{r.page_size}"
              for r in main]
    colors = {"package": "tab:blue", "mla": "tab:green"}
    ax.barh(labels, [r.pct_ceiling if gpu else r.gbps for r in main], color=[colors.get(r.section, "tab:gray") for r in main])
    if gpu:
        ax.axvline(100, color="k", lw=0.8)
    ax.set_xlabel("% of the measured PCIe ceiling" if gpu else "GB/s between host buffers (CPU backend, no GPU)")
    ax.set_title(device_label(meta))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(path: str, rows: list[Row], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


def load_json(path: str) -> tuple[list[Row], dict]:
    try:
        data = json.loads(Path(path).read_text())
        return [Row(**r) for r in data["rows"]], data["meta"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"--from-json: {path} is not a saved `portable-kv bench --json` run ({type(exc).__name__}: {exc})") from None


def write(rows: list[Row], meta: dict, *, markdown_path: str = "", plot_path: str = "") -> None:
    """Print the table and write the summaries asked for."""
    print(table(rows, meta))
    if markdown_path:
        Path(markdown_path).write_text(markdown(rows, meta))
    if plot_path:
        plot(rows, meta, plot_path)
