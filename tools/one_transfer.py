"""One per-layer load and one per-layer backup (kernel io, or --io direct), for profilers.

    ncu --clock-control none --metrics ... python3 tools/one_transfer.py --page-size 64
    nsys profile python3 tools/one_transfer.py --io direct

The first pair compiles and binds; the second is the one to look at.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from portable_kv import backends
from portable_kv.bench import add_arguments
from portable_kv.bench.run import chosen_backends, page_sizes
from portable_kv.bench.workload import Geometry, Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--io", choices=("kernel", "direct"), default="kernel", help="io backend of the pair (default: %(default)s)")
    args = parser.parse_args()
    backend = backends.use(chosen_backends(args.backends)[0])
    w = Workload(Geometry.from_args(args), page_sizes(args.page_size)[0], 2, backend.device)
    with w.host_pool("page_first_direct", args.io) as host:
        for _ in range(2):
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0)
            host.backup_from_device_per_layer(w.dev, w.host_idx, w.dev_idx, 1)
        if backend.device.type != "cpu":
            torch.cuda.synchronize(backend.device)


if __name__ == "__main__":
    # Engines transfer on streams of their own; the batched memcpy APIs reject the legacy default stream.
    with torch.cuda.stream(torch.cuda.Stream()) if torch.cuda.is_available() else contextlib.nullcontext():
        main()
