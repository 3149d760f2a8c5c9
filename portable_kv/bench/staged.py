"""`portable-kv bench --section staged`: every io path the backend offers (kernel, direct,
staged, auto, and any it adds) beside the peers, for host pages placed by the allocator
after an engine's churn and for pages placed at random (the worst case), against the
ceiling of the same run.

Per page size: the allocator's run lengths after churn; per pool, placement and io path a
per-layer load (H2D) from an idle GPU, per-layer loads of every layer back to back (as
an engine's load stream issues them) and an all-layer backup (D2H) of page_first_direct
pages (and, placed by the allocator, of layer_first pages), with the SMs each path
occupies and its host time per call; on a GPU a load and a backup at once, and a bf16
matmul loop's cost while loads run beside it, drawn alternately (draws.py).  The pools:
the bench's geometry (MiMo's K 192 / V 128 by default), K and V of one head dim (8 heads
of 128, SGLang's MHA pool) and an MLA latent (its io paths alone).  SGLang's own JIT
kernels are rows of every layer_first pool on a GPU where SGLang is installed
(staged_peers.py); where they cannot run, one row says why.
"""

from __future__ import annotations

import copy
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import portable_kv as pk

from .. import backends
from ..allocator import FreeListAllocator, PageRunAllocator, churn_run_lengths, page_runs
from .context import Context
from .io_paths import AutoWatch, io_paths
from .measure import Clock, gbps
from .peers import peers
from .rows import Row
from .sections import bench_pool, percent, with_clock
from .staged_beside import interference
from .staged_both import both_ways, both_ways_threads
from .staged_peers import SGLangPeers
from .workload import Geometry, Workload

