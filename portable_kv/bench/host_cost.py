"""`portable-kv bench --section host-cost`: the caller's time in one per-layer load.

Per backend and io path, a call of a few pages (the launch alone) and one of a per-layer
load's worth of pages at page 64, through each way an engine calls: the per-call API
with its own tensors, SGLang's hook (`prepare_transfer_indices`, then
`load_to_device_per_layer_physical` with its copies), a prepared transfer's `plan.load`,
and eight index sets called in turn, as an engine interleaves requests, both through the
per-call API and as eight plans.  SGLang's own JIT kernel, as SGLang calls it, is the
peer where it runs, with one and with eight index sets.  Calls are issued back to back
as an engine's load stream issues them; every row is drawn `--draws` times, the rows of
a size in turn (draws.py), beside torch's one-element op as this machine's yardstick.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import portable_kv as pk

from .. import backends
from ..engines.sglang.surface import with_sglang_names
from .context import Context
from .draws import alternate, summarize
from .io_paths import io_paths
from .rows import Row
from .sglang_jit import kernels
from .workload import Geometry, Workload

PAGE = 64
SMALL_PAGES = 4  # the device never backs up the launch queue
# A per-layer load's worth: 100 MB of an MLA pool's 576-element bf16 rows at page 64 (the
# staged section's MLA rows), the most index entries an engine's per-layer call carries there.
LARGE_PAGES = 1356
CPU_LARGE_PAGES = 16  # the CPU backend copies on the caller's thread: a short call keeps CI quick
LARGE_LAYERS = 4  # the pools' memory, not the call, grows with layers
INTERLEAVED = 8  # index sets an engine's calls take in turn (requests, a backup, a prefetch)
# (calls, a synchronise every this many): enough that the median settles; for large calls the
# queue is drained often, so that a call does not wait on the device's backlog.
CALLS = {"small": (2000, 100), "large": (120, 4)}
CPU_CALLS = (100, 50)  # the CPU backend's numbers say nothing about a GPU: a smoke test's worth
Call = Callable[[int], None]


def measure(ctx: Context) -> list[Row]:
    geometry = ctx.geometry
    counts = [("small", geometry.pages or SMALL_PAGES, ctx.layers)]
    if not geometry.pages:
        counts.append(("large", LARGE_PAGES if ctx.gpu else CPU_LARGE_PAGES, min(ctx.layers, LARGE_LAYERS)))
    rows = []
    for size, pages, layers in counts:
        w = Workload(Geometry(geometry.heads, geometry.k_dim, geometry.v_dim, geometry.dtype, pages), PAGE, layers, ctx.device)
        for name in ctx.names:
            rows += backend_rows(ctx, w, name, size)
        del w
        if ctx.gpu:
            torch.cuda.empty_cache()
    x = torch.zeros(1, device=ctx.device)
    rows.append(Row("host_cost", "yardstick: torch x.add_(1), 1 element", "-", host_us=ctx.clock.host_us(lambda: x.add_(1))))
    if ctx.gpu:
        rows.append(Row("host_cost", "yardstick: torch current-stream query", "-", host_us=ctx.clock.host_us(torch.cuda.current_stream)))
    return rows


def backend_rows(ctx: Context, w: Workload, name: str, size: str) -> list[Row]:
    """Every io path's and the peer's rows of one backend and size, drawn in turn."""
    backend = backends.use(name)
    calls, sync_every = CALLS[size] if ctx.gpu else CPU_CALLS
    index_sets = interleaved_sets(w)
    pools, found, absent = [], {}, {}
    try:
        for io in io_paths(backend):
            pool = with_sglang_names(pk.MLAHostPool if w.pool == "MLA" else pk.AsymmetricHostPool)
            host = pool(w.dev, host_to_device_ratio=1.0, layout="page_first_direct", io_backend=io)
            pools.append(host)
            for api, call in apis(host, w, index_sets, io).items():
                found[(io, api)] = call
        peer, reason = peer_calls(w, index_sets, pools)
        if peer:
            found.update(peer)
        else:
            absent[("peer", "SGLang JIT kernel as SGLang calls it")] = reason
        ctx.progress(f"{name} host cost of a per-layer load: {w.pages} pages of {PAGE} tokens, {len(found)} ways, {ctx.draws} draws")

        def draw(key: tuple[str, str]) -> dict[str, float]:
            layer = iter(range(1 << 62))
            call = found[key]
            return {"host_us": ctx.clock.host_us(lambda: call(next(layer) % w.layers), calls, sync_every)}

        drawn = alternate(list(found), draw, ctx.draws, ctx.progress, f"{name} host cost, {size}")
    finally:
        for host in pools:
            host.close()
    rows = []
    for (io, api), draws in drawn.items():
        summary = summarize(draws)
        extra = {"pages": w.pages, "layers": w.layers, "api": api, "io": io, **{k: v for k, v in summary.items() if k != "host_us"}}
        rows.append(Row("host_cost", f"{name} {api}, {io} io, {w.pages} pages", "h2d", w.page_size, host_us=summary["host_us"], extra=extra))
    for (io, api), reason in absent.items():
        rows.append(Row("host_cost", f"{api}, {w.pages} pages", "h2d", w.page_size, extra={"pages": w.pages, "api": api, "io": io, "absent": reason}))
    return rows


def interleaved_sets(w: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """INTERLEAVED index pairs of the workload's page count, each its own random pages, on the
    device, where SGLang's controller passes them to its kernel io (and SGLang's kernel takes them)."""
    gen = torch.Generator().manual_seed(1)
    device = w.dev.device
    sets = []
    for _ in range(INTERLEAVED):
        host = w.host_idx.view(-1, w.page_size)[torch.randperm(w.pages, generator=gen)].reshape(-1)
        dev = w.dev_idx.view(-1, w.page_size)[torch.randperm(w.pages, generator=gen)].reshape(-1)
        sets.append((host.to(device), dev.to(device)))
    return sets


def apis(host, w: Workload, index_sets: list[tuple[torch.Tensor, torch.Tensor]], io: str) -> dict[str, Call]:
    """Per way an engine calls, a per-layer load of layer n."""
    host_idx, dev_idx = index_sets[0]
    sub_host, sub_dev = host.prepare_transfer_indices(host_idx, dev_idx, io)
    plan = host.prepare(w.dev, host_idx, dev_idx, io_backend=io)
    plans = [host.prepare(w.dev, h, d, io_backend=io) for h, d in index_sets]
    turn = iter(range(1 << 62))

    def plain_in_turn(n: int) -> None:
        h, d = index_sets[next(turn) % INTERLEAVED]
        host.load_to_device_per_layer(w.dev, h, d, n, io)

    return {
        "per-layer load": lambda n: host.load_to_device_per_layer(w.dev, host_idx, dev_idx, n, io),
        "SGLang hook, load_to_device_per_layer_physical": lambda n: host.load_to_device_per_layer_physical(w.dev, sub_host, sub_dev, n, io),
        "prepared plan.load": plan.load,
        f"per-layer load, {INTERLEAVED} index sets in turn": plain_in_turn,
        f"prepared plan.load, {INTERLEAVED} plans in turn": lambda n: plans[next(turn) % INTERLEAVED].load(n),
    }


def peer_calls(w: Workload, index_sets: list[tuple[torch.Tensor, torch.Tensor]], pools: list) -> tuple[dict[tuple[str, str], Call], str]:
    """SGLang's JIT kernel as SGLang calls it over a layer_first host pool (added to `pools`),
    with one index set and with INTERLEAVED in turn; or the reason it cannot run here."""
    buffers = [getattr(w.dev, name)[0] for name in w.dev.kind.buffers]
    found, reason = kernels(buffers, w.page_size)
    if found is None:
        return {}, reason
    host = w.host_pool("layer_first", "kernel")
    pools.append(host)
    load = found.load("default")
    dev_layers = [[getattr(w.dev, name)[n] for name in w.dev.kind.buffers] for n in range(w.layers)]
    host_layers = [[getattr(host, name)[n] for name in w.dev.kind.buffers] for n in range(w.layers)]
    turn = iter(range(1 << 62))

    def one(n: int) -> None:
        h, d = index_sets[0]
        load(dev_layers[n], host_layers[n], d, h)

    def in_turn(n: int) -> None:
        h, d = index_sets[next(turn) % INTERLEAVED]
        load(dev_layers[n], host_layers[n], d, h)

    return {("peer", "SGLang JIT kernel as SGLang calls it"): one,
            ("peer", f"SGLang JIT kernel as SGLang calls it, {INTERLEAVED} index sets in turn"): in_turn}, ""
