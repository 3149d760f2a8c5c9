"""`portable-kv bench --section staged`: the staged and auto io paths beside kernel, direct
and the peers, for host pages placed by the allocator after an engine's churn and for
pages placed at random (the worst case), against the ceiling of the same run.

Per page size: the allocator's run lengths after churn; per placement and io path a
per-layer load (H2D) from an idle GPU, per-layer loads of every layer back to back (as
an engine's load stream issues them) and an all-layer backup (D2H) of page_first_direct
pages (and, placed by the allocator, of layer_first pages), with the SMs each path
occupies and its host time per call; a load and a backup at once;
on a GPU, a bf16 matmul loop's slowdown while loads run beside it.  Then the io paths
alone over an MLA pool (DeepSeek-V3's latent row), each placement.
"""

from __future__ import annotations

import copy
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

import portable_kv as pk

from .. import backends
from ..allocator import FreeListAllocator, PageRunAllocator, churn_run_lengths, page_runs
from ..io.staged import staging_blocks
from .measure import Clock, gbps
from .peers import peers
from .rows import Row
from .sections import bench_pool, percent, with_clock
from .workload import MLA_LAYERS, Geometry, Workload

IOS = ("kernel", "direct", "staged", "auto")
# Host layouts of the section: page_first_direct (a per-layer run of pages is one 2-D copy,
# a row a page) and, for allocator-placed pages, layer_first (a per-layer run is one
# contiguous range, so a chunk's copies go as one batched call of 1-D copies).
HOST_LAYOUTS = ("page_first_direct", "layer_first")
# allocator: host pages placed by portable_kv's allocator after churn, device pages at random;
# engine: the same host pages, device pages placed by an engine's allocator after churn (runs,
# which direct io merges with the host's: its copies fall from one a page to a few per run);
# random: both at random (the worst case).  MLA pools: the first and the last.
PLACEMENTS = {"MHA": ("allocator", "engine", "random"), "MLA": ("allocator", "random")}
HOST_RATIO = 4.0  # host pool : device pool, so that churn leaves the transfer's pages among others
REQUEST_TOKENS = 4096  # an engine's allocations: prefixes of 1 .. this many tokens, uniform
FILLS = 4  # churn allocates this many times the pool before the transfer's pages are placed