# Host layouts of the section: page_first_direct (a per-layer run of pages is one 2-D copy,
# a row a page) and layer_first (a per-layer run is one contiguous range, so a chunk's copies
# go as one batched call of 1-D copies; SGLang's default layout, which its kernels read).
HOST_LAYOUTS = ("page_first_direct", "layer_first")
# allocator: host pages placed by portable_kv's allocator after churn, device pages at random;
# engine: the same host pages, device pages placed by an engine's allocator after churn (runs,
# which direct io merges with the host's: its copies fall from one a page to a few per run);
# random: both at random (the worst case).  Per placement, the host layouts measured.
PLACEMENTS = {"allocator": HOST_LAYOUTS, "engine": HOST_LAYOUTS[1:], "random": HOST_LAYOUTS[:1]}
# The pools: (group, kind, placements).  "": the bench's geometry; "MHA 8x128": K and V of one
# head dim, as SGLang's MHA pool keeps them (its kernels load a layer in one call), on the
# layout its kernels read; "MLA": DeepSeek-V3's latent, its io paths alone.
SYMMETRIC = "MHA 8x128"
GROUPS = (("", "MHA", ("allocator", "engine", "random")), (SYMMETRIC, "MHA", ("allocator",)), ("MLA", "MLA", ("allocator", "random")))
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
    placed by the allocator after churn or at random; `group` names its pool in the rows."""

    def __init__(self, geometry: Geometry, page_size: int, layers: int, device: torch.device, placement: str, pool: str = "MHA",
                 group: str = "") -> None:
        super().__init__(geometry, page_size, layers, device, pool)
        self.peer_host_idx = self.host_idx  # random pages of a pool the peers' own size
        self.placement, self.group = placement, group
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


def groups(geometry: Geometry) -> list[tuple[str, str, Geometry, tuple[str, ...]]]:
    """(group, kind, geometry, placements) of the section's pools for the bench's `geometry`."""
    symmetric = replace(geometry, heads=8, k_dim=128, v_dim=128)
    found = []
    for group, kind, placements in GROUPS:
        if (group == "MLA" and not geometry.mla_dim) or (group == SYMMETRIC and symmetric == geometry):
            continue
        found.append((group, kind, symmetric if group == SYMMETRIC else geometry, placements))
    return found


def measure(ctx: Context) -> list[Row]:
    """The section over page sizes, pools, placements and backends."""
    rows = []
    plan = [(page_size, *g, placement) for page_size in ctx.sizes for *g, placements in groups(ctx.geometry) for placement in placements]
    ctx.progress.expect(len(plan) * len(ctx.names))
    for page_size, group, kind, geometry, placement in plan:
        w = StagedWorkload(geometry, page_size, ctx.mla_layers if kind == "MLA" else ctx.layers, ctx.device, placement, kind, group)
        what = f"page {page_size}, {pool_label(w)}{placed(placement)}"
        ctx.progress(f"{what}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
        if placement == "allocator" and not group:
            rows += run_lengths(page_size, w.host_idx)
        if placement == "engine":
            rows.append(Row("staged", "runs of the transfer's device pages, an engine's allocator after churn", "-", page_size,
                            extra=_runs_summary(page_runs(w.dev_idx, page_size))))
        for name in ctx.names:
            rows += section(ctx, w, name, with_peers=placement == "random" and name == ctx.names[0] and not group)
            ctx.progress.done(f"{what}, {name}")
        del w
        if ctx.gpu:
            torch.cuda.empty_cache()
    return rows


def pool_label(w: StagedWorkload) -> str:
    return f"{w.group}, " if w.group else ""


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


def section(ctx: Context, w: StagedWorkload, name: str, with_peers: bool) -> list[Row]:
    """Every io path on one pool of `w`'s placement (and SGLang's kernels on a layer_first pool);
    of an MHA pool, both ways at once and the loads beside compute on a GPU."""
    clock, reps, ceil = ctx.clock, ctx.reps, ctx.ceil
    backend = backends.use(name)
    paths = io_paths(backend)
    rows = []
    if with_peers and clock.gpu:
        own = copy.copy(w)
        own.host_idx = w.peer_host_idx
        rows += [_labelled(r, f"peer: {r.name}, random pages") for r in peers(clock, own, reps, ceil)]
    for layout in PLACEMENTS[w.placement]:
        where = pool_label(w) + placed(w.placement) + ("" if layout == HOST_LAYOUTS[0] else f", {layout} host")
        with w.host_pool(layout, "kernel") as host:
            for io in paths:
                label = f"{name} {io}, {where}"
                for row in [*bench_pool(clock, w, host, io, reps, ceil, "staged", label), back_to_back(clock, w, host, io, reps, ceil, label)]:
                    rows.append(_with_sms(row, backend, host, w, io, clock.gpu))
            sglang = SGLangPeers.of(w, host) if layout == "layer_first" and name == ctx.names[0] else None
            if sglang is not None:
                rows += sglang.rows(clock, reps, ceil, where)
            if clock.gpu and w.pool == "MHA":  # the MLA rows: the io paths alone
                for io in paths:
                    rows.append(both_ways(clock, w, host, io, reps, ceil, name, where))
                    rows.append(both_ways_threads(clock, w, host, io, reps, ceil, name, where))
                if "auto" in paths:
                    # auto with the backup issued first (a load that would stage then sees it
                    # running and takes the kernel path), and the pairings auto chooses between
                    rows.append(both_ways(clock, w, host, "auto", reps, ceil, name, where, backup_first=True))
                    rows.append(both_ways(clock, w, host, "kernel", reps, ceil, name, where, backup_io="staged"))
                    rows.append(both_ways(clock, w, host, "staged", reps, ceil, name, where, backup_io="kernel"))
                rows += interference(ctx, w, host, name, where, paths, sglang)
    return rows


def _labelled(row: Row, name: str) -> Row:
    row.name, row.section = name, "staged"
    return row


def _with_sms(row: Row, backend: Any, host: pk.AsymmetricHostPool | pk.MLAHostPool, w: StagedWorkload, io: str, gpu: bool) -> Row:
    """The most SMs (CUs) a call of `io` in the row's direction occupies, and which path auto
    (or staged, which falls back where it cannot carry a call) took: one more call tells."""
    taken = io
    if io in ("auto", "staged"):
        watch = AutoWatch(host, io)
        if row.direction == "h2d":
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0, io_backend=io)
        else:
            host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx, io_backend=io)
        taken = row.extra[f"{io}_took"] = watch.took()
        if watch.reasons():
            row.extra[f"{io}_reason"] = "; ".join(watch.reasons().values())
    if gpu:
        staging_blocks = host._io_context.settings.staging_blocks  # noqa: SLF001 -- the staged kernel's quota, as the pool read it
        row.grid = {"kernel": getattr(backend, "block_quota", 0), "staged": staging_blocks}.get(taken, 0)
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
