"""`portable-kv bench --section decode`: what the host tier costs an engine's decode.

A memory-bound decode step (decode_step.py: Llama-3-8B's shape, bf16, L layers of qkv, GQA
attention over every request's context and MLP, one CUDA graph) runs on the compute stream
while the same thread, before each step, issues the host tier's transfers of OTHER pages:
per-layer loads and all-layer backups in turn, about 100 MB a call (--pages), each direction
on a side stream of its own (SGLang's controller keeps a load stream and a write stream), random
pages (the first --page-size) of a layer_first host pool of 8 KV heads of 128 (--dtype), as many
calls a step, on average, as offer OFFERED_GBPS at the step alone's pace.  The host runs one step
ahead of the GPU (it waits for step i-2 before issuing step i), as an engine's overlapped
scheduler does, so a path's host time shows where it outlasts a step.

Rows: per case (batch, context), backend and path (each io path of the backend, `auto` with
background=True; with the first backend torch's copy_ per page and SGLang's JIT kernel, or why
it cannot run), the step's p50 and p99 against the step alone's, and the GB/s the host tier
moved during the steps, drawn `--draws` times with the step alone in turn (draws.py).  A step's
time runs from the previous step's end to its own (events on the compute stream), so host time
that leaves the GPU idle counts; GB/s: the bytes of the transfers done by the last step's end
over their span (events on the side streams).  --layers caps the model's 32 (--quick: 8).
On the CPU backend everything runs in turn on the caller's thread and says nothing about a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from .. import backends
from .context import Context
from .decode_step import AHEAD, CPU_CASES, CPU_MODEL, CPU_QUICK, GPU_CASES, GPU_MODEL, DecodeStep, run_steps
from .draws import alternate, spread_text, summarize
from .io_paths import AutoWatch, io_paths
from .measure import one_thread_on_cpu
from .rows import Row, ceiling_text, device_label
from .sections import percent
from .sglang_jit import kernels
from .workload import Geometry, Workload

SECTION = "decode"
# Offered to the host tier: 1 GB a 14.5 ms step at batch 64 / 4K on the H200, 70% of its both-ways
# ceiling (99 GB/s), so that a path that moves pages at the link's rate keeps up.
OFFERED_GBPS = 70.0
STEPS = {"full": 100, "quick": 40, "cpu": 6}  # steps a draw: p99 of 100 is the second slowest
ALONE = "step alone"
TORCH_PEER = "peer: torch copy_ per page"
SGLANG_PEER = "peer: SGLang JIT kernel"
# SGLang's default host layout, the one its JIT kernel reads; a layer's page is one run in it.
HOST_LAYOUT = "layer_first"
# Where a path's indices live: on the device for the kernel paths, as SGLang's controller passes
# them for its kernel io (engine_schedule.py); host-resident for the paths that plan on the host.
ON_DEVICE = ("kernel", "bulk")


def measure(ctx: Context) -> list[Row]:
    """Per case the decode step, then per backend its host tier and the paths' draws."""
    with one_thread_on_cpu(ctx.gpu):
        return _measure(ctx)


def _measure(ctx: Context) -> list[Row]:
    model = GPU_MODEL if ctx.gpu else CPU_MODEL
    cases = GPU_CASES if ctx.gpu else (CPU_QUICK if ctx.quick else CPU_CASES)
    layers = min(ctx.layers, model.layers)
    geometry = replace(ctx.geometry, heads=8, k_dim=128, v_dim=128, mla_dim=0)
    rows: list[Row] = []
    for batch, context in cases:
        ctx.progress(f"decode: {model.name}, {layers} layers, batch {batch} x {context} tokens")
        step = DecodeStep(model, batch, context, layers, ctx.device)
        for name in ctx.names:
            backends.use(name)  # the host pool is bound to the backend current when it is made
            tier = HostTier(geometry, ctx.sizes[0], layers, ctx.device)
            try:
                rows += case_rows(ctx, step, tier, name, first=name == ctx.names[0])
            finally:
                tier.close()
        del step
        if ctx.gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


