"""The `direct` path against cudaMemcpyBatchAsync's attributes, the stream count
and the order of the descriptors.

    python3 scripts/dma_attrs.py [--page-size 64,16] [--order-only]

srcAccessOrder (stream, during the API call, any) and the flag that prefers
overlap with compute change what the driver may do with each descriptor; the
table gives load and backup GB/s and the host time per call for each setting.
A second table: 4 or 8 streams, descriptors in the plan's order (the
engine's page order) or sorted by host address.  A diagnostic for NOTES.md:
the package keeps the setting that wins here.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from portable_kv import backends
from portable_kv.backends import gpu
from portable_kv.bench import Clock, Workload, add_arguments, bench_pool, ceiling
from portable_kv.plan import CopyBatch, copy_batch

ORDERS = {"stream": 1, "during_call": 2, "any": 3}  # cudaMemcpySrcAccessOrder


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.set_defaults(page_size="64,16")
    parser.add_argument("--order-only", action="store_true", help="only the stream-count x descriptor-order table")
    args = parser.parse_args()
    backend = backends.use("cuda")
    attrs = backend.runtime.attrs
    clock = Clock(torch.device("cuda"))
    ceil = ceiling(clock, torch.device("cuda"), 256 << 20, 5)
    print(f"ceiling h2d {ceil['h2d']:.1f}  d2h {ceil['d2h']:.1f} GB/s")
    orders(args, backend, clock, ceil)
    if args.order_only:
        return
    print(f"{'order':<12} {'flags':>5} {'streams':>7} {'page':>5} {'h2d GB/s':>9} {'host us':>8} {'d2h GB/s':>9} {'host us':>8}")
    for page_size in (int(p) for p in args.page_size.split(",")):
        w = Workload(args, page_size, 8, torch.device("cuda"))
        host = w.host_pool("page_first_direct", "direct")
        for order, value in ORDERS.items():
            for flags in (0, 1):
                for streams in (1, 4):
                    attrs.src_access_order, attrs.flags, backend.dma_streams = value, flags, streams
                    try:
                        load, backup = bench_pool(clock, w, host, "direct", 5, ceil, "dma", order)
                    except RuntimeError as exc:  # a setting this driver refuses
                        print(f"{order:<12} {flags:>5} {streams:>7} {page_size:>5} refused: {exc}")
                        continue
                    print(f"{order:<12} {flags:>5} {streams:>7} {page_size:>5} {load.gbps:>9.1f} {load.host_us:>8.0f} {backup.gbps:>9.1f} {backup.host_us:>8.0f}", flush=True)
        host.close()
        del w
        torch.cuda.empty_cache()



def host_sorted(transfer) -> CopyBatch:
    batch = copy_batch(transfer)
    order = np.argsort(batch.src if transfer.to_device else batch.dst, kind="stable")
    return CopyBatch(batch.dst[order], batch.src[order], batch.sizes[order])


def orders(args, backend, clock, ceil) -> None:
    print(f"{'descriptors':<12} {'streams':>7} {'page':>5} {'h2d GB/s':>9} {'host us':>8} {'d2h GB/s':>9} {'host us':>8}")
    for page_size in (int(p) for p in args.page_size.split(",")):
        w = Workload(args, page_size, 8, torch.device("cuda"))
        host = w.host_pool("page_first_direct", "direct")
        for name, plan in (("plan order", copy_batch), ("host-sorted", host_sorted)):
            gpu.copy_batch = plan
            for streams in (4, 8):
                backend.dma_streams = streams
                load, backup = bench_pool(clock, w, host, "direct", 5, ceil, "dma", name)
                print(f"{name:<12} {streams:>7} {page_size:>5} {load.gbps:>9.1f} {load.host_us:>8.0f} {backup.gbps:>9.1f} {backup.host_us:>8.0f}", flush=True)
        gpu.copy_batch = copy_batch
        backend.dma_streams = 4
        host.close()


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
