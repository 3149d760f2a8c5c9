"""The measurements a run is made of: the ceiling, one pool's load and backup, the
setting sweeps, both ways at once and interference with compute.

Each returns rows; `run.py` chooses which run, in which order.  GPU streams and
events come from torch's cuda namespace, which serves ROCm builds too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import portable_kv as pk

from .. import backends
from .beside import MatmulLoop
from .context import Context
from .draws import alternate, summarize
from .measure import Clock, gbps
from .rows import Row
from .workload import Workload

QUOTAS = (2, 4, 8, 16, 24, 32, 64, 132)
DMA_STREAMS = (1, 2, 4)


def ceiling(clock: Clock, device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one bulk page-locked memcpy each way, and both ways at once; on the CPU
    backend, of one host memcpy (there is no link, hence no direction)."""
    if not clock.gpu:
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        return {"memcpy": gbps(nbytes, clock.time(lambda: dst.copy_(src), reps)[0])}
    host, host2 = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev, dev2 = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    result = {"h2d": gbps(nbytes, clock.time(lambda: dev.copy_(host, non_blocking=True), reps)[0]),
              "d2h": gbps(nbytes, clock.time(lambda: host.copy_(dev, non_blocking=True), reps)[0]),
              "both": both_ways(clock, (dev, host), (host2, dev2), reps)}
    # The same bytes as 4 copies on 4 streams: one copy engine per stream, where
    # a single memcpy may use one; reported beside the ceiling, not instead of it.
    streams = [torch.cuda.Stream() for _ in range(4)]
    quarter = nbytes // 4
    for direction, (dst, src) in (("h2d_4streams", (dev, host)), ("d2h_4streams", (host, dev))):
        def split(dst=dst, src=src) -> None:
            for i, s in enumerate(streams):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    dst[i * quarter : (i + 1) * quarter].copy_(src[i * quarter : (i + 1) * quarter], non_blocking=True)
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)

        result[direction] = gbps(nbytes, clock.time(split, reps)[0])
    return result


def ceiling_rows(ceil: dict[str, float]) -> list[Row]:
    if "memcpy" in ceil:
        return [Row("ceiling", "host memcpy", "-", 0, ceil["memcpy"])]
    return [Row("ceiling", "bulk pinned memcpy" + (", 4 streams" if "4streams" in key else ""), key.split("_")[0], 0, value,
                100.0 * value / ceil[key.split("_")[0]]) for key, value in ceil.items()]


def percent(rate: float, ceil: dict, direction: str) -> float:
    return 100 * rate / ceil[direction] if direction in ceil else 0.0


