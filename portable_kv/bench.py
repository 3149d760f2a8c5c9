"""portable-kv bench: how fast this package moves KV pages, against the link's ceiling.

Everything in one run on one machine: the ceiling (bulk page-locked memcpy),
the peers (what engines and users do today, written here from their
published behaviour), and every backend x layout x io backend, for a
per-layer load and an all-layer backup of the same random pages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from . import backends
from .layout import LAYOUTS
from .pool import AsymmetricHostPool, DeviceKVPool

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}


@dataclass
class Row:
    section: str
    name: str
    direction: str  # "h2d" | "d2h" | "both" | "-"
    page_size: int = 0
    gbps: float = 0.0
    pct_ceiling: float = 0.0
    host_us: float = 0.0  # host CPU time per call (enqueue only)
    grid: int = 0  # blocks launched (SMs occupied) on the kernel path
    extra: dict = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=int, default=4, help="KV heads per GPU (K and V)")
    p.add_argument("--k-dim", type=int, default=192)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--page-size", type=str, default="64,16,1", help="comma-separated page sizes")
    p.add_argument("--pages", type=int, default=0, help="pages per call (default: >= 100 MB per per-layer load)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backends", type=str, default="", help="comma-separated (default: every GPU backend available)")
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--json", type=str, default="", help="write every number here")
    p.add_argument("--plot", type=str, default="", help="a PNG of the bandwidths (needs the bench extra)")
    p.add_argument("--markdown", type=str, default="", help="write the summary tables (as in the README) here")
    p.add_argument("--from-json", type=str, default="", help="measure nothing: print and summarise a saved --json run")
    p.add_argument("--quick", action="store_true", help="about a minute: 8 layers, fewer repetitions, no peers at page 1")


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class Clock:
    """Device time with events on a GPU, wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"

    def time(self, fn: Callable[[], None], reps: int, warmup: int = 2) -> tuple[float, float]:
        """Median seconds per call on the device, and median host seconds to enqueue a call."""
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        self.sync()
        if (time.perf_counter() - t0) / max(1, warmup) > 0.25:  # pathological pairs (DMA of 384-byte rows): fewer repetitions
            reps = min(reps, 3)
        device, host = [], []
        for _ in range(reps):
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            if self.gpu:
                end.record()
                end.synchronize()
                device.append(start.elapsed_time(end) / 1e3)
            else:
                device.append(host[-1])
        return statistics.median(device), statistics.median(host)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()


