"""One per-layer load and one per-layer backup on the kernel path, for profilers.

    ncu --clock-control none --metrics ... python3 scripts/one_transfer.py --page-size 64
"""

from __future__ import annotations

import argparse

import torch

from portable_kv import backends
from portable_kv.bench import Workload, add_arguments


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    backends.use("cuda")
    w = Workload(args, int(args.page_size.split(",")[0]), 2, torch.device("cuda"))
    host = w.host_pool("page_first_direct", "kernel")
    for _ in range(2):  # the first pair compiles and binds
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0)
        host.backup_from_device_per_layer(w.dev, w.host_idx, w.dev_idx, 1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