class HostTier:
    """The host tier beside the decode: a host pool over a device pool of its own (workload.py:
    random pages, ~100 MB a per-layer load); per path, `issue(n)` issues call n, a per-layer
    load of those pages (layers in turn) where n is even, else an all-layer backup of about as
    many bytes from other pages, on both sides."""

    def __init__(self, geometry: Geometry, page_size: int, layers: int, device: torch.device) -> None:
        self.w = w = Workload(geometry, page_size, layers, device)
        self.page_size, self.layers, self.device, self.gpu = page_size, layers, device, device.type != "cpu"
        self.host = w.host_pool(HOST_LAYOUT, "kernel")
        gen = torch.Generator().manual_seed(5)
        pages = max(1, min(round(w.pages / layers), w.host_pages - w.pages))
        self.load = (w.host_idx, w.dev_idx)
        self.backup = (self._other_pages(w.host_idx, pages, gen), self._other_pages(w.dev_idx, pages, gen))
        self.bytes = (w.layer_bytes, pages * page_size * w.token_layer_bytes * layers)
        for layer in range(layers):  # random bits on the device, then the host's copy: quicker than random bits on the host
            for dev_buf, host_buf in self.buffers(layer):
                dev_buf.view(torch.uint8).random_()
                host_buf[: dev_buf.shape[0]].copy_(dev_buf)

    def _other_pages(self, slots: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
        """Slots of `count` random pages that `slots` does not touch."""
        p = self.page_size
        free = torch.ones(self.w.host_pages, dtype=torch.bool)
        free[slots[::p] // p] = False
        pages = free.nonzero().flatten()
        pages = pages[torch.randperm(pages.numel(), generator=gen)[:count]]
        return (pages[:, None] * p + torch.arange(p)).reshape(-1)

    def buffers(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) buffers of one layer, K then V."""
        dev, host = self.w.dev, self.host
        return [(dev.k_buffer[layer], host.k_buffer[layer]), (dev.v_buffer[layer], host.v_buffer[layer])]

    def call_bytes(self, n: int) -> int:
        return self.bytes[n % 2]

    def counted(self, io: str) -> int:
        """Bytes the pool's own counters say its calls through `io` moved, both directions."""
        stats = self.host.stats()
        return sum(stats.get(direction, {}).get(io, {}).get("bytes", 0) for direction in ("load", "backup"))

    def package(self, io: str) -> Callable[[int], None]:
        on = self.device if io in ON_DEVICE else torch.device("cpu")
        (load_host, load_dev), (backup_host, backup_dev) = ((h.to(on), d.to(on)) for h, d in (self.load, self.backup))
        # auto off the caller's critical path prefers the copy engines, which leave the SMs to the step.
        background = {"background": True} if io == "auto" else {}
        host, dev, layers = self.host, self.w.dev, self.layers

        def issue(n: int) -> None:
            if n % 2:
                host.backup_from_device_all_layer(dev, backup_host, backup_dev, io_backend=io, **background)
            else:
                host.load_to_device_per_layer(dev, load_host, load_dev, n // 2 % layers, io_backend=io, **background)

        return issue

    def torch_copies(self) -> Callable[[int], None]:
        """A `.copy_` per page and buffer, non_blocking, as engines' per-page swap loops do."""
        p = self.page_size
        load, backup = (list(zip((hi[::p] // p).tolist(), (di[::p] // p).tolist())) for hi, di in (self.load, self.backup))

        def issue(n: int) -> None:
            for layer in range(self.layers) if n % 2 else (n // 2 % self.layers,):
                for dev_buf, host_buf in self.buffers(layer):
                    for h, d in backup if n % 2 else load:
                        if n % 2:
                            host_buf[h * p: (h + 1) * p].copy_(dev_buf[d * p: (d + 1) * p], non_blocking=True)
                        else:
                            dev_buf[d * p: (d + 1) * p].copy_(host_buf[h * p: (h + 1) * p], non_blocking=True)

        return issue

    def sglang(self) -> tuple[dict[str, Callable[[int], None]], dict[str, dict], str]:
        """SGLang's JIT kernel as SGLang's host pool calls it (TMA where its rows fit), indices on
        the device; its backups its one-layer kernel, a call a layer.  Or why it cannot run here."""
        found, reason = kernels([self.w.dev.k_buffer[0], self.w.dev.v_buffer[0]], self.page_size)
        if found is None:
            return {}, {}, reason
        move = found.load("default")
        (load_host, load_dev), (backup_host, backup_dev) = ((h.to(self.device), d.to(self.device)) for h, d in (self.load, self.backup))

        def issue(n: int) -> None:
            for layer in range(self.layers) if n % 2 else (n // 2 % self.layers,):
                dev, host = zip(*self.buffers(layer))
                if n % 2:
                    move(list(host), list(dev), backup_host, backup_dev)
                else:
                    move(list(dev), list(host), load_dev, load_host)

        return {SGLANG_PEER: issue}, {SGLANG_PEER: {"sglang": found.version, "kernel": found.took("default")}}, ""

    def verify(self, issue: Callable[[int], None]) -> bool:
        """Every layer's load and a backup through `issue` land the source's bits (destinations zeroed first)."""
        (load_host, load_dev), (backup_host, backup_dev) = self.load, self.backup
        on = load_dev.to(self.w.dev.device), backup_dev.to(self.w.dev.device)
        if self.gpu:
            torch.cuda.synchronize()
        for layer in range(self.layers):
            for dev_buf, host_buf in self.buffers(layer):
                dev_buf.index_fill_(0, on[0], 0)
                host_buf.index_fill_(0, backup_host, 0)
        for n in range(2 * self.layers):
            issue(n)
        if self.gpu:
            torch.cuda.synchronize()

        def same(a: torch.Tensor, b: torch.Tensor) -> bool:
            return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))

        return all(same(dev_buf[on[0]], host_buf[load_host]) and same(host_buf[backup_host], dev_buf[on[1]])
                   for layer in range(self.layers) for dev_buf, host_buf in self.buffers(layer))

    def close(self) -> None:
        self.host.close()


def case_rows(ctx: Context, step: DecodeStep, tier: HostTier, name: str, first: bool) -> list[Row]:
    """One case's rows for one backend: the step alone, and each path's transfers beside it."""
    gpu = ctx.gpu
    steps = STEPS["cpu" if not gpu else "quick" if ctx.quick else "full"]
    paths = io_paths(backends.get(name))
    issuers = {f"{name} {io}": tier.package(io) for io in paths}
    about: dict[str, dict] = {}
    absent = ""
    if first:
        issuers[TORCH_PEER] = tier.torch_copies()
        sglang, about, absent = tier.sglang()
        issuers |= sglang
    for label, issue in issuers.items():  # every path once before anything is timed: JIT compiles, plans, bytes checked
        about.setdefault(label, {})["verified"] = tier.verify(issue)
    alone = run_steps(step, steps, gpu)
    mean_call = (tier.call_bytes(0) + tier.call_bytes(1)) / 2
    # On the CPU backend a call is a copy on the caller's thread: a load and a backup a step.
    calls = OFFERED_GBPS * 1e9 * alone["p50_ms"] / 1e3 / mean_call if gpu else 2.0
    streams = (torch.cuda.Stream(ctx.device), torch.cuda.Stream(ctx.device)) if gpu else ()
    latest: dict[str, float] = {}
    watch = AutoWatch(tier.host) if "auto" in paths else None

    def draw(label: str) -> dict[str, float]:
        if label == ALONE:
            latest.update(run_steps(step, steps, gpu))
            return dict(latest)
        io = label.removeprefix(f"{name} ") if label.startswith(f"{name} ") else ""
        before = tier.counted(io) if io else 0
        out = run_steps(step, steps, gpu, issuers[label], calls, tier.call_bytes, streams)
        if io:
            out["counted_bytes"] = float(tier.counted(io) - before)
        return {**out, "p50_x": out["p50_ms"] / latest["p50_ms"], "p99_x": out["p99_ms"] / latest["p99_ms"]}

    what = f"decode batch {step.batch} x {step.context}, {name}"
    drawn = alternate([ALONE, *issuers], draw, ctx.draws, ctx.progress, what)
    base = {"backend": name, "batch": step.batch, "context": step.context, "layers": step.layers, "page_size": tier.page_size}
    summary = summarize(drawn.pop(ALONE))
    offered = calls * mean_call / (summary["p50_ms"] / 1e3) / 1e9
    rows = [Row(SECTION, ALONE, "-", tier.page_size, extra={
        **base, **summary, "model": step.model.name, "step_gb": step.bytes_read / 1e9,
        "hbm_gbps": step.bytes_read / (summary["p50_ms"] / 1e3) / 1e9, "calls_per_step": calls, "offered_gbps": offered,
        "load_bytes": tier.call_bytes(0), "backup_bytes": tier.call_bytes(1), "steps_per_draw": steps, "ahead": AHEAD})]
    for label, draws in drawn.items():
        extra = {**base, **summarize(draws), **about.get(label, {})}
        if label == f"{name} auto" and watch is not None:
            extra["auto_took"] = watch.took()
        rate = extra["gbps"]
        rows.append(Row(SECTION, label, "both", tier.page_size, rate, percent(rate, ctx.ceil, "both"), extra["host_ms"] * 1e3, extra=extra))
        ctx.progress(f"  {label}: step {extra['p50_x']:.3f}x p50, {extra['p99_x']:.3f}x p99, {rate:.1f} GB/s of {offered:.1f} offered")
    if first and absent:
        rows.append(Row(SECTION, SGLANG_PEER, "-", tier.page_size, extra={**base, "absent": absent}))
    return rows


COLUMNS = f"  {'path':<34} {'step p50 x alone':>26} {'step p99 x alone':>26} {'host tier GB/s':>22} {'done in steps':>14} {'host ms/step':>13}"
LEGEND = ["A case: the decode step alone, then with the host tier's transfers beside it. x alone: the step's p50 (p99) against the",
          "step alone's p50 (p99) of the same round of draws; host tier GB/s: the bytes the transfers moved by the last step's end",
          "over their span; done in steps: that share of the offered bytes; host ms/step: the caller's time issuing a step's",
          "transfers. Drawn several times, the paths in turn: the median, (in brackets) the least and the most of the draws."]


def cases(rows: list[Row]) -> list[tuple[Row, list[Row]]]:
    """Each case's step-alone row and its paths' rows, in the run's order."""
    found: list[tuple[Row, list[Row]]] = []
    for r in rows:
        if r.section != SECTION:
            continue
        if r.name == ALONE:
            found.append((r, []))
        elif found:
            found[-1][1].append(r)
    return found


def case_line(alone: Row) -> str:
    e = alone.extra
    return (f"batch {e['batch']} x {e['context']} tokens, {e['layers']} layers, {e['backend']}: step alone {e['p50_ms']:.2f} ms p50, "
            f"{e['p99_ms']:.2f} p99 ({e['step_gb']:.3g} GB a step, {e['hbm_gbps']:.0f} GB/s); host tier offered {e['offered_gbps']:.1f} GB/s: "
            f"{e['calls_per_step']:.1f} calls a step of {e['load_bytes'] / 1e6:.0f} MB (a layer's load) and {e['backup_bytes'] / 1e6:.0f} MB "
            f"(an all-layer backup) in turn, page {alone.page_size}")


def table(rows: list[Row], meta: dict) -> str:
    lines = [f"{device_label(meta)}; {ceiling_text(meta)}."]
    for alone, paths in cases(rows):
        lines += ["", case_line(alone), COLUMNS]
        for r in paths:
            e = r.extra
            if "absent" in e:
                lines.append(f"  {r.name:<34} not measured: {e['absent']}")
                continue
            lines.append(f"  {r.name:<34} {spread_text(e, 'p50_x', '.3f'):>26} {spread_text(e, 'p99_x', '.3f'):>26} "
                         f"{spread_text(e, 'gbps', '.1f'):>22} {e['kept_pct']:>13.0f}% {e['host_ms']:>13.3f}"
                         + ("" if e.get("verified", True) else "  NOT VERIFIED"))
        lines += [f"  {note}" for note in notes(paths)]
    return "\n".join(lines + ["", *LEGEND])


def notes(paths: list[Row]) -> list[str]:
    """Which paths auto took, and which kernel SGLang's row ran."""
    return ([f"{r.name} took {r.extra['auto_took']}" for r in paths if "auto_took" in r.extra]
            + [f"{r.name}: SGLang {r.extra['sglang']}, {r.extra['kernel']}; its backups: that kernel a layer at a time" for r in paths if "kernel" in r.extra])


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [f"{device_label(meta)}; {ceiling_text(meta)}."]
    for alone, paths in cases(rows):
        lines += ["", case_line(alone) + ".", "", "| path | step p50 x alone | step p99 x alone | host tier GB/s | done in steps | host ms/step |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.name} | not measured: {r.extra['absent']} | | | | |" if "absent" in r.extra else
                  f"| {r.name} | {spread_text(r.extra, 'p50_x', '.3f')} | {spread_text(r.extra, 'p99_x', '.3f')} | "
                  f"{spread_text(r.extra, 'gbps', '.1f')} | {r.extra['kept_pct']:.0f}% | {r.extra['host_ms']:.3f} |" for r in paths]
        lines += ["", *notes(paths)] if notes(paths) else []
    return "\n".join(lines + ["", " ".join(LEGEND)]) + "\n"