def churned_slots(pool_pages: int, page_size: int, need_pages: int, seed: int = 0, allocator: Callable[[int, int], Any] = PageRunAllocator) -> torch.Tensor:
    """Slots of `need_pages` pages as an allocator places them after churn: prefixes of
    1..REQUEST_TOKENS tokens allocated, the least recently allocated freed when the pool is full
    (churn_run_lengths' workload), then the transfer's own prefixes, which nothing evicts.
    `allocator(size, page_size)`: host slots by portable_kv's (the default), device slots by an
    engine's (FreeListAllocator, SGLang's own), anything with alloc(tokens) and free(slots)."""
    max_pages = max(1, min(pool_pages, REQUEST_TOKENS // page_size))  # a request the pool can hold
    allocator = allocator(pool_pages * page_size, page_size)
    rng = random.Random(seed)
    live: deque[torch.Tensor] = deque()

    def take(pages: int) -> torch.Tensor:
        slots = allocator.alloc(pages * page_size)
        while slots is None:
            allocator.free(live.popleft())
            slots = allocator.alloc(pages * page_size)
        return slots

    for _ in range(FILLS * pool_pages * 2 // (max_pages + 1)):
        live.append(take(rng.randint(1, max_pages)))
    placed, pages = [], 0
    while pages < need_pages:
        n = min(rng.randint(1, max_pages), need_pages - pages)
        placed.append(take(n))
        pages += n
    return torch.cat(placed)


class StagedWorkload(Workload):
    """The bench's workload in a host pool HOST_RATIO times the device pool, its host pages
    placed by the allocator after churn or at random."""

    def __init__(self, geometry, page_size: int, layers: int, device: torch.device, placement: str, pool: str = "MHA") -> None:
        super().__init__(geometry, page_size, layers, device, pool)
        self.peer_host_idx = self.host_idx  # random pages of a pool the peers' own size
        self.placement = placement
        self.pool_pages = int(HOST_RATIO * self.host_pages)
        if placement in ("allocator", "engine"):
            self.host_idx = churned_slots(self.pool_pages, page_size, self.pages)
            if placement == "engine":  # device pages too as an engine's allocator places them
                self.dev_idx = churned_slots(self.host_pages - 1, page_size, self.pages, seed=1, allocator=FreeListAllocator)
        else:
            pages = torch.randperm(self.pool_pages, generator=torch.Generator().manual_seed(1))[: self.pages]
            self.host_idx = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)

    def host_pool(self, layout: str, io: str, host_memory: str = "pinned", ratio: float = HOST_RATIO) -> pk.AsymmetricHostPool | pk.MLAHostPool:
        return super().host_pool(layout, io, host_memory, ratio)


def measure(clock: Clock, geometry: Geometry, sizes: list[int], names: list[str], layers: int, reps: int, ceil: dict,
            device: torch.device, progress, mla_layers: int = MLA_LAYERS) -> list[Row]:
    """The section over page sizes, placements and backends, for the MHA geometry and, where
    `geometry` has an MLA latent, an MLA pool of `mla_layers` layers (its io paths alone)."""
    rows = []
    pools = ("MHA", "MLA") if geometry.mla_dim else ("MHA",)
    for page_size in sizes:
        for pool, placement in [(kind, placement) for kind in pools for placement in PLACEMENTS[kind]]:
            w = StagedWorkload(geometry, page_size, mla_layers if pool == "MLA" else layers, device, placement, pool)
            latent = f", MLA latent of {geometry.mla_dim}" if pool == "MLA" else ""
            progress(f"page {page_size}, {placed(placement)}{latent}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
            if placement == "allocator" and pool == "MHA":
                rows += run_lengths(page_size, w.host_idx)
            if placement == "engine":
                rows.append(Row("staged", "runs of the transfer's device pages, an engine's allocator after churn", "-", page_size,
                                extra=_runs_summary(page_runs(w.dev_idx, page_size))))
            for name in names:
                rows += section(clock, w, reps, ceil, name, with_peers=placement == "random" and name == names[0] and pool == "MHA")
            del w
            if clock.gpu:
                torch.cuda.empty_cache()
    return rows


def placed(placement: str) -> str:
    """Where a placement's pages lie, as rows name it."""
    return "allocator host pages, engine device pages" if placement == "engine" else f"{placement} host pages"


def run_lengths(page_size: int, slots: torch.Tensor) -> list[Row]:
    """The allocator's run lengths after churn (its own simulation), and those of the placed transfer."""
    pool_pages = 4096
    max_pages = max(1, min(pool_pages, REQUEST_TOKENS // page_size))
    histogram = churn_run_lengths(pool_pages, page_size, allocations=FILLS * pool_pages * 2 // (max_pages + 1), max_pages=max_pages)
    lengths = [length for length, count in histogram.items() for _ in range(count)]
    placed = page_runs(slots, page_size)
    return [Row("staged", f"allocator runs after churn, requests of 1-{max_pages} pages", "-", page_size, extra=_runs_summary(lengths)),
            Row("staged", "runs of the transfer's host pages, after churn", "-", page_size, extra=_runs_summary(placed))]


def _runs_summary(lengths: list[int]) -> dict:
    pages = sum(lengths)
    return {"runs": len(lengths), "mean_pages": pages / max(1, len(lengths)), "median_pages": statistics.median(lengths) if lengths else 0,
            "pages_in_runs_ge_8": sum(n for n in lengths if n >= 8) / max(1, pages)}


def section(clock: Clock, w: StagedWorkload, reps: int, ceil: dict, name: str, with_peers: bool) -> list[Row]:
    """Every io path on one pool of `w`'s placement; of an MHA pool, both ways at once and interference on a GPU."""
    backend = backends.use(name)
    rows = []
    if with_peers and clock.gpu:
        own = copy.copy(w)
        own.host_idx = w.peer_host_idx
        rows += [_labelled(r, f"peer: {r.name}, random pages") for r in peers(clock, own, reps, ceil)]
    layouts = {"allocator": HOST_LAYOUTS, "engine": HOST_LAYOUTS[1:], "random": HOST_LAYOUTS[:1]}[w.placement]
    for layout in layouts:
        where = ("MLA, " if w.pool == "MLA" else "") + placed(w.placement) + ("" if layout == HOST_LAYOUTS[0] else f", {layout} host")
        with w.host_pool(layout, "kernel") as host:
            for io in IOS:
                label = f"{name} {io}, {where}"
                for row in [*bench_pool(clock, w, host, io, reps, ceil, "staged", label), back_to_back(clock, w, host, io, reps, ceil, label)]:
                    rows.append(_with_sms(row, backend, host, w, io, clock.gpu))
            if clock.gpu and w.pool == "MHA":  # the MLA rows: the io paths alone
                for io in ("kernel", "staged", "auto"):
                    rows.append(both_ways(clock, w, host, io, reps, ceil, name, where))
                    rows.append(both_ways_threads(clock, w, host, io, reps, ceil, name, where))
                # auto with the backup issued first (a load that would stage then sees it
                # running and takes the kernel path), and the pairings auto chooses between
                rows.append(both_ways(clock, w, host, "auto", reps, ceil, name, where, backup_first=True))
                rows.append(both_ways(clock, w, host, "kernel", reps, ceil, name, where, backup_io="staged"))
                rows.append(both_ways(clock, w, host, "staged", reps, ceil, name, where, backup_io="kernel"))
                rows += interference(clock, w, host, name, where)
    return rows


def auto_took(host: pk.AsymmetricHostPool | pk.MLAHostPool) -> str:
    """The io path `host`'s latest call with io_backend="auto" took."""
    return host._mover("auto").last_choice  # noqa: SLF001 -- the bench reports the path auto took


def _labelled(row: Row, name: str) -> Row:
    row.name, row.section = name, "staged"
    return row


def _with_sms(row: Row, backend, host: pk.AsymmetricHostPool | pk.MLAHostPool, w: StagedWorkload, io: str, gpu: bool) -> Row:
    """The most SMs (CUs) a call of `io` in the row's direction occupies, and which path auto
    (or staged, which falls back where it cannot carry a call) took: one more call tells."""
    taken = io
    if io in ("auto", "staged"):
        if row.direction == "h2d":
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0, io_backend=io)
        else:
            host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx, io_backend=io)
        mover = host._mover(io)  # noqa: SLF001 -- the bench reports the path a call took
        if io == "auto":
            taken = row.extra["auto_took"] = auto_took(host)
            mover = mover.movers["staged"]
        if taken == "staged":
            taken = row.extra["staged_took"] = mover.last_path
    if gpu:
        row.grid = {"kernel": getattr(backend, "block_quota", 0), "staged": staging_blocks()}.get(taken, 0)
        row.extra["sms"] = row.grid
    return row


def back_to_back(clock: Clock, w: StagedWorkload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, name: str) -> Row:
    """Per-layer loads of every layer in turn, issued back to back as an engine's load stream
    issues them: a call's host time and first-copy latency overlap the previous call's
    transfer, which a single call from an idle GPU (bench_pool's row) cannot show."""
    def every_layer() -> None:
        for layer in range(w.layers):
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer, io_backend=io)

    seconds, host_s = clock.time(every_layer, max(3, reps // 2), warmup=1)
    rate = gbps(w.layer_bytes * w.layers, seconds)
    return Row("staged", f"{name}, {w.layers} layers back to back", "h2d", w.page_size, rate, percent(rate, ceil, "h2d"),
               host_s * 1e6 / w.layers, extra=with_clock(clock))


def both_ways(clock: Clock, w: StagedWorkload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, name: str, where: str,
              backup_io: str | None = None, backup_first: bool = False) -> Row:
    """A per-layer load of one half of the pages and a per-layer backup of the other, on two
    streams; the load through `io`, the backup through `backup_io` (default: the same),
    the load issued first unless `backup_first`."""
    load_idx, backup_idx = w.halves()
    backup_io = backup_io or io
    side = torch.cuda.Stream()

    def load() -> None:
        host.load_to_device_per_layer(w.dev, *load_idx, 0, io_backend=io)

    def backup() -> None:
        with torch.cuda.stream(side):
            host.backup_from_device_per_layer(w.dev, *backup_idx, 1, io_backend=backup_io)

    def run() -> None:
        side.wait_stream(torch.cuda.current_stream())
        for call in (backup, load) if backup_first else (load, backup):
            call()
        torch.cuda.current_stream().wait_stream(side)

    seconds, host_s = clock.time(run, reps)
    rate = gbps(2 * load_idx[0].numel() * w.token_layer_bytes, seconds)
    order = ", the backup issued first" if backup_first else ""
    return Row("staged", f"{name} load {io} + backup {backup_io} at once{order}, {where}", "both", w.page_size, rate,
               percent(rate, ceil, "both"), host_s * 1e6, extra=with_clock(clock))


def both_ways_threads(clock: Clock, w: StagedWorkload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, name: str,
                      where: str) -> Row:
    """both_ways with the load and the backup issued from two threads, each on its own
    stream, as an engine's load and write threads issue them (SGLang's cache controller):
    one call's host time no longer delays the other's start."""
    load_idx, backup_idx = w.halves()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    calls = (lambda: host.load_to_device_per_layer(w.dev, *load_idx, 0, io_backend=io),
             lambda: host.backup_from_device_per_layer(w.dev, *backup_idx, 1, io_backend=io))
    # Both threads start a call together; the caller goes on once both have issued theirs.
    go = [threading.Barrier(3, timeout=60) for _ in range(2)]
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        with torch.cuda.stream(streams[n]):
            try:
                while True:
                    go[0].wait()
                    try:
                        calls[n]()
                    except BaseException as exc:  # noqa: BLE001 -- raised again by the caller
                        errors.append(exc)
                    go[1].wait()
            except threading.BrokenBarrierError:  # the caller is done (or gave up waiting)
                return

    def run() -> None:
        current = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(current)
        go[0].wait()
        go[1].wait()
        if errors:
            raise errors[0]
        for stream in streams:
            current.wait_stream(stream)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        seconds, host_s = clock.time(run, reps)
    finally:
        for barrier in go:
            barrier.abort()  # waiting threads wake with BrokenBarrierError and end
        for thread in threads:
            thread.join(timeout=10)
    rate = gbps(2 * load_idx[0].numel() * w.token_layer_bytes, seconds)
    return Row("staged", f"{name} load {io} + backup {io} at once from two threads, {where}", "both", w.page_size, rate,
               percent(rate, ceil, "both"), host_s * 1e6)


def interference(clock: Clock, w: StagedWorkload, host: pk.AsymmetricHostPool, name: str, where: str) -> list[Row]:
    """A bf16 matmul loop with per-layer loads interleaved on a side stream, as an engine runs
    layer by layer: the loads' rate, the matmuls' slowdown against the loop alone, and the
    host's time per load call (the matmuls enqueued after a call wait for it)."""
    n, matmuls = 8192, 40
    a = torch.randn(n, n, device=w.dev.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=w.dev.device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    rows = []
    for io in IOS:  # SMs at the block quota, copy engines alone, both, and the one auto picks
        alone, _ = clock.time(lambda: [torch.mm(a, b, out=c) for _ in range(matmuls)], 3)
        calls = max(4, int(alone / (w.layer_bytes / 50e9)) + 2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        t_start, t_end, m_start, m_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        t_start.record(side)
        m_start.record()
        host_s = 0.0
        for i in range(calls):
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, i % w.layers, io_backend=io)
            host_s += time.perf_counter() - t0
            for _ in range(matmuls * (i + 1) // calls - matmuls * i // calls):
                torch.mm(a, b, out=c)
        m_end.record()
        t_end.record(side)
        torch.cuda.synchronize()
        busy, moved = m_start.elapsed_time(m_end) / 1e3, t_start.elapsed_time(t_end) / 1e3
        extra = {"matmul_slowdown_pct": 100 * (busy / alone - 1), "matmul_alone_ms": alone * 1e3, "loads": calls}
        if io == "auto":
            extra["auto_took"] = auto_took(host)
        rows.append(Row("staged", f"{name} {io} load during matmul, interleaved, {where}", "h2d", w.page_size,
                        gbps(calls * w.layer_bytes, moved), host_us=host_s / calls * 1e6, extra=extra))
    return rows
