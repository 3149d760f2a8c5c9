"""Where the staged io path's time goes: per-layer loads and all-layer backups of
allocator-placed pages (the bench's staged workload), timed whole, with the
device-side kernel left out (copies only), and with the host-side copies left out
(kernel only), against chunk counts and the kernel's block quota; plus the kernel
between staging and the KV buffers alone, in device memory.

Run on a GPU host: python3 tools/staged_probe.py [--page-sizes 64,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from portable_kv import backends
from portable_kv.bench.measure import Clock, gbps
from portable_kv.bench.sections import ceiling
from portable_kv.bench.staged import StagedWorkload
from portable_kv.bench.workload import Geometry
from portable_kv.io import staged_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="64,16")
    parser.add_argument("--chunks", default="4,8,16,32")
    parser.add_argument("--blocks", default="8,16,32")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = backends.use(args.backend)
    clock = Clock(backend.device)
    ceil = ceiling(clock, backend.device, int(100e6), args.reps)
    ceil.setdefault('h2d', ceil.get('memcpy', 1.0))
    ceil.setdefault('d2h', ceil.get('memcpy', 1.0))
    print(f"ceiling h2d {ceil['h2d']:.1f} d2h {ceil['d2h']:.1f} GB/s")
    rows = []
    geometry = Geometry(4, 192, 128, "bf16", 0)
    for page_size in map(int, args.page_sizes.split(",")):
        rows += probe_page(clock, backend, geometry, page_size, args, ceil)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ceiling": ceil, "rows": rows}, out, indent=1)


def probe_page(clock: Clock, backend, geometry: Geometry, page_size: int, args: argparse.Namespace, ceil: dict) -> list[dict]:
    w = StagedWorkload(geometry, page_size, 8, backend.device, "allocator")
    host = w.host_pool("page_first_direct", "staged")
    mover = host._mover("staged")  # noqa: SLF001 -- a probe takes the path apart
    kernel, copy = mover._kernel, mover._copy  # noqa: SLF001
    layer = [0]

    def load() -> None:
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer[0] % w.layers)
        layer[0] += 1

    def backup() -> None:
        host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx)

    rows = []
    for chunks in map(int, args.chunks.split(",")):
        staged_plan.PIPELINE_CHUNKS = chunks
        host._validator.clear()  # noqa: SLF001 -- plans are kept with the validated indices, not per chunk count
        for blocks in map(int, args.blocks.split(",")):
            mover.kernel.block_quota = blocks
            parts = ("whole", "copies only", "kernel only")
            for part in parts:
                mover._kernel = (lambda *a: None) if part == "copies only" else kernel  # noqa: SLF001
                mover._copy = (lambda *a: None) if part == "kernel only" else copy  # noqa: SLF001
                load_s, load_host = clock.time(load, args.reps)
                backup_s, backup_host = clock.time(backup, max(3, args.reps // 3), warmup=1)
                prepared = mover.prepared(layer_transfer(host, w))
                row = dict(page=page_size, chunks=chunks, blocks=blocks, part=part,
                           copies=prepared.plan.copy_count if prepared else 0, chunk_count=len(prepared.plan.chunks) if prepared else 0,
                           load_gbps=gbps(w.layer_bytes, load_s), load_host_us=load_host * 1e6,
                           backup_gbps=gbps(w.layer_bytes * w.layers, backup_s), backup_host_us=backup_host * 1e6)
                rows.append(row)
                print(f"page {page_size:3d} chunks {chunks:3d} ({row['chunk_count']:3d}) blocks {blocks:3d} {part:12s} "
                      f"load {row['load_gbps']:5.1f} ({100 * row['load_gbps'] / ceil['h2d']:5.1f}%) host {row['load_host_us']:7.1f} us  "
                      f"backup {row['backup_gbps']:5.1f} ({100 * row['backup_gbps'] / ceil['d2h']:5.1f}%) host {row['backup_host_us']:7.1f} us  "
                      f"copies/layer-call {row['copies']}", flush=True)
    mover._kernel, mover._copy = kernel, copy  # noqa: SLF001
    host.close()
    return rows


def layer_transfer(host, w):
    """The Transfer of one per-layer load of the workload, as the pool builds it (copy_engine_probe.py uses it too)."""
    from portable_kv.transfer import Transfer

    binding = host._bind(w.dev, range(0, 1))  # noqa: SLF001
    indices = host._validator(w.host_idx, w.dev_idx, binding.geometry.tokens, True)  # noqa: SLF001
    return Transfer(True, binding.pairs, indices, range(0, 1), host.page_size)


if __name__ == "__main__":
    main()
