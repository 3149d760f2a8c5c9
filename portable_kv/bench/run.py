"""A run: its backends and page sizes, the ceiling, the section registry.py names, what it leaves;
and the default section (every path) and the both-ways section."""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Callable

import torch

from .. import backends
from ..layout import LAYOUTS
from ..mla import MLA_LAYOUTS
from . import report, sections
from .context import Context
from .measure import Clock
from .peers import peers
from .progress import Progress
from .registry import SECTIONS
from .workload import Geometry, Workload

# Bytes of the ceiling's bulk copy: 2 GiB settles PCIe Gen5 within 1%; 512 MiB is within 2%.
CEILING_BYTES = {"full": 2 << 30, "quick": 512 << 20, "cpu": 64 << 20}
REPS = {"full": 20, "quick": 5}  # timed calls per measurement where --reps is 0
QUICK_LAYERS = 8  # of the MHA and the MLA pools, whatever --layers and --mla-layers say


def chosen_backends(spec: str) -> list[str]:
    """--backends as names that can run here, all on one kind of device; ValueError before anything is measured."""
    if not spec:
        usable = backends.available()
        gpu = [n for n in usable if n != "cpu" and backends.get(n).device.type != "cpu"]
        return gpu or ["cpu"]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in backends.names():
            raise ValueError(f"--backends: expected names from {', '.join(backends.names())}, got {name!r}")
        reason = backends.unavailable_reason(name)
        if reason is not None:
            raise ValueError(f"--backends: {name} cannot run on this machine: {reason}")
    kinds = {backends.get(n).device.type for n in names}
    if len(kinds) > 1:
        raise ValueError(f"--backends: {', '.join(names)} run on different devices ({', '.join(sorted(kinds))}); bench them in separate runs")
    return names


