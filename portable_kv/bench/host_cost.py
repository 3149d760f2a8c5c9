"""`portable-kv bench --section host-cost`: the caller's time in one per-layer load.

Per backend and io path, a call of a few pages (the launch alone) and one of a per-layer
load's worth of pages at page 64, with the indices on the CPU and on the device, through
the per-call API, SGLang's `load_to_device_per_layer_physical`, and a prepared transfer's
`plan.load` where the pool offers `prepare`; calls issued back to back as an engine's load
stream issues them, beside torch's one-element op as this machine's yardstick.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import backends
from .context import Context
from .io_paths import io_paths
from .rows import Row
from .workload import Geometry, Workload

PAGE = 64
SMALL_PAGES = 4  # the device never backs up the launch queue
# A per-layer load's worth: 100 MB of an MLA pool's 576-element bf16 rows at page 64 (the
# staged section's MLA rows), the most index entries an engine's per-layer call carries there.
LARGE_PAGES = 1356
CPU_LARGE_PAGES = 16  # the CPU backend copies on the caller's thread: a short call keeps CI quick
LARGE_LAYERS = 4  # the pools' memory, not the call, grows with layers
# (calls, a synchronise every this many): enough that the median settles; for large calls the
# queue is drained often, so that a call does not wait on the device's backlog.
CALLS = {"small": (3000, 100), "large": (120, 4)}
CPU_CALLS = (200, 100)  # the CPU backend's numbers say nothing about a GPU: a smoke test's worth


def measure(ctx: Context) -> list[Row]:
    geometry = ctx.geometry
    counts = [("small", geometry.pages or SMALL_PAGES, ctx.layers)]
    if not geometry.pages:
        counts.append(("large", LARGE_PAGES if ctx.gpu else CPU_LARGE_PAGES, min(ctx.layers, LARGE_LAYERS)))
    rows = []
    for size, pages, layers in counts:
        w = Workload(Geometry(geometry.heads, geometry.k_dim, geometry.v_dim, geometry.dtype, pages), PAGE, layers, ctx.device)
        for name in ctx.names:
            backend = backends.use(name)
            paths = io_paths(backend)
            ctx.progress(f"{name} host cost of a per-layer load: {w.pages} pages of {PAGE} tokens, {len(paths)} io paths")
            ctx.progress.expect(len(paths))
            for io in paths:
                rows += path_rows(ctx, w, name, io, size)
                ctx.progress.done(f"{name} {io}, {w.pages} pages")
        del w
        if ctx.gpu:
            torch.cuda.empty_cache()
    x = torch.zeros(1, device=ctx.device)
    rows.append(Row("host_cost", "yardstick: torch x.add_(1), 1 element", "-", host_us=ctx.clock.host_us(lambda: x.add_(1))))
    if ctx.gpu:
        rows.append(Row("host_cost", "yardstick: torch current-stream query", "-", host_us=ctx.clock.host_us(torch.cuda.current_stream)))
    return rows


def path_rows(ctx: Context, w: Workload, name: str, io: str, size: str) -> list[Row]:
    """One io path's rows: each API, with the indices where the device is and where the host is."""
    calls, sync_every = CALLS[size] if ctx.gpu else CPU_CALLS
    places = (("device", w.dev_idx.device), ("cpu", torch.device("cpu"))) if ctx.gpu else (("cpu", torch.device("cpu")),)
    rows = []
    with w.host_pool("page_first_direct", io) as host:
        for where, device in places:
            host_idx, dev_idx = host.prepare_transfer_indices(w.host_idx.to(device), w.dev_idx.to(device), io)
            for api, call in apis(host, w, host_idx, dev_idx, io).items():
                label = f"{name} {api}, {io} io, {w.pages} pages, indices on {where}"
                extra = {"pages": w.pages, "layers": w.layers, "indices": where, "api": api, "io": io}
                if isinstance(call, str):
                    rows.append(Row("host_cost", label, "h2d", w.page_size, extra={**extra, "absent": call}))
                    continue
                layer = iter(range(1 << 62))
                us = ctx.clock.host_us(lambda call=call, layer=layer: call(next(layer) % w.layers), calls, sync_every)
                rows.append(Row("host_cost", label, "h2d", w.page_size, host_us=us, extra=extra))
    return rows


def apis(host, w: Workload, host_idx: torch.Tensor, dev_idx: torch.Tensor, io: str) -> dict[str, Callable[[int], None] | str]:
    """Per API, a per-layer load of layer n, or the reason it cannot run here."""
    found: dict[str, Callable[[int], None] | str] = {
        "per-layer load": lambda n: host.load_to_device_per_layer(w.dev, host_idx, dev_idx, n, io),
        "SGLang load_to_device_per_layer_physical": lambda n: host.load_to_device_per_layer_physical(w.dev, host_idx, dev_idx, n, io),
    }
    prepare = getattr(host, "prepare", None)
    if prepare is None:
        return found
    try:
        plan = prepare(w.dev, host_idx, dev_idx, io_backend=io)
    except (TypeError, ValueError, NotImplementedError) as exc:
        found["prepared plan.load"] = f"prepare refused: {type(exc).__name__}: {exc}"
    else:
        found["prepared plan.load"] = plan.load
    return found
