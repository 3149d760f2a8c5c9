"""`portable-kv bench --section engine`: a cache-hit prefill of MiMo-V2-Flash as SGLang runs it.

A request whose prefix is in the host tier: every layer's K/V of the prefix is loaded
(host to GPU) while the forward pass computes the new tokens, layer i waiting for
layer i's load only (engine_schedule.py), on MiMo-V2-Flash's hybrid pools with the
forward's matmuls (engine_geometry.py, engine_forward.py).

Per cached prefix and new-token count, per backend and io path (every path the backend
offers, and SGLang's own JIT kernels where SGLang is installed on an NVIDIA GPU): the
loads alone, then the prefill (loads and forward together) and the forward alone, drawn
`--draws` times with the paths in turn (draws.py); the load time left exposed (prefill
minus forward alone), the loads' effective bandwidth, recomputing the whole prefix and
the new tokens instead (the prefill without a cache, in SGLang's chunks of the recipe's
--chunked-prefill-size), and the bound (engine_report.py):
    max(forward alone + the first layer's load, every load at the ceiling + the last layer's compute),
the loads at the ceiling (bulk page-locked memcpy) that the same run measured.

On the CPU backend the section runs a scaled geometry so that CI exercises the code;
there are no streams, loads and compute run one after the other, and the numbers say
nothing about a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from .. import backends
from .context import Context
from .draws import alternate, summarize
from .engine_forward import Forward
from .engine_geometry import CPU_CASES, CPU_MODEL, CPU_QUICK, GPU_CASES, MIMO_V2_FLASH, flops_summary, recompute_chunks
from .engine_report import SECTION, bound, break_even_rows, ceiling_rate
from .engine_schedule import HOST_LAYOUT, Engine, HostSide, Pools
from .io_paths import io_paths
from .measure import gbps, one_thread_on_cpu
from .rows import Row
from .sections import percent
from .sglang_jit import kernels

FORWARD = "forward alone"  # the forward's own draws, in turn with the paths'
# SGLang's kernels as paths of the section: its default (TMA where the rows fit), its register kernel at 2 blocks
SGLANG_PATHS = {"default": "SGLang JIT", "register": "SGLang JIT reg 2"}


def measure(ctx: Context) -> list[Row]:
    """The section: per (prefix, new) row, the forward alone and recomputing once, then per
    backend and path the loads alone and the prefill; the break-even prefix per path."""
    with one_thread_on_cpu(ctx.gpu):
        return _measure(ctx)


def _measure(ctx: Context) -> list[Row]:
    clock, reps, gpu = ctx.clock, ctx.reps, ctx.gpu
    model = MIMO_V2_FLASH if gpu else CPU_MODEL
    cases = GPU_CASES if gpu else (CPU_QUICK if ctx.quick else CPU_CASES)
    page_size = ctx.sizes[0]
    rate = ceiling_rate(ctx.ceil)
    ctx.progress(f"engine: {model.name}, page {page_size}, {len(cases)} cases")
    forward = Forward(model, ctx.device)
    rows = [Row(SECTION, "geometry", "-", page_size, extra={**{k: v for k, v in asdict(model).items() if k != "sources"},
                                                            "sources": list(model.sources), "full_layers": list(model.full_layers),
                                                            "host_layout": HOST_LAYOUT, "page_size": page_size,
                                                            "cases": [list(c) for c in cases], "draws": ctx.draws})]
    absent = ""
    for prefix, new in cases:
        pools = Pools(model, page_size, prefix, new, ctx.device)
        full_bytes, swa_bytes = pools.bytes()
        total = full_bytes + swa_bytes
        ctx.progress(f"prefix {prefix} + {new} new: {total / 1e6:.1f} MB a prefill ({full_bytes / 1e6:.1f} full, {swa_bytes / 1e6:.2f} SWA)")
        layers = forward.layers(pools.kv, prefix, new)
        last_s, _ = clock.time(layers[-1], reps)
        chunks = [forward.layers(pools.kv, p, n) for p, n in recompute_chunks(model, prefix + new)]
        ctx.progress(f"  recompute of {prefix + new} tokens in {len(chunks)} chunk(s)")
        recompute_s, _ = clock.time(lambda chunks=chunks: [layer() for layers in chunks for layer in layers], max(3, reps // 4), warmup=1)
        first_bytes = pools.dev_idx[model.is_full(0)].numel() * model.token_layer_bytes(model.is_full(0))
        common = {"prefix": prefix, "new": new, "bytes_loaded": total, "full_bytes": full_bytes, "swa_bytes": swa_bytes,
                  "last_layer_ms": last_s * 1e3, "recompute_ms": recompute_s * 1e3, "device_pool_mb": pools.device_bytes() / 1e6,
                  **flops_summary(model, prefix, new)}
        for name in ctx.names:
            backends.use(name)  # the host pools are bound to the backend current when they are made
            side = HostSide(pools)
            try:
                engines, about, reason = paths(ctx, pools, side, forward, name)
                absent = absent or reason
                rows += case_rows(ctx, pools, side, engines, about, layers, name, common, first_bytes / rate, total / rate)
            finally:
                side.close()
        forward.forget()
        del pools, layers, chunks  # the graphs and the pools go before the next case's are made
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if absent:
        rows.append(Row(SECTION, "peer: SGLang JIT kernels", "-", page_size, extra={"absent": absent}))
    return rows + break_even_rows(rows, model)


def paths(ctx: Context, pools: Pools, side: HostSide, forward: Forward, name: str) -> tuple[dict[str, Engine], dict[str, dict], str]:
    """Per path of backend `name` (and SGLang's kernels with the first backend) its engine, and of
    SGLang's paths which kernel each kind of pool's loads run; why SGLang's kernels are absent, if they are."""
    engines = {io: Engine(pools, side, forward, io, ctx.gpu) for io in io_paths(backends.get(name))}
    if name != ctx.names[0]:
        return engines, {}, ""
    found = {}
    for full in (True, False):
        dev = pools.dev[full]
        found[full], reason = kernels([dev.k_buffer[0], dev.v_buffer[0]], pools.page_size)
        if reason:
            return engines, {}, reason
    about = {}
    for kernel, path in SGLANG_PATHS.items():
        engines[path] = Engine(pools, side, forward, "kernel", ctx.gpu, {full: k.load(kernel) for full, k in found.items()})
        about[path] = {"sglang": found[True].version, "kernel": {"full" if full else "swa": k.took(kernel) for full, k in found.items()}}
    return engines, about, ""


def case_rows(ctx: Context, pools: Pools, side: HostSide, engines: dict[str, Engine], about: dict[str, dict],
              layers: list[Callable[[], object]], name: str, common: dict, first_load_s: float, all_loads_s: float) -> list[Row]:
    """One case's rows for one backend: each path's loads alone, then the prefill and the forward
    alone drawn in turn; the bound from the forward's median."""
    clock, reps = ctx.clock, ctx.reps
    alone = {}
    for path, engine in engines.items():
        engine.clear_loaded()
        alone[path] = (*clock.time(engine.loads, reps), engine.loaded_correctly())
    watch = side.auto_watch()

    def draw(path: str) -> dict[str, float]:
        if path == FORWARD:
            seconds, host_s = clock.time(lambda: [layer() for layer in layers], reps)
            return {"compute_ms": seconds * 1e3, "compute_host_ms": host_s * 1e3}
        seconds, host_s = clock.time(engines[path].prefill, reps)
        return {"prefill_ms": seconds * 1e3, "prefill_host_ms": host_s * 1e3}

    drawn = alternate([FORWARD, *engines], draw, ctx.draws, ctx.progress, f"prefill {common['prefix']} + {common['new']}, {name}")
    compute = summarize(drawn.pop(FORWARD))
    compute_s = compute["compute_ms"] / 1e3
    limit = bound(compute_s, first_load_s, all_loads_s, common["last_layer_ms"] / 1e3)
    rows = []
    for path, draws in drawn.items():
        loads_s, loads_host_s, verified = alone[path]
        prefill = summarize(draws)
        prefill_s = prefill["prefill_ms"] / 1e3
        extra = {**common, **compute, **prefill, **about.get(path, {}), "io": path, "backend": name,
                 "loads_ms": loads_s * 1e3, "exposed_ms": (prefill_s - compute_s) * 1e3, "loads_host_ms": loads_host_s * 1e3,
                 "bound_ms": limit * 1e3, "prefill_vs_bound": prefill_s / limit, "vs_recompute": common["recompute_ms"] / 1e3 / prefill_s,
                 "host_pool_mb": side.host_bytes() / 1e6, "verified": verified}
        if path == "auto":
            extra["auto_took"] = {kind: w.took() for kind, w in watch.items()}
        ctx.progress(f"  {name} {path}: prefill {prefill_s * 1e3:.2f} ms, forward alone {compute_s * 1e3:.2f}, loads alone "
                     f"{loads_s * 1e3:.2f}, bound {limit * 1e3:.2f}" + "".join(f", {k} layers {v}" for k, v in extra.get("auto_took", {}).items()))
        eff = gbps(common["bytes_loaded"], loads_s)
        label = path if path in about else f"{name} {path}"
        rows.append(Row(SECTION, label, "h2d", pools.page_size, eff, percent(eff, ctx.ceil, "h2d"), prefill["prefill_host_ms"] * 1e3, extra=extra))
    return rows
