"""Which measurements a run makes, in which order, on which backends, and what it leaves."""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from .. import backends
from ..layout import LAYOUTS
from ..mla import MLA_LAYOUTS
from . import engine, report, sections, staged
from .measure import Clock
from .peers import peers
from .workload import Geometry, Workload

# Bytes of the ceiling's bulk copy: 2 GiB settles PCIe Gen5 within 1%; 512 MiB is within 2%.
CEILING_BYTES = {"full": 2 << 30, "quick": 512 << 20, "cpu": 64 << 20}
HOST_COST_PAGES = 4  # small transfers: the GPU never backs up the launch queue


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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
    if args.layers < 1 or args.reps < 0:
        raise ValueError(f"--layers: expected >= 1 (got {args.layers}); --reps: expected >= 0 (got {args.reps})")
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
            rows, ceil = measure(args, geometry, sizes, names, device)
    finally:
        backends.use(previous)
    meta = {"backend": names[0], "backends": names, "device": str(device), "gpu": torch.cuda.get_device_name(device) if gpu else "none",
            "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "func"}, "ceiling": ceil}
    if args.json:
        report.save_json(args.json, rows, meta)
    report.write(rows, meta, markdown_path=args.markdown, plot_path=args.plot)
    return 0


def measure(args: argparse.Namespace, geometry: Geometry, sizes: list[int], names: list[str], device: torch.device) -> tuple[list, dict]:
    gpu = device.type != "cpu"
    layers = 8 if args.quick else args.layers
    reps = args.reps or (5 if args.quick else 20)
    clock = Clock(device)
    progress(f"ceiling: {'bulk page-locked memcpy' if gpu else 'host memcpy'} on {device}")
    ceil = sections.ceiling(clock, device, CEILING_BYTES["cpu" if not gpu else "quick" if args.quick else "full"], reps)
    rows = sections.ceiling_rows(ceil)
    if args.section == "host-cost":
        return rows + host_cost(clock, geometry, layers, names, device), ceil
    if args.section == "staged":
        return rows + staged.measure(clock, geometry, sizes, names, layers, reps, ceil, device, progress, mla_layers(args, geometry)), ceil
    if args.section == "engine":
        return rows + engine.measure(clock, sizes, names, reps, args.quick, ceil, device, progress), ceil
    for page_size in sizes:
        w = Workload(geometry, page_size, layers, device)
        progress(f"page {page_size}: {w.pages} pages, {w.layer_bytes / 1e6:.0f} MB per per-layer load")
        if args.section == "both-ways":
            for name in names:
                backends.use(name)
                progress(f"  {name} both ways, each direction timed on its own")
                rows += sections.both_ways_probe(w, ceil, name)
            continue
        if gpu and not (args.quick and page_size == 1):
            progress("  peers")
            rows += peers(clock, w, reps, ceil)
        for name in names:
            rows += package(args, clock, w, reps, ceil, name, first=name == names[0])
        del w
        if gpu:
            torch.cuda.empty_cache()
        if geometry.mla_dim:
            m = Workload(geometry, page_size, mla_layers(args, geometry), device, pool="MLA")
            progress(f"page {page_size}, MLA latent of {geometry.mla_dim}: {m.pages} pages, {m.layer_bytes / 1e6:.0f} MB per per-layer load")
            for name in names:
                rows += mla_rows(args, clock, m, reps, ceil, name)
            del m
            if gpu:
                torch.cuda.empty_cache()
    return rows, ceil


def mla_layers(args: argparse.Namespace, geometry: Geometry) -> int:
    return 8 if args.quick else geometry.mla_layers


def mla_rows(args: argparse.Namespace, clock: Clock, w: Workload, reps: int, ceil: dict, name: str) -> list:
    """Each MLA layout x io backend of one backend (--quick: page_first_direct, SGLang's layout for MLA pages in L3)."""
    backend = backends.use(name)
    rows = []
    for layout in ("page_first_direct",) if args.quick else MLA_LAYOUTS:
        for io in (io for io in backend.io_backends if io in IO_PATHS):
            progress(f"  {name} MLA {layout} {io}")
            with w.host_pool(layout, io) as host:
                rows += sections.bench_pool(clock, w, host, io, reps, ceil, "mla", f"{name} {layout} {io}")
    return rows


# The main run's io paths; staged and auto are measured by --section staged.
IO_PATHS = ("kernel", "direct")


def package(args: argparse.Namespace, clock: Clock, w: Workload, reps: int, ceil: dict, name: str, first: bool) -> list:
    """Every layout x io backend of one backend, and on a GPU the sweeps, both ways and interference."""
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
        # staged and auto have their own section (--section staged), both ways included.
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
            rows += sections.interference(clock, w, name)
    return rows


def host_cost(clock: Clock, geometry: Geometry, layers: int, names: list[str], device: torch.device) -> list:
    small = Geometry(geometry.heads, geometry.k_dim, geometry.v_dim, geometry.dtype, geometry.pages or HOST_COST_PAGES)
    w = Workload(small, 64, layers, device)
    rows = []
    for name in names:
        backends.use(name)
        progress(f"  {name} host cost of a per-layer load ({w.pages} pages of 64 tokens)")
        rows += sections.host_cost(clock, w, name)
    return rows