def ceiling(clock: Clock, device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """One bulk page-locked memcpy each way, and both ways at once (GB/s)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d, _ = clock.time(lambda: dev.copy_(host, non_blocking=True), reps)
    d2h, _ = clock.time(lambda: host.copy_(dev, non_blocking=True), reps)
    result = {"h2d": nbytes / h2d / 1e9, "d2h": nbytes / d2h / 1e9}
    if clock.gpu:
        result["both"] = both_ways(clock, (dev, host), (host2, dev2), reps)
        # The same bytes as 4 copies on 4 streams: one copy engine per stream, where
        # a single memcpy may use one; reported beside the ceiling, not instead of it.
        streams = [torch.cuda.Stream() for _ in range(4)]
        quarter = nbytes // 4
        for direction, (dst, src) in (("h2d_4streams", (dev, host)), ("d2h_4streams", (host, dev))):
            def split(dst=dst, src=src):
                for i, s in enumerate(streams):
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        dst[i * quarter : (i + 1) * quarter].copy_(src[i * quarter : (i + 1) * quarter], non_blocking=True)
                for s in streams:
                    torch.cuda.current_stream().wait_stream(s)

            t, _ = clock.time(split, reps)
            result[direction] = nbytes / t / 1e9
    return result


class Workload:
    """One device pool and random pages: a per-layer load must move >= 100 MB."""

    def __init__(self, args: argparse.Namespace, page_size: int, layers: int, device: torch.device) -> None:
        self.dtype = DTYPES[args.dtype]
        item = torch.empty((), dtype=self.dtype).element_size()
        self.token_layer_bytes = args.heads * (args.k_dim + args.v_dim) * item
        target = 100e6 if device.type != "cpu" else 4e6
        self.pages = args.pages or -(-int(target // self.token_layer_bytes) // page_size)
        self.page_size, self.layers = page_size, layers
        dev_pages = self.pages + max(8, self.pages // 8)
        self.dev = DeviceKVPool(layers, dev_pages * page_size, page_size, args.heads, args.k_dim, args.v_dim,
                                dtype=self.dtype, device=device)
        gen = torch.Generator().manual_seed(0)
        offsets = torch.arange(page_size)
        self.dev_idx = (torch.randperm(dev_pages, generator=gen)[: self.pages, None] * page_size + offsets).reshape(-1)
        self.host_pages = dev_pages
        self.host_idx = (torch.randperm(dev_pages, generator=gen)[: self.pages, None] * page_size + offsets).reshape(-1)
        self.layer_bytes = self.pages * page_size * self.token_layer_bytes

    def host_pool(self, layout: str, io: str, host_memory: str = "pinned") -> AsymmetricHostPool:
        return AsymmetricHostPool(self.dev, host_to_device_ratio=1.0, layout=layout, io_backend=io, host_memory=host_memory)


def bench_pool(clock: Clock, w: Workload, host: AsymmetricHostPool, io: str, reps: int, ceil: dict, section: str, name: str) -> list[Row]:
    rows = []
    layer = [0]

    def load():
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer[0] % w.layers, io_backend=io)
        layer[0] += 1

    t, cpu = clock.time(load, reps)
    grid = _grid(host, w, w.layer_bytes, io)
    rows.append(Row(section, name, "h2d", w.page_size, w.layer_bytes / t / 1e9, 100 * w.layer_bytes / t / 1e9 / ceil["h2d"], cpu * 1e6, grid))
    all_bytes = w.layer_bytes * w.layers
    t, cpu = clock.time(lambda: host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx, io_backend=io), max(3, reps // 4), warmup=1)
    rows.append(Row(section, name, "d2h", w.page_size, all_bytes / t / 1e9, 100 * all_bytes / t / 1e9 / ceil["d2h"], cpu * 1e6, _grid(host, w, all_bytes, io)))
    return rows


def _grid(host: AsymmetricHostPool, w: Workload, nbytes: int, io: str) -> int:
    if io != "kernel" or not hasattr(host.backend, "block_quota"):
        return 0
    from .backends.gpu import grid_size

    return grid_size(nbytes // 16, host.backend.block_quota)


def peers(clock: Clock, w: Workload, reps: int, ceil: dict) -> list[Row]:
    """What engines and users do today, written from their published behaviour."""
    rows = []
    P = w.page_size
    host_k = torch.empty(w.host_pages, w.layers, P, *w.dev.k_buffer[0].shape[1:], dtype=w.dtype, pin_memory=clock.gpu)
    host_v = torch.empty(w.host_pages, w.layers, P, *w.dev.v_buffer[0].shape[1:], dtype=w.dtype, pin_memory=clock.gpu)
    host_pages = (w.host_idx[::P] // P).tolist()
    dev_starts = w.dev_idx[::P].tolist()

    def page_loop():  # legacy swap_blocks: one copy_ per page and tensor
        for hp, d0 in zip(host_pages, dev_starts):
            w.dev.k_buffer[0][d0 : d0 + P].copy_(host_k[hp, 0], non_blocking=True)
            w.dev.v_buffer[0][d0 : d0 + P].copy_(host_v[hp, 0], non_blocking=True)

    t, cpu = clock.time(page_loop, max(3, reps // 4), warmup=1)
    rows.append(Row("peer", "per-page copy_ loop", "h2d", P, w.layer_bytes / t / 1e9, 100 * w.layer_bytes / t / 1e9 / ceil["h2d"], cpu * 1e6))

    host_flat_k = host_k.view(w.host_pages * P, w.layers, *host_k.shape[3:])
    host_flat_v = host_v.view(w.host_pages * P, w.layers, *host_v.shape[3:])
    dev_idx = w.dev_idx.to(w.dev.device)

    def by_hand():  # what a user writes: gather on the host, copy, scatter
        w.dev.k_buffer[0][dev_idx] = host_flat_k[w.host_idx, 0].to(w.dev.device, non_blocking=True)
        w.dev.v_buffer[0][dev_idx] = host_flat_v[w.host_idx, 0].to(w.dev.device, non_blocking=True)

    t, cpu = clock.time(by_hand, max(3, reps // 4), warmup=1)
    rows.append(Row("peer", "torch indexing by hand", "h2d", P, w.layer_bytes / t / 1e9, 100 * w.layer_bytes / t / 1e9 / ceil["h2d"], cpu * 1e6))

    backend = backends.current()
    if hasattr(backend, "memcpy_batch"):
        rows += unmerged_batch(clock, w, backend, host_k, host_v, reps, ceil)
    return rows


def unmerged_batch(clock, w, backend, host_k, host_v, reps, ceil) -> list[Row]:
    """The engines' direct path today: one batched memcpy, a descriptor per page and tensor, no merging."""
    import numpy as np

    from .plan import CopyBatch

    P = w.page_size
    host_pages = (w.host_idx[::P] // P).numpy()
    dev_starts = w.dev_idx[::P].numpy()
    rows = []
    for direction in ("h2d", "d2h"):
        dst, src, sizes = [], [], []
        for host_t, dev_t in ((host_k, w.dev.k_buffer[0]), (host_v, w.dev.v_buffer[0])):
            page_bytes = P * dev_t[0].numel() * dev_t.element_size()
            host_addr = host_t.data_ptr() + host_pages * host_t.stride(0) * host_t.element_size()
            dev_addr = dev_t.data_ptr() + dev_starts * dev_t.stride(0) * dev_t.element_size()
            to, frm = (dev_addr, host_addr) if direction == "h2d" else (host_addr, dev_addr)
            dst.append(to)
            src.append(frm)
            sizes.append(np.full(len(host_addr), page_bytes))
        batch = CopyBatch(*(np.concatenate(a).astype(np.uint64) for a in (dst, src, sizes)))
        t, cpu = clock.time(lambda b=batch: backend.memcpy_batch(b, torch.cuda.current_stream().cuda_stream), reps)
        rows.append(Row("peer", "one unmerged batched memcpy", direction, P, w.layer_bytes / t / 1e9,
                        100 * w.layer_bytes / t / 1e9 / ceil[direction], cpu * 1e6, extra={"descriptors": len(batch)}))
    return rows


def sweep(clock: Clock, w: Workload, reps: int, ceil: dict, io: str, setting: str, values: tuple[int, ...], label: str) -> list[Row]:
    """Bandwidth against one backend setting (block_quota, dma_streams): where its default comes from."""
    backend = backends.current()
    rows = []
    saved = getattr(backend, setting)
    host = w.host_pool("page_first_direct", io)
    try:
        for value in values:
            setattr(backend, setting, value)
            for row in bench_pool(clock, w, host, io, reps, ceil, setting, label.format(value)):
                row.extra[setting] = value
                rows.append(row)
    finally:
        setattr(backend, setting, saved)
        host.close()
    return rows


def host_memory_rows(clock: Clock, w: Workload, reps: int, ceil: dict, name: str) -> list[Row]:
    """Registered (mmap, 2 MiB pages) against page-locked host memory: does the page size of
    the host buffer change what scattered reads over PCIe cost?"""
    rows = []
    for io in backends.current().io_backends:
        if io == "kernel" and not backends.current().kernel_reads_registered_memory:
            continue
        host = w.host_pool("page_first_direct", io, "registered")
        rows += bench_pool(clock, w, host, io, reps, ceil, "host_memory", f"{name} page_first_direct {io}, registered")
        host.close()
    return rows


def quota_sweep(clock: Clock, w: Workload, reps: int, ceil: dict, name: str) -> list[Row]:
    return (sweep(clock, w, reps, ceil, "kernel", "block_quota", (2, 4, 8, 16, 24, 32, 64, 132), f"{name} kernel, {{}} blocks")
            + sweep(clock, w, reps, ceil, "direct", "dma_streams", (1, 2, 4), f"{name} direct, {{}} streams"))


def both_directions(clock: Clock, w: Workload, reps: int, ceil: dict, name: str, load_io: str, backup_io: str,
                    host_memory: str = "pinned") -> Row:
    """A load and a backup at once, on two streams, as an engine overlaps prefetch and write-back: the total."""
    load_pool = w.host_pool("page_first_direct", load_io, host_memory)
    backup_pool = w.host_pool("page_first_direct", backup_io, host_memory)
    half = w.pages // 2 * w.page_size
    load_idx = (w.host_idx[:half].clone(), w.dev_idx[:half].clone())
    backup_idx = (w.host_idx[half:].clone(), w.dev_idx[half:].clone())
    side = torch.cuda.Stream()

    def run():
        side.wait_stream(torch.cuda.current_stream())
        load_pool.load_to_device_per_layer(w.dev, *load_idx, 0)
        with torch.cuda.stream(side):
            backup_pool.backup_from_device_per_layer(w.dev, *backup_idx, 1)
        torch.cuda.current_stream().wait_stream(side)

    t, cpu = clock.time(run, reps)
    load_pool.close()
    backup_pool.close()
    nbytes = 2 * half * w.token_layer_bytes
    return Row("both", f"{name} load {load_io} + backup {backup_io} at once" + (f", {host_memory}" if host_memory != "pinned" else ""), "both", w.page_size, nbytes / t / 1e9,
               100 * nbytes / t / 1e9 / ceil["both"], cpu * 1e6)


def both_ways(clock: Clock, load: tuple[torch.Tensor, torch.Tensor], backup: tuple[torch.Tensor, torch.Tensor], reps: int) -> float:
    """GB/s of two bulk copies (dst, src) at once, opposite ways on two streams."""
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        load[0].copy_(load[1], non_blocking=True)
        with torch.cuda.stream(side):
            backup[0].copy_(backup[1], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    t, _ = clock.time(both, reps)
    return (load[0].numel() + backup[0].numel()) / t / 1e9


def bulk_both(clock: Clock, nbytes: int, reps: int, ceil: dict) -> Row:
    """Two bulk memcpys of `nbytes` each, opposite ways on two streams: is the transfer size the limit?"""
    host, host2 = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev, dev2 = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    gbps = both_ways(clock, (dev, host), (host2, dev2), reps)
    return Row("both", f"bulk pinned memcpy both ways, {nbytes / 1e6:.0f} MB each", "both", 0, gbps, 100 * gbps / ceil["both"])


def interference(clock: Clock, w: Workload, name: str, reps: int) -> list[Row]:
    """A bf16 matmul loop on one stream while transfers run on another."""
    n = 8192
    a = torch.randn(n, n, device=w.dev.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=w.dev.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    matmuls = 40

    def matmul_loop():
        for _ in range(matmuls):
            torch.mm(a, b, out=c)

    alone, _ = clock.time(matmul_loop, 5)
    rows = [Row("interference", "bf16 matmul alone", "-", 0, extra={"tflops": 2 * n**3 * matmuls / alone / 1e12})]
    for io, priority, order in [(io, p, o) for io, p in (("kernel", 0), ("kernel", -1), ("direct", 0)) for o in ("loads first", "interleaved")]:
        # Priority -1: engines put their load streams above compute, so that the
        # copy kernel's blocks are scheduled as soon as the matmul's retire.
        side = torch.cuda.Stream(priority=priority)
        host = w.host_pool("page_first_direct", io)
        alone, _ = clock.time(matmul_loop, 3)  # again, just before: boost clocks drift over a run
        t_start, t_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        m_start, m_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        calls = max(4, int(alone / (w.layer_bytes / 50e9)) + 2)

        def load(i: int, host=host, side=side) -> None:
            with torch.cuda.stream(side):
                host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, i % w.layers)

        t_start.record(side)
        if order == "loads first":  # every load queued, then the compute
            for i in range(calls):
                load(i)
            m_start.record()
            matmul_loop()
        else:  # as an engine runs layer by layer: a load, a share of the compute, the next load
            load(0)
            m_start.record()
            for i in range(1, calls):
                for _ in range(matmuls * i // (calls - 1) - matmuls * (i - 1) // (calls - 1)):
                    torch.mm(a, b, out=c)
                load(i)
        m_end.record()
        t_end.record(side)
        torch.cuda.synchronize()
        busy = m_start.elapsed_time(m_end) / 1e3
        moved = t_start.elapsed_time(t_end) / 1e3
        # How much of the transfers' span the matmuls covered: a rate measured
        # mostly outside the compute says little about interference.
        overlap = max(0.0, min(t_start.elapsed_time(m_end) / 1e3, moved) - max(t_start.elapsed_time(m_start) / 1e3, 0.0))
        label = f"{name} {io} load during matmul, {order}" + (", high-priority stream" if priority else "")
        rows.append(Row("interference", label, "h2d", w.page_size, calls * w.layer_bytes / moved / 1e9,
                        extra={"matmul_slowdown_pct": 100 * (busy / alone - 1), "overlap_pct": 100 * overlap / moved,
                               "matmul_s": busy, "alone_s": alone}))
        host.close()
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'section':<12} {'what':<46} {'dir':<4} {'page':>4} {'GB/s':>7} {'%ceil':>6} {'host us':>9} {'grid':>5}  extra"]
    for r in rows:
        extra = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        lines.append(f"{r.section:<12} {r.name:<46} {r.direction:<4} {r.page_size:>4} {r.gbps:>7.1f} {r.pct_ceiling:>6.1f} {r.host_us:>9.1f} {r.grid:>5}  {extra}")
    return "\n".join(lines)


def markdown(rows: list[Row], ceil: dict, device: str) -> str:
    """The summary tables for a README: page_first_direct paths and peers by page size, both ways, interference."""
    pages = sorted({r.page_size for r in rows if r.section in ("package", "peer")}, reverse=True)

    def cell(name: str, section: str, page: int) -> str:
        found = {r.direction: r for r in rows if r.section == section and r.name == name and r.page_size == page}
        parts = [f"{found[d].gbps:.1f} ({found[d].pct_ceiling:.0f}%)" for d in ("h2d", "d2h") if d in found]
        return " / ".join(parts)

    def host_us(name: str, section: str) -> str:
        found = [r.host_us for r in rows if r.section == section and r.name == name and r.direction == "h2d" and r.host_us]
        if not found:
            return ""
        low, high = f"{min(found):.0f}", f"{max(found):.0f}"
        return low if low == high else f"{low}-{high}"

    names = [(r.section, r.name) for r in rows if (r.section == "package" and " page_first_direct " in f" {r.name} ") or r.section == "peer"]
    names = list(dict.fromkeys(names))
    both = ", ".join(f"{ceil[k]:.1f}" for k in ("h2d", "d2h", "both") if k in ceil)
    lines = [f"{device}; ceiling (bulk pinned memcpy, H2D, D2H, both ways): {both} GB/s; "
             "a cell is per-layer load H2D / all-layer backup D2H, GB/s (% of the ceiling).", "",
             "| path | " + " | ".join(f"page {p}" for p in pages) + " | host us per load |",
             "|---|" + "---|" * len(pages) + "---|"]
    for section, name in names:
        if section == "package":
            backend, layout, io = name.split()
            label = f"{backend} {io}, {layout}"
        else:
            label = f"peer: {name}"
        lines.append(f"| {label} | " + " | ".join(cell(name, section, p) for p in pages) + f" | {host_us(name, section)} |")
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
    both_rows = [r for r in rows if r.section == "both"]
    if both_rows:
        lines += ["", "| both directions at once (50 MB each way) | GB/s | % of the both-ways ceiling |", "|---|---|---|"]
        lines += [f"| {r.name} | {r.gbps:.1f} | {r.pct_ceiling:.0f}% |" for r in both_rows]
    inter = [r for r in rows if r.section == "interference" and r.direction == "h2d"]
    if inter:
        lines += ["", "| during a bf16 matmul loop | load GB/s | matmul slowdown | loads' span under the matmuls |", "|---|---|---|---|"]
        lines += [f"| {r.name} | {r.gbps:.1f} | {r.extra.get('matmul_slowdown_pct', 0):+.1f}% | "
                  + (f"{r.extra['overlap_pct']:.0f}%" if "overlap_pct" in r.extra else "") + " |" for r in inter]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in rows if r.section in ("package", "peer") and r.gbps > 0]
    fig, ax = plt.subplots(figsize=(12, max(4, 0.22 * len(main))))
    labels = [f"{r.name} {r.direction} p{r.page_size}" for r in main]
    ax.barh(labels, [r.pct_ceiling for r in main], color=["tab:blue" if r.section == "package" else "tab:gray" for r in main])
    ax.axvline(100, color="k", lw=0.8)
    ax.set_xlabel("% of the measured PCIe ceiling")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        return render(args)
    if backends.current().device.type == "cuda":
        # Engines transfer on streams of their own; the batched memcpy APIs reject the legacy default stream.
        with torch.cuda.stream(torch.cuda.Stream()):
            return run(args)
    return run(args)


def render(args: argparse.Namespace) -> int:
    """The table and the summary of a saved run (--from-json): no measurement."""
    with open(args.from_json) as f:
        data = json.load(f)
    rows = [Row(**r) for r in data["rows"]]
    print(table(rows))
    if args.markdown:
        write_markdown(args.markdown, rows, data["meta"])
    return 0


def write_markdown(path: str, rows: list[Row], meta: dict) -> None:
    """The summary of a run, from its rows and --json metadata: a fresh run and --from-json write the same file."""
    device = meta["gpu"] if meta["gpu"] != "none" else f"{meta['device']} (CPU backend: says nothing about GPUs)"
    with open(path, "w") as f:
        f.write(markdown(rows, meta["ceiling"], device))


def run(args: argparse.Namespace) -> int:
    backend = backends.current()
    device = backend.device
    gpu = device.type != "cpu"
    if not gpu:
        print("portable-kv bench: no GPU backend is bound; these are CPU-backend numbers and say nothing about GPUs.")
    layers = 8 if args.quick else args.layers
    reps = args.reps or (5 if args.quick else 20)
    clock = Clock(device)
    names = [n for n in (args.backends.split(",") if args.backends else backends.available()) if n != "cpu" or not gpu]
    progress(f"ceiling: bulk page-locked memcpy on {device}")
    ceil = ceiling(clock, device, (512 << 20 if args.quick else 2 << 30) if gpu else 64 << 20, reps)
    rows = [Row("ceiling", "bulk pinned memcpy" + (", 4 streams" if "4streams" in d else ""), d.split("_")[0], 0, v,
                100.0 * v / ceil[d.split("_")[0]]) for d, v in ceil.items()]
    for page_size in [int(p) for p in args.page_size.split(",")]:
        w = Workload(args, page_size, layers, device)
        progress(f"page {page_size}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
        if gpu and not (args.quick and page_size == 1):
            progress("  peers")
            rows += peers(clock, w, reps, ceil)
        for name in names:
            backends.use(name)
            for layout in LAYOUTS:
                for io in backends.current().io_backends:
                    progress(f"  {name} {layout} {io}")
                    host = w.host_pool(layout, io)
                    rows += bench_pool(clock, w, host, io, reps, ceil, "package", f"{name} {layout} {io}")
                    host.close()
            if gpu and page_size in (64, 1) and name != "triton":
                progress(f"  {name} block quota sweep")
                rows += quota_sweep(clock, w, reps, ceil, name)
                progress(f"  {name} registered host memory")
                rows += host_memory_rows(clock, w, reps, ceil, name)
            if gpu and page_size == 64:
                ios = backends.current().io_backends
                for load_io in ios:
                    for backup_io in ios:
                        rows.append(both_directions(clock, w, reps, ceil, name, load_io, backup_io))
                if backends.current().kernel_reads_registered_memory:
                    rows.append(both_directions(clock, w, reps, ceil, name, "kernel", "kernel", "registered"))
                    rows.append(both_directions(clock, w, reps, ceil, name, "kernel", "direct", "registered"))
                if name == names[0]:
                    rows.append(bulk_both(clock, w.pages // 2 * w.page_size * w.token_layer_bytes, reps, ceil))
                if name != "triton":
                    progress(f"  {name} interference")
                    rows += interference(clock, w, name, reps)
        backends.use(backend.name)
        del w
        if gpu:
            torch.cuda.empty_cache()
    print(table(rows))
    meta = {"backend": backend.name, "device": str(device), "gpu": torch.cuda.get_device_name() if gpu else "none",
            "torch": torch.__version__, "args": vars(args) | {"func": None}, "ceiling": ceil}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    if args.markdown:
        write_markdown(args.markdown, rows, meta)
    return 0
