"""The staged io path's pipeline settings against each other, in one process against one
ceiling: per-layer loads one call from an idle GPU and every layer back to back, an
all-layer backup, the loads with the host-side copies left out (the kernel alone in
device memory), host time per load, and a bf16 matmul's slowdown beside the loads (and
beside their copies alone, the kernels left out), for each variant of

- whether a load's copies wait for the current stream on every call (as before) or only
  after a backup of the pool (StagedMover.wait_each_load),
- the taper of the last chunks (staged_plan.TAPER: each chunk this fraction of the one before),
- the kernel's block quota (PORTABLE_KV_STAGING_BLOCKS).

Allocator-placed pages after churn (the bench's staged workload), layer_first (batched
copies) and page_first_direct (2-D copies) hosts.

Run on a GPU host: python3 tools/staged_ab.py [--page-sizes 64,1] [--variants NAME,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from portable_kv import backends
from portable_kv.bench.measure import Clock, gbps
from portable_kv.bench.run import CEILING_BYTES
from portable_kv.bench.sections import ceiling
from portable_kv.bench.staged import StagedWorkload, interference
from portable_kv.bench.workload import Geometry
from portable_kv.io import staged_plan


@dataclass(frozen=True)
class Variant:
    wait_each_load: bool
    taper: float
    blocks: int


VARIANTS = {
    "wait-each-load": Variant(True, 0.75, 8),  # the pipeline as it was
    "overlap": Variant(False, 0.75, 8),
    "overlap-taper-0.6": Variant(False, 0.6, 8),
    "overlap-taper-0.5": Variant(False, 0.5, 8),
    "overlap-taper-0.35": Variant(False, 0.35, 8),
    "overlap-blocks-4": Variant(False, 0.75, 4),
    "overlap-taper-0.5-blocks-4": Variant(False, 0.5, 4),
}


def measure(clock: Clock, w: StagedWorkload, layout: str, name: str, variant: Variant, reps: int, ceil: dict) -> dict:
    staged_plan.TAPER = variant.taper
    host = w.host_pool(layout, "staged")
    mover = host._mover("staged")  # noqa: SLF001 -- a probe sets the mover's switches
    mover.wait_each_load = variant.wait_each_load
    mover.kernel.block_quota = variant.blocks
    layer = [0]

    def one() -> None:
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer[0] % w.layers)
        layer[0] += 1

    def every_layer() -> None:
        for n in range(w.layers):
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, n)

    row = {"page": w.page_size, "layout": layout, "variant": name, **variant.__dict__}
    row["load_one"] = gbps(w.layer_bytes, clock.time(one, reps)[0])
    seconds, host_s = clock.time(every_layer, max(3, reps // 2), warmup=1)
    row["load_back_to_back"], row["host_us"] = gbps(w.layer_bytes * w.layers, seconds), host_s * 1e6 / w.layers
    row["backup"] = gbps(w.layer_bytes * w.layers, clock.time(lambda: host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx), reps)[0])
    row["chunks"] = len(mover.prepared(_layer_transfer(host, w)).plan.chunks)
    row["took"] = mover.last_path
    copy = mover._copy  # noqa: SLF001
    mover._copy = lambda *args: None  # the kernel alone, between staging and the KV buffers
    row["kernel_alone"] = gbps(w.layer_bytes * w.layers, clock.time(every_layer, max(3, reps // 2), warmup=1)[0])
    mover._copy = copy
    row["during_matmul"] = row["matmul_slowdown_pct"] = row["matmul_slowdown_copies_alone_pct"] = 0.0
    if clock.gpu:
        matmul = [r for r in interference(clock, w, host, "cuda", layout) if " staged " in r.name][0]
        row["during_matmul"], row["matmul_slowdown_pct"] = matmul.gbps, matmul.extra["matmul_slowdown_pct"]
        # The same with the kernels left out: what the copies alone cost the matmul.
        kernel = mover._kernel  # noqa: SLF001
        mover._kernel = lambda *args: None
        matmul = [r for r in interference(clock, w, host, "cuda", layout) if " staged " in r.name][0]
        row["matmul_slowdown_copies_alone_pct"] = matmul.extra["matmul_slowdown_pct"]
        mover._kernel = kernel
    row["sm_mhz"] = clock.sm_mhz
    host.close()
    return row


def report(row: dict, ceil: dict) -> str:
    for key in ("load_one", "load_back_to_back", "backup"):
        row[key + "_pct"] = 100 * row[key] / ceil["d2h" if key == "backup" else "h2d"]
    return (f"page {row['page']:3d} {row['layout']:18s} {row['variant']:28s} chunks {row['chunks']:3d}  load {row['load_one']:5.1f} / "
            f"back to back {row['load_back_to_back']:5.1f} ({row['load_back_to_back_pct']:5.1f}%)  backup {row['backup']:5.1f} "
            f"({row['backup_pct']:5.1f}%)  kernel alone {row['kernel_alone']:6.1f}  host {row['host_us']:6.1f} us  "
            f"matmul +{row['matmul_slowdown_pct']:4.1f}% at {row['during_matmul']:5.1f} (copies alone +{row['matmul_slowdown_copies_alone_pct']:4.1f}%)  "
            f"sm {row['sm_mhz']} MHz")


def _layer_transfer(host, w: StagedWorkload):
    """The Transfer of a per-layer load of the workload, as the pool builds it."""
    from portable_kv.transfer import Transfer

    binding = host._bind(w.dev, range(0, 1))  # noqa: SLF001
    indices = host._validator(w.host_idx, w.dev_idx, binding.geometry.tokens, True)  # noqa: SLF001
    return Transfer(True, binding.pairs, indices, range(0, 1), host.page_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="64,1")
    parser.add_argument("--layouts", default="layer_first,page_first_direct")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--backend", default="cuda", help="cpu: a smoke test of this script, nothing measured")
    parser.add_argument("--json")
    args = parser.parse_args()
    backend = backends.use(args.backend)
    clock = Clock(backend.device)
    ceil = ceiling(clock, backend.device, CEILING_BYTES["quick"], args.reps)
    for key in ("h2d", "d2h", "both"):
        ceil.setdefault(key, ceil.get("memcpy", 1.0))
    print(f"ceiling at the start: h2d {ceil['h2d']:.1f} d2h {ceil['d2h']:.1f} both {ceil['both']:.1f} GB/s", flush=True)
    rows, taper = [], staged_plan.TAPER
    for page_size in map(int, args.page_sizes.split(",")):
        w = StagedWorkload(Geometry(4, 192, 128, "bf16", 0), page_size, 8, backend.device, "allocator")
        for layout in args.layouts.split(","):
            for name in args.variants.split(","):
                row = measure(clock, w, layout, name, VARIANTS[name], args.reps, ceil)
                staged_plan.TAPER = taper
                rows.append(row)
                print(report(row, ceil), flush=True)
        del w
        if clock.gpu:
            torch.cuda.empty_cache()
    # The ceiling again at the end, and each direction's higher reading for the ratios: one
    # 100 MB reading at the start of a run came out 5% low on the H200.
    end = ceiling(clock, backend.device, CEILING_BYTES["quick"], args.reps)
    for key in ("h2d", "d2h", "both"):
        ceil[key] = max(ceil[key], end.get(key, end.get("memcpy", 1.0)))
    print(f"ceiling at the end: h2d {end.get('h2d', 0):.1f} d2h {end.get('d2h', 0):.1f} both {end.get('both', 0):.1f} GB/s; "
          "ratios below against the higher reading of each")
    for row in rows:
        print(report(row, ceil))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
