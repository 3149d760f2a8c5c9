"""Why does a load and a backup at once stop near 60 GB/s when bulk memcpy reaches ~95?

    python3 scripts/probe_both_ways.py

Times each direction on its own stream with its own events while the other
runs, for the package's paths and for bulk copies, with random or sequential
pages and several block quotas.  One row per case: H2D GB/s, D2H GB/s (each
over its own span) and the total over the common span.  A diagnostic for
NOTES.md, not part of the benchmark.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from portable_kv import backends
from portable_kv.bench import Workload, add_arguments
from portable_kv.plan import CopyBatch


def timed_pair(h2d, d2h, reps: int = 7) -> tuple[float, float, float]:
    """Median (h2d GB/s-time, d2h time, common span) in seconds; each op gets a stream."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    spans = []
    for rep in range(reps + 2):
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        start.record()
        for s, op, end in ((s1, h2d, ends[0]), (s2, d2h, ends[1])):
            s.wait_event(start)
            if op is not None:
                with torch.cuda.stream(s):
                    op()
            end.record(s)
        torch.cuda.synchronize()
        if rep >= 2:
            spans.append([start.elapsed_time(e) / 1e3 for e in ends])
    a = statistics.median(s[0] for s in spans)
    b = statistics.median(s[1] for s in spans)
    return a, b, statistics.median(max(s) for s in spans)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    dev = torch.device("cuda")
    backend = backends.get("cuda")
    backends.use("cuda")
    w = Workload(args, 64, 8, dev)
    half = w.pages // 2 * w.page_size
    nbytes = half * w.token_layer_bytes
    host_a, host_b = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_a, dev_b = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    # Sequential pages were measured too (NOTES.md): the same as random ones.
    orders = {"random": (w.host_idx, w.dev_idx)}
    print(f"{nbytes / 1e6:.0f} MB each way; page 64; per-direction GB/s over its own span, total over the common span")
    print(f"{'case':<58} {'h2d':>7} {'d2h':>7} {'total':>7}")

    def report(name, h2d, d2h, nb_h2d=nbytes, nb_d2h=nbytes):
        a, b, span = timed_pair(h2d, d2h)
        parts = [nb_h2d / a / 1e9 if h2d else 0.0, nb_d2h / b / 1e9 if d2h else 0.0]
        total = ((nb_h2d if h2d else 0) + (nb_d2h if d2h else 0)) / span / 1e9
        print(f"{name:<58} {parts[0]:>7.1f} {parts[1]:>7.1f} {total:>7.1f}", flush=True)

    bulk_h2d = lambda: dev_a.copy_(host_a, non_blocking=True)  # noqa: E731
    bulk_d2h = lambda: host_b.copy_(dev_b, non_blocking=True)  # noqa: E731
    report("bulk h2d alone", bulk_h2d, None)
    report("bulk d2h alone", None, bulk_d2h)
    report("bulk both", bulk_h2d, bulk_d2h)
    chunk = 96 * 1024  # a page of K on one layer: what direct moves per descriptor
    offsets = torch.randperm(nbytes // chunk).numpy().astype(np.uint64) * chunk

    def batch(dst, src):
        sizes = np.full(offsets.size, chunk, dtype=np.uint64)
        b = CopyBatch(np.uint64(dst.data_ptr()) + offsets, np.uint64(src.data_ptr()) + offsets, sizes)
        return lambda: backend.memcpy_batch(b, torch.cuda.current_stream().cuda_stream)

    report("96 KB chunks, one batched memcpy each way", batch(dev_a, host_a), batch(host_b, dev_b))
    for order, (hidx, didx) in orders.items():
        load_idx = (hidx[:half].clone(), didx[:half].clone())
        backup_idx = (hidx[half:2 * half].clone(), didx[half:2 * half].clone())
        package_cases(report, w, backend, order, load_idx, backup_idx, bulk_h2d, bulk_d2h)


def package_cases(report, w, backend, order, load_idx, backup_idx, bulk_h2d, bulk_d2h) -> None:
    for load_io, backup_io in (("kernel", "kernel"), ("kernel", "direct"), ("direct", "kernel"), ("direct", "direct")):
        pools = [w.host_pool("page_first_direct", io) for io in (load_io, backup_io)]
        load = lambda p=pools[0]: p.load_to_device_per_layer(w.dev, *load_idx, 0)  # noqa: E731
        backup = lambda p=pools[1]: p.backup_from_device_per_layer(w.dev, *backup_idx, 1)  # noqa: E731
        quotas = (16, 32, 64) if load_io == backup_io == "kernel" else (16,)
        for quota in quotas:
            backend.block_quota = quota
            if quota == 16:
                report(f"{order} {load_io} load alone", load, None)
                report(f"{order} {backup_io} backup alone", None, backup)
            report(f"{order} {load_io} load + {backup_io} backup, quota {quota}", load, backup)
        backend.block_quota = 16
        for p in pools:
            p.close()
    pool = w.host_pool("page_first_direct", "kernel")

    def at(quota, call):
        def run():
            backend.block_quota = quota
            call()
        return run

    # Posted D2H writes share the upstream link with the loads' read requests: does
    # starving the backup of blocks leave the loads room?
    for load_quota, backup_quota in ((16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8), (132, 4), (132, 8), (132, 16)):
        report(f"{order} kernel load q{load_quota} + kernel backup q{backup_quota}",
               at(load_quota, lambda: pool.load_to_device_per_layer(w.dev, *load_idx, 0)),
               at(backup_quota, lambda: pool.backup_from_device_per_layer(w.dev, *backup_idx, 1)))
    for quota in (2, 4, 8):
        report(f"{order} kernel backup alone q{quota}", None, at(quota, lambda: pool.backup_from_device_per_layer(w.dev, *backup_idx, 1)))
    backend.block_quota = 16
    report(f"{order} kernel load + bulk d2h", lambda: pool.load_to_device_per_layer(w.dev, *load_idx, 0), bulk_d2h)
    report(f"{order} bulk h2d + kernel backup", bulk_h2d, lambda: pool.backup_from_device_per_layer(w.dev, *backup_idx, 1))
    backend.block_quota = 64
    report(f"{order} kernel load q64 + bulk d2h", lambda: pool.load_to_device_per_layer(w.dev, *load_idx, 0), bulk_d2h)
    backend.block_quota = 16
    pool.close()


if __name__ == "__main__":
    main()
