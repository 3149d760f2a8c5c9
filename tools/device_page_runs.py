"""How long are the runs of device pages SGLang's own allocator hands out after churn, and
how many copies does direct io then need for a per-layer load?

Direct io merges a run of tokens into one copy where it is consecutive on both sides,
host and device.  The host side is portable_kv's (runs kept long on purpose); the device
side is the engine's.  This drives SGLang's PagedTokenToKVPoolAllocator itself (the
CPU is enough) through the bench's churn: prefixes of 1..4096 tokens, the least
recently allocated freed when the pool is full, the pool filled 4 times over; then a
per-layer load's prefixes (100 MB of MiMo-V2's K and V) allocated on both sides, the
host side by the bench's model of portable_kv's allocator (bench/staged.py).

Run (where SGLang is installed, e.g. `tox -e sglang`'s environment):
    python tools/device_page_runs.py [--page-size 64,16,1] [--device-ratio 8]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from portable_kv.allocator import page_runs
from portable_kv.bench.staged import HOST_RATIO, churned_slots

TOKEN_LAYER_BYTES = 4 * (192 + 128) * 2  # MiMo-V2's K + V of one token and layer on one GPU, bf16
LOAD_BYTES = 100e6  # the bench's per-layer load


def sglang_allocator(need_sort: bool):
    """SGLang's own device allocator, as churned_slots builds allocators (size, page_size)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return lambda size, page_size: PagedTokenToKVPoolAllocator(size, page_size, torch.int64, "cpu", None, need_sort)


def copies(host: torch.Tensor, device: torch.Tensor) -> int:
    """Direct io's copies for one buffer of a `layer_first` host: runs consecutive on both sides."""
    h, d = host.numpy(), device.numpy()
    return int(1 + np.count_nonzero(~((np.diff(h) == 1) & (np.diff(d) == 1))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", default="64,16,1")
    parser.add_argument("--device-ratio", type=float, default=8.0, help="device pool pages : the load's pages")
    args = parser.parse_args()
    print(f"{'page':>5} {'need_sort':>9} {'pages':>6} {'device runs':>11} {'mean':>7} {'median':>6} {'in runs>=8':>10} "
          f"{'copies (K+V)':>12} {'a page each':>11}")
    for page_size in (int(p) for p in args.page_size.split(",")):
        need = -(-int(LOAD_BYTES // TOKEN_LAYER_BYTES) // page_size)
        host = churned_slots(int(HOST_RATIO * need * 1.125), page_size, need)
        for need_sort in (False, True):
            device = churned_slots(int(args.device_ratio * need), page_size, need, allocator=sglang_allocator(need_sort))
            runs = page_runs(device, page_size)
            pages = sum(runs)
            print(f"{page_size:>5} {str(need_sort):>9} {pages:>6} {len(runs):>11} {pages / len(runs):>7.1f} {statistics.median(runs):>6.0f} "
                  f"{sum(r for r in runs if r >= 8) / pages:>10.1%} {2 * copies(host, device):>12} {2 * pages:>11}")


if __name__ == "__main__":
    main()
