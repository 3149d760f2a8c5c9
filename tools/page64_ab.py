"""The benchmark's page-64 row (per-layer load H2D, all-layer backup D2H, kernel and
direct io) through the public API only, so that two versions of the package can be
measured on the same machine in one run:

    PYTHONPATH=/path/to/other/version python3 tools/page64_ab.py --label before
    python3 tools/page64_ab.py --label after

MiMo-V2-like pools (K 4x192, V 4x128, bf16, 8 layers), 611 random pages of 64 tokens
(100 MB of K+V per per-layer load), median of --reps calls timed with CUDA events,
beside one bulk page-locked memcpy of the same bytes each way (the ceiling).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="a name for this version in the output")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per cell (median kept)")
    parser.add_argument("--json", default="", help="append the row as one JSON line here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("page64_ab: needs a GPU")
        return 2
    import portable_kv as pk

    layers, page, pages = 8, 64, 611
    dev = pk.DeviceKVPool(num_layers=layers, num_tokens=2 * pages * page, page_size=page, k_heads=4, k_head_dim=192,
                          v_head_dim=128, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    row = {"label": args.label, "version": getattr(pk, "__version__", "?")}
    host_pages = torch.randperm(4 * pages, generator=gen)[:pages]
    dev_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    offsets = torch.arange(page)
    host_idx = (host_pages[:, None] * page + offsets).reshape(-1)
    dev_idx = (dev_pages[:, None] * page + offsets).reshape(-1).cuda()
    per_layer = host_idx.numel() * 4 * (192 + 128) * 2
    pinned = torch.empty(per_layer, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(per_layer, dtype=torch.uint8, device="cuda")
    row["ceiling_h2d"] = per_layer / timed(lambda: device.copy_(pinned, non_blocking=True), args.reps) / 1e9
    row["ceiling_d2h"] = per_layer / timed(lambda: pinned.copy_(device, non_blocking=True), args.reps) / 1e9
    for io in ("kernel", "direct"):
        host = pk.AsymmetricHostPool(dev, host_to_device_ratio=2.0, layout="page_first_direct", io_backend=io)
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)  # warm: compile, bind, validate
        host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
        row[f"{io}_load"] = per_layer / timed(lambda h=host: h.load_to_device_per_layer(dev, host_idx, dev_idx, 3), args.reps) / 1e9
        row[f"{io}_backup"] = per_layer * layers / timed(lambda h=host: h.backup_from_device_all_layer(dev, host_idx, dev_idx), args.reps) / 1e9
        host.close()
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
