"""The staged section's loads beside compute: per-layer loads interleaved with the bench's bf16
matmul loop, every io path of the backend and SGLang's kernels where they run, each row drawn
`--draws` times with the paths in turn (draws.py), median and spread of the loads' GB/s, the
matmuls' cost and the caller's time per load call; which path auto took, over its draws."""

from __future__ import annotations

from collections.abc import Callable

import torch

import portable_kv as pk

from .beside import MatmulLoop
from .context import Context
from .draws import alternate, summarize
from .io_paths import AutoWatch
from .rows import Row
from .staged_peers import SGLangPeers
from .workload import Workload


def interference(ctx: Context, w: Workload, host: pk.AsymmetricHostPool, name: str, where: str, paths: tuple[str, ...],
                 sglang: SGLangPeers | None) -> list[Row]:
    loop = MatmulLoop(w.dev.device)
    loads: dict[str, Callable[[int], None]] = {
        f"{name} {io}": (lambda i, io=io: host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, i % w.layers, io_backend=io))
        for io in paths}
    if sglang is not None:
        loads |= {sglang.label(kernel): sglang.layer_load(kernel) for kernel in sglang.kernels}
    sides = {label: torch.cuda.Stream() for label in loads}
    watch = AutoWatch(host) if "auto" in paths else None

    def draw(label: str) -> dict[str, float]:
        return loop.draw(ctx.clock, loads[label], w.layer_bytes, sides[label])

    drawn = alternate(list(loads), draw, ctx.draws, ctx.progress, f"beside the matmul, {where}")
    rows = []
    for label, draws in drawn.items():
        extra = summarize(draws)
        if label == f"{name} auto" and watch is not None:
            extra["auto_took"] = watch.took()
            if watch.reasons():
                extra["auto_reason"] = "; ".join(f"{path}: {why}" for path, why in watch.reasons().items())
        if sglang is not None and label in map(sglang.label, sglang.kernels):
            extra |= sglang.extra(next(k for k in sglang.kernels if sglang.label(k) == label))
        rows.append(Row("staged", f"{label} load during matmul, interleaved, {where}", "h2d", w.page_size, extra["gbps"],
                        host_us=extra["host_us"], extra=extra))
    return rows
