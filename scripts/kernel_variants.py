"""Measure compile-time variants of the CUDA copy kernel side by side (one GPU call).

    python3 scripts/kernel_variants.py [--blocks 16] [--layers 8] [--baseline A.h,B.h]

A baseline is an earlier kv_copy.h measured beside the current one on the same
machine, e.g. the kernel before this session's pipelining:
    git show 3cb09eb:portable_kv/kernels_common/kv_copy.h > /tmp/kv_copy_3cb09eb.h

Each variant is a set of preprocessor definitions (PORTABLE_KV_DEFINES) that
kernels_cuda/kv_copy.cu or kernels_common/kv_copy.h read; the table gives
per-layer load (H2D) and all-layer backup (D2H) GB/s against the ceiling.
"""

from __future__ import annotations

import argparse
import os

import torch

from portable_kv import backends
from portable_kv.backends.cuda import CudaBackend
from portable_kv.bench import Clock, Workload, add_arguments, bench_pool, ceiling
from portable_kv.layout import canonical_view

# Measured before, kept in NOTES.md, code removed: a 256-byte L2 fetch hint, 32-bit division, Hopper bulk copies.
VARIANTS = ["", "PKV_UNROLL=2", "PKV_UNROLL=8"]


def roundtrip_ok(w: Workload, host) -> bool:
    """A variant's numbers count only if it moves the right bytes: load random host
    data into one layer, back it up into cleared host pages, compare both hops
    (as integers: random bits include NaNs)."""
    layer, P = w.layers - 1, w.page_size
    where = (w.host_idx // P, w.host_idx % P, layer)
    views = [canonical_view(b, host.layout, P) for b in (host.k_buffer, host.v_buffer)]
    expected = []
    for view in views:
        bits = torch.randint(-(1 << 15), 1 << 15, (w.host_idx.numel(), *view.shape[-2:]), dtype=torch.int16)
        view[where] = bits.view(view.dtype)
        expected.append(bits)
    host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer, io_backend="kernel")
    torch.cuda.synchronize()
    ok = all(torch.equal(dev[layer][w.dev_idx.to(dev[layer].device)].cpu().view(torch.int16), e)
             for dev, e in zip((w.dev.k_buffer, w.dev.v_buffer), expected))
    for view in views:
        view[where] = 0
    host.backup_from_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer, io_backend="kernel")
    torch.cuda.synchronize()
    return ok and all(torch.equal(view[where].view(torch.int16), e) for view, e in zip(views, expected))


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--blocks", type=str, default="8,16")
    parser.add_argument("--baseline", type=str, default="", help="comma-separated earlier kv_copy.h files to measure beside this one (e.g. from git show)")
    args = parser.parse_args()
    variants = list(VARIANTS)
    labels = {}
    for i, path in enumerate(p for p in args.baseline.split(",") if p):
        variant = f'PKV_COMMON_HEADER="{os.path.abspath(path)}"'
        variants.insert(1 + i, variant)
        labels[variant] = "baseline " + os.path.basename(path)
    clock = Clock(torch.device("cuda"))
    ceil = ceiling(clock, torch.device("cuda"), 1 << 30, 10)
    print(f"ceiling h2d {ceil['h2d']:.1f}  d2h {ceil['d2h']:.1f}  both {ceil['both']:.1f} GB/s")
    print(f"{'variant':<28} {'blocks':>6} {'page':>5} {'h2d GB/s':>9} {'%':>6} {'d2h GB/s':>9} {'%':>6}")
    for page_size in (64, 1):
        w = Workload(args, page_size, 8, torch.device("cuda"))
        for variant in variants:
            os.environ["PORTABLE_KV_DEFINES"] = variant
            backend = CudaBackend()
            backends._instances["cuda"] = backend
            backends.use("cuda")
            for blocks in (int(b) for b in args.blocks.split(",")):
                backend.block_quota = blocks
                host = w.host_pool("page_first_direct", "kernel")
                load, backup = bench_pool(clock, w, host, "kernel", 10, ceil, "variant", variant)
                ok = roundtrip_ok(w, host)
                host.close()
                label = labels.get(variant, variant or "default")
                print(f"{label:<28} {blocks:>6} {page_size:>5} {load.gbps:>9.1f} {load.pct_ceiling:>6.1f} {backup.gbps:>9.1f} {backup.pct_ceiling:>6.1f}"
                      f"  {'ok' if ok else 'WRONG BYTES'}", flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