def bench_pool(clock: Clock, w: Workload, host: pk.AsymmetricHostPool, io: str, reps: int, ceil: dict, section: str, name: str) -> list[Row]:
    """One per-layer load (layers in turn) and one all-layer backup of the workload's pages."""
    layer = [0]

    def load() -> None:
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer[0] % w.layers, io_backend=io)
        layer[0] += 1

    quota = getattr(backends.current(), "block_quota", 0) if io == "kernel" and clock.gpu else 0
    seconds, host_s = clock.time(load, reps)
    rate = gbps(w.layer_bytes, seconds)
    rows = [Row(section, name, "h2d", w.page_size, rate, percent(rate, ceil, "h2d"), host_s * 1e6, quota, with_clock(clock))]
    all_bytes = w.layer_bytes * w.layers
    seconds, host_s = clock.time(lambda: host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx, io_backend=io), max(3, reps // 4), warmup=1)
    rate = gbps(all_bytes, seconds)
    rows.append(Row(section, name, "d2h", w.page_size, rate, percent(rate, ceil, "d2h"), host_s * 1e6, quota, with_clock(clock)))
    return rows


def with_clock(clock: Clock) -> dict:
    """A row's extras: the SM clock while its calls ran, where it can be read."""
    return {} if clock.sm_mhz is None else {"sm_mhz": clock.sm_mhz}


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


def setting_sweeps(clock: Clock, w: Workload, reps: int, ceil: dict, name: str) -> list[Row]:
    """The block quota of the kernel path, and the DMA stream count of the direct path where the
    backend lets it be set between calls (`backend.dma_streams`)."""
    rows = sweep(clock, w, reps, ceil, "kernel", "block_quota", QUOTAS, f"{name} kernel, {{}} blocks")
    if hasattr(backends.current(), "dma_streams"):
        rows += sweep(clock, w, reps, ceil, "direct", "dma_streams", DMA_STREAMS, f"{name} direct, {{}} streams")
    return rows


def registered_memory(clock: Clock, w: Workload, reps: int, ceil: dict, name: str) -> list[Row]:
    """Registered (mmap, 2 MiB pages) against page-locked host memory: does the page size of
    the host buffer change what scattered reads over PCIe cost?"""
    backend = backends.current()
    rows = []
    for io in backend.io_backends:
        if io == "kernel" and not getattr(backend, "kernel_reads_registered_memory", True):
            continue
        with w.host_pool("page_first_direct", io, "registered") as host:
            rows += bench_pool(clock, w, host, io, reps, ceil, "host_memory", f"{name} page_first_direct {io}, registered")
    return rows


def both_ways(clock: Clock, load: tuple[torch.Tensor, torch.Tensor], backup: tuple[torch.Tensor, torch.Tensor], reps: int) -> float:
    """GB/s of two bulk copies (dst, src) at once, opposite ways on two streams."""
    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        load[0].copy_(load[1], non_blocking=True)
        with torch.cuda.stream(side):
            backup[0].copy_(backup[1], non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    return gbps(load[0].numel() + backup[0].numel(), clock.time(both, reps)[0])


def both_directions(clock: Clock, w: Workload, reps: int, ceil: dict, name: str, load_io: str, backup_io: str,
                    host_memory: str = "pinned") -> Row:
    """A load and a backup at once, on two streams, as an engine overlaps prefetch and write-back: the total."""
    load_idx, backup_idx = w.halves()
    side = torch.cuda.Stream()
    with w.host_pool("page_first_direct", load_io, host_memory) as load_pool, w.host_pool("page_first_direct", backup_io, host_memory) as backup_pool:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            load_pool.load_to_device_per_layer(w.dev, *load_idx, 0)
            with torch.cuda.stream(side):
                backup_pool.backup_from_device_per_layer(w.dev, *backup_idx, 1)
            torch.cuda.current_stream().wait_stream(side)

        seconds, host_s = clock.time(run, reps)
    rate = gbps(2 * load_idx[0].numel() * w.token_layer_bytes, seconds)
    label = f"{name} load {load_io} + backup {backup_io} at once" + (f", {host_memory}" if host_memory != "pinned" else "")
    return Row("both", label, "both", w.page_size, rate, percent(rate, ceil, "both"), host_s * 1e6)


def bulk_both(clock: Clock, nbytes: int, reps: int, ceil: dict) -> Row:
    """Two bulk memcpys of `nbytes` each, opposite ways on two streams: is the transfer size the limit?"""
    host, host2 = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev, dev2 = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    rate = both_ways(clock, (dev, host), (host2, dev2), reps)
    return Row("both", f"bulk pinned memcpy both ways, {nbytes / 1e6:.0f} MB each", "both", 0, rate, percent(rate, ceil, "both"))


def interference(ctx: Context, w: Workload, name: str) -> list[Row]:
    """A bf16 matmul loop on one stream while per-layer loads run on another, loads all queued
    first or interleaved, kernel io (at normal and high stream priority) and direct io; every
    row drawn `ctx.draws` times, the rows in turn (draws.py)."""
    loop = MatmulLoop(w.dev.device)
    alone, _ = ctx.clock.time(loop.run, 5)
    rows = [Row("interference", "bf16 matmul alone", "-", 0, extra={"tflops": loop.tflops(alone)})]
    cases = {}
    hosts = {io: w.host_pool("page_first_direct", io) for io in ("kernel", "direct")}
    try:
        for io, priority, loads_first in [(io, p, first) for io, p in (("kernel", 0), ("kernel", -1), ("direct", 0)) for first in (True, False)]:
            # Priority -1: engines put their load streams above compute, so that the
            # copy kernel's blocks are scheduled as soon as the matmul's retire.
            order = "loads first" if loads_first else "interleaved"
            label = f"{name} {io} load during matmul, {order}" + (", high-priority stream" if priority else "")
            cases[label] = (hosts[io], torch.cuda.Stream(priority=priority), loads_first)

        def draw(label: str) -> dict[str, float]:
            host, side, loads_first = cases[label]
            return loop.draw(ctx.clock, lambda i: host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, i % w.layers),
                             w.layer_bytes, side, loads_first)

        drawn = alternate(list(cases), draw, ctx.draws, ctx.progress, f"{name} interference")
    finally:
        for host in hosts.values():
            host.close()
    for label, draws in drawn.items():
        extra = summarize(draws)
        rows.append(Row("interference", label, "h2d", w.page_size, extra["gbps"], host_us=extra["host_us"], extra=extra))
    return rows


def timed_pair(h2d: Callable[[], None] | None, d2h: Callable[[], None] | None, reps: int = 7) -> tuple[float, float, float]:
    """Median seconds of each direction over its own span (own stream, own events), and of the common span."""
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    spans = []
    for rep in range(reps + 2):  # the first two warm up
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        start.record()
        for stream, op, end in zip(streams, (h2d, d2h), ends):
            stream.wait_event(start)
            if op is not None:
                with torch.cuda.stream(stream):
                    op()
            end.record(stream)
        torch.cuda.synchronize()
        if rep >= 2:
            spans.append([start.elapsed_time(e) / 1e3 for e in ends])
    return (statistics.median(s[0] for s in spans), statistics.median(s[1] for s in spans), statistics.median(max(s) for s in spans))


def both_ways_probe(w: Workload, ceil: dict, name: str) -> list[Row]:
    """Why a load and a backup at once stop short of bulk memcpy both ways: each direction timed
    over its own span while the other runs, for bulk copies, the package's paths and block quotas."""
    load_idx, backup_idx = w.halves()
    nbytes = load_idx[0].numel() * w.token_layer_bytes
    host_a, host_b = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_a, dev_b = (torch.empty(nbytes, dtype=torch.uint8, device=w.dev.device) for _ in range(2))
    backend = backends.current()
    saved_quota = backend.block_quota
    rows = []

    def case(label: str, h2d: Callable[[], None] | None, d2h: Callable[[], None] | None) -> None:
        up, down, span = timed_pair(h2d, d2h)
        total = gbps(nbytes * ((h2d is not None) + (d2h is not None)), span)
        rows.append(Row("both_ways", label, "both" if h2d and d2h else ("h2d" if h2d else "d2h"), w.page_size, total,
                        percent(total, ceil, "both" if h2d and d2h else ("h2d" if h2d else "d2h")),
                        extra={"h2d_gbps": gbps(nbytes, up) if h2d else 0.0, "d2h_gbps": gbps(nbytes, down) if d2h else 0.0}))

    def at(quota: int, call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            backend.block_quota = quota
            call()
        return run

    bulk_h2d = lambda: dev_a.copy_(host_a, non_blocking=True)  # noqa: E731
    bulk_d2h = lambda: host_b.copy_(dev_b, non_blocking=True)  # noqa: E731
    case("bulk h2d alone", bulk_h2d, None)
    case("bulk d2h alone", None, bulk_d2h)
    case("bulk both", bulk_h2d, bulk_d2h)
    try:
        for load_io in backend.io_backends:
            for backup_io in backend.io_backends:
                with w.host_pool("page_first_direct", load_io) as load_pool, w.host_pool("page_first_direct", backup_io) as backup_pool:
                    def load(p=load_pool) -> None:
                        p.load_to_device_per_layer(w.dev, *load_idx, 0)

                    def backup(p=backup_pool) -> None:
                        p.backup_from_device_per_layer(w.dev, *backup_idx, 1)

                    if backup_io == backend.io_backends[0]:
                        case(f"{name} {load_io} load alone", at(saved_quota, load), None)
                    if load_io == backend.io_backends[0]:
                        case(f"{name} {backup_io} backup alone", None, at(saved_quota, backup))
                    case(f"{name} {load_io} load + {backup_io} backup", at(saved_quota, load), at(saved_quota, backup))
                    if load_io == backup_io == "kernel":
                        # Posted D2H writes share the upstream link with the loads' read
                        # requests: does starving the backup of blocks leave the loads room?
                        for load_quota, backup_quota in ((saved_quota, 4), (saved_quota, 8), (2 * saved_quota, 4), (4 * saved_quota, 8)):
                            case(f"{name} kernel load {load_quota} blocks + kernel backup {backup_quota} blocks",
                                 at(load_quota, load), at(backup_quota, backup))
                        case(f"{name} kernel load + bulk d2h", at(saved_quota, load), bulk_d2h)
                        case(f"{name} bulk h2d + kernel backup", bulk_h2d, at(saved_quota, backup))
    finally:
        backend.block_quota = saved_quota
    return rows
