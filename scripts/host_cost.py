"""Host CPU time of one per-layer load on the kernel path, and where it goes.

    python3 scripts/host_cost.py [--layers 48]

Medians over thousands of calls of small transfers (so the GPU never backs up
the launch queue), for: the whole call; the package with the backend's
transfer stubbed out (validation caches, binding); the vendor launch alone;
the current-stream query; and a one-element torch op as this machine's yardstick.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from portable_kv import backends
from portable_kv.backends.gpu import BLOCK
from portable_kv.bench import Workload, add_arguments


def median_us(fn, calls: int = 3000, sync_every: int = 100) -> float:
    times = []
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times[calls // 10:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.set_defaults(pages=4)
    args = parser.parse_args()
    backend = backends.use("cuda")
    w = Workload(args, 64, args.layers, torch.device("cuda"))
    host = w.host_pool("page_first_direct", "kernel")
    layer = [0]

    def load():
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer[0])
        layer[0] = (layer[0] + 1) % w.layers

    rows = [("per-layer load, kernel io (whole call)", median_us(load))]
    launch = backend._local.prepared[0]
    stream = backend.stream()
    rows.append(("  vendor launch alone (ctypes cuLaunchKernel)", median_us(lambda: backend.launch(launch.kernel, launch.grid, BLOCK, launch.params, stream))))
    rows.append(("  current-stream query", median_us(backend.stream)))
    real = backend.transfer
    backend.transfer = lambda transfer, io: None
    rows.append(("  package without the backend's transfer", median_us(load)))
    backend.transfer = real
    x = torch.zeros(1, device="cuda")
    rows.append(("yardstick: torch x.add_(1) on a 1-element tensor", median_us(lambda: x.add_(1))))
    print(f"{args.layers} layers, {w.pages} pages of 64 tokens per call")
    for name, us in rows:
        print(f"{name:<52} {us:7.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for i in range(2000):
        load()
        if i % 100 == 0:
            torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