def page_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(p) for p in spec.split(",")]
    except ValueError:
        raise ValueError(f"--page-size: expected comma-separated integers such as 64,16,1, got {spec!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--page-size: expected integers >= 1, got {spec!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    geometry = Geometry.from_args(args)
    sizes = page_sizes(args.page_size)
    for flag, value, minimum in (("--layers", args.layers, 1), ("--reps", args.reps, 0), ("--draws", args.draws, 1)):
        if value < minimum:
            raise ValueError(f"{flag}: expected an integer >= {minimum}, got {value}")
    used = used_counts(args, geometry)
    names = chosen_backends(args.backends)
    device = backends.get(names[0]).device
    gpu = device.type != "cpu"
    if not gpu:
        print("portable-kv bench: no GPU backend here; these are CPU-backend numbers (copies between host buffers) and say nothing about GPUs.")
    if args.section == "both-ways" and not gpu:
        raise ValueError("--section both-ways: needs a GPU backend (it times the two directions of a PCIe link); none can run here")
    previous = backends.current().name
    # Engines transfer on streams of their own; the batched memcpy APIs reject the legacy default stream.
    stream = torch.cuda.stream(torch.cuda.Stream(device)) if gpu else contextlib.nullcontext()
    try:
        with stream:
            rows, ceil = measure(args, geometry, sizes, names, device, used)
    finally:
        backends.use(previous)
    meta = {"backend": names[0], "backends": names, "device": str(device), "gpu": torch.cuda.get_device_name(device) if gpu else "none",
            "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "func"} | used, "ceiling": ceil}
    if args.json:
        report.save_json(args.json, rows, meta)
    report.write(rows, meta, markdown_path=args.markdown, plot_path=args.plot)
    return 0


def used_counts(args: argparse.Namespace, geometry: Geometry) -> dict[str, int]:
    """The layers and repetitions the run uses, which --quick and a --reps of 0 decide in place of the flags' values."""
    if args.quick:
        return {"layers": QUICK_LAYERS, "mla_layers": QUICK_LAYERS, "reps": args.reps or REPS["quick"]}
    return {"layers": args.layers, "mla_layers": geometry.mla_layers, "reps": args.reps or REPS["full"]}


def measure(args: argparse.Namespace, geometry: Geometry, sizes: list[int], names: list[str], device: torch.device,
            used: dict[str, int]) -> tuple[list, dict]:
    """The ceiling, then the section's rows (registry.py names the function that measures it)."""
    gpu = device.type != "cpu"
    clock = Clock(device)
    progress = Progress()
    progress(f"ceiling: {'bulk page-locked memcpy' if gpu else 'host memcpy'} on {device}")
    ceil = sections.ceiling(clock, device, CEILING_BYTES["cpu" if not gpu else "quick" if args.quick else "full"], used["reps"])
    ctx = Context(args, geometry, sizes, names, device, clock, ceil, used["reps"], used["layers"], used["mla_layers"], args.draws, progress)
    section = resolve(SECTIONS[args.section].measure)
    return sections.ceiling_rows(ceil) + section(ctx), ceil


def resolve(name: str) -> Callable:
    """A registered "module:function" of this package."""
    module, function = name.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def both_ways(ctx: Context) -> list:
    """--section both-ways: per page size and backend, each direction timed over its own span."""
    rows = []
    for page_size in ctx.sizes:
        w = Workload(ctx.geometry, page_size, ctx.layers, ctx.device)
        ctx.progress(f"page {page_size}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
        for name in ctx.names:
            backends.use(name)
            ctx.progress(f"  {name} both ways, each direction timed on its own")
            rows += sections.both_ways_probe(w, ctx.ceil, name)
        del w
        torch.cuda.empty_cache()
    return rows


def every_path(ctx: Context) -> list:
    """The default section: per page size the peers, every backend's layouts x io paths and on a GPU
    its sweeps, both ways and interference; then the MLA rows."""
    rows = []
    ctx.progress.expect(len(ctx.sizes) * len(ctx.names) * (2 if ctx.geometry.mla_dim else 1))
    for page_size in ctx.sizes:
        w = Workload(ctx.geometry, page_size, ctx.layers, ctx.device)
        ctx.progress(f"page {page_size}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
        if ctx.gpu and not (ctx.quick and page_size == 1):
            ctx.progress("  peers")
            rows += peers(ctx.clock, w, ctx.reps, ctx.ceil)
        for name in ctx.names:
            rows += package(ctx, w, name, first=name == ctx.names[0])
            ctx.progress.done(f"page {page_size}, {name}")
        del w
        if ctx.gpu:
            torch.cuda.empty_cache()
        if ctx.geometry.mla_dim:
            m = Workload(ctx.geometry, page_size, ctx.mla_layers, ctx.device, pool="MLA")
            ctx.progress(f"page {page_size}, MLA latent of {ctx.geometry.mla_dim}: {m.pages} pages, {m.layer_bytes / 1e6:.0f} MB per per-layer load")
            for name in ctx.names:
                rows += mla_rows(ctx, m, name)
                ctx.progress.done(f"page {page_size}, MLA, {name}")
            del m
            if ctx.gpu:
                torch.cuda.empty_cache()
    return rows


def mla_rows(ctx: Context, w: Workload, name: str) -> list:
    """Each MLA layout x io backend of one backend (--quick: page_first_direct, SGLang's layout for MLA pages in L3)."""
    backend = backends.use(name)
    rows = []
    for layout in ("page_first_direct",) if ctx.quick else MLA_LAYOUTS:
        for io in (io for io in backend.io_backends if io in IO_PATHS):
            ctx.progress(f"  {name} MLA {layout} {io}")
            with w.host_pool(layout, io) as host:
                rows += sections.bench_pool(ctx.clock, w, host, io, ctx.reps, ctx.ceil, "mla", f"{name} {layout} {io}")
    return rows


# The main run's io paths; the others are measured by --section staged.
IO_PATHS = ("kernel", "direct")


def package(ctx: Context, w: Workload, name: str, first: bool) -> list:
    """Every layout x io backend of one backend, and on a GPU the sweeps, both ways and interference."""
    clock, reps, ceil, progress = ctx.clock, ctx.reps, ctx.ceil, ctx.progress
    backend = backends.use(name)
    rows = []
    for layout in LAYOUTS:
        for io in (io for io in backend.io_backends if io in IO_PATHS):
            progress(f"  {name} {layout} {io}")
            with w.host_pool(layout, io) as host:
                rows += sections.bench_pool(clock, w, host, io, reps, ceil, "package", f"{name} {layout} {io}")
    if not clock.gpu:
        return rows
    if w.page_size in (64, 1) and name != "triton":
        progress(f"  {name} block quota and DMA stream sweeps")
        rows += sections.setting_sweeps(clock, w, reps, ceil, name)
        progress(f"  {name} registered host memory")
        rows += sections.registered_memory(clock, w, reps, ceil, name)
    if w.page_size == 64:
        for load_io in IO_PATHS:
            for backup_io in IO_PATHS:
                rows.append(sections.both_directions(clock, w, reps, ceil, name, load_io, backup_io))
        if getattr(backend, "kernel_reads_registered_memory", True):
            rows.append(sections.both_directions(clock, w, reps, ceil, name, "kernel", "kernel", "registered"))
            rows.append(sections.both_directions(clock, w, reps, ceil, name, "kernel", "direct", "registered"))
        if first:
            rows.append(sections.bulk_both(clock, w.pages // 2 * w.page_size * w.token_layer_bytes, reps, ceil))
        if name != "triton":
            progress(f"  {name} interference")
            rows += sections.interference(ctx, w, name)
    return rows
