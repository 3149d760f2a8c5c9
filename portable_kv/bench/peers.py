"""The engines' own code paths that the package is compared against, written from their
published behaviour: a per-page copy_ loop (legacy swap_blocks), torch indexing by hand,
and one unmerged batched memcpy (a descriptor per page and tensor).  GPU only."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .. import backends
from ..backends.base import Backend
from ..io.copier import CopyBatch
from .measure import Clock, gbps
from .rows import Row
from .workload import Workload


def peers(clock: Clock, w: Workload, reps: int, ceil: dict) -> list[Row]:
    P = w.page_size
    host_k = torch.empty(w.host_pages, w.layers, P, *w.dev.k_buffer[0].shape[1:], dtype=w.dtype, pin_memory=True)
    host_v = torch.empty(w.host_pages, w.layers, P, *w.dev.v_buffer[0].shape[1:], dtype=w.dtype, pin_memory=True)
    host_pages = (w.host_idx[::P] // P).tolist()
    dev_starts = w.dev_idx[::P].tolist()

    def row(name: str, direction: str, seconds: float, host_s: float, **extra) -> Row:
        rate = gbps(w.layer_bytes, seconds)
        return Row("peer", name, direction, P, rate, 100 * rate / ceil[direction], host_s * 1e6, extra=extra)

    def page_loop() -> None:
        for hp, d0 in zip(host_pages, dev_starts):
            w.dev.k_buffer[0][d0 : d0 + P].copy_(host_k[hp, 0], non_blocking=True)
            w.dev.v_buffer[0][d0 : d0 + P].copy_(host_v[hp, 0], non_blocking=True)

    rows = [row("per-page copy_ loop", "h2d", *clock.time(page_loop, max(3, reps // 4), warmup=1))]

    host_flat_k = host_k.view(w.host_pages * P, w.layers, *host_k.shape[3:])
    host_flat_v = host_v.view(w.host_pages * P, w.layers, *host_v.shape[3:])
    dev_idx = w.dev_idx.to(w.dev.device)

    def by_hand() -> None:  # gather on the host, copy, scatter
        w.dev.k_buffer[0][dev_idx] = host_flat_k[w.host_idx, 0].to(w.dev.device, non_blocking=True)
        w.dev.v_buffer[0][dev_idx] = host_flat_v[w.host_idx, 0].to(w.dev.device, non_blocking=True)

    rows.append(row("torch indexing by hand", "h2d", *clock.time(by_hand, max(3, reps // 4), warmup=1)))

    memcpy_batch = batched_memcpy(backends.current())
    if memcpy_batch is not None:
        for direction in ("h2d", "d2h"):
            dst, src, sizes = [], [], []
            for host_t, dev_t in ((host_k, w.dev.k_buffer[0]), (host_v, w.dev.v_buffer[0])):
                page_bytes = P * dev_t[0].numel() * dev_t.element_size()
                host_addr = host_t.data_ptr() + np.asarray(host_pages) * host_t.stride(0) * host_t.element_size()
                dev_addr = dev_t.data_ptr() + np.asarray(dev_starts) * dev_t.stride(0) * dev_t.element_size()
                to, frm = (dev_addr, host_addr) if direction == "h2d" else (host_addr, dev_addr)
                dst.append(to)
                src.append(frm)
                sizes.append(np.full(len(host_addr), page_bytes))
            batch = CopyBatch(*(np.concatenate(a).astype(np.uint64) for a in (dst, src, sizes)))
            seconds, host_s = clock.time(lambda b=batch: memcpy_batch(b, torch.cuda.current_stream().cuda_stream), reps)
            rows.append(row("one unmerged batched memcpy", direction, seconds, host_s, descriptors=len(batch)))
    return rows


def batched_memcpy(backend: Backend) -> Callable[[CopyBatch, int], None] | None:
    """The vendor's batched memcpy (cudaMemcpyBatchAsync / hipMemcpyBatchAsync) as the backend
    calls it, or None where its copy engine is the host's.  Backends expose no public handle
    to it: this is the one place the benchmark reaches into a backend's copy engine."""
    engine = backend.copier
    return engine.memcpy_batch if engine.device.type != "cpu" else None
