"""What the copy engines cost the staged io path, apart from the pipeline: the host-side
copies of one per-layer load (allocator-placed pages, as the bench places them) issued
as a loop of 2-D copies and as one 3-D batch (cudaMemcpy3DBatchAsync, CUDA >= 12.8),
timed on the device and on the host; then per-layer loads of every io path issued one
at a time from an idle GPU and all layers back to back, as an engine issues them.

Run on an NVIDIA host: python3 tools/copy_engine_probe.py [--page-sizes 64,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

from portable_kv import backends, runs
from portable_kv.bench.measure import Clock, gbps
from portable_kv.bench.sections import ceiling
from portable_kv.bench.staged import StagedWorkload
from portable_kv.bench.workload import Geometry
from portable_kv.plan import Transfer

OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer
ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class Operand(ctypes.Structure):
    """cudaMemcpy3DOperand with its pointer member: type, then a 32-byte union at offset 8."""

    _fields_ = [("type", ctypes.c_int), ("pad", ctypes.c_int), ("ptr", ctypes.c_void_p), ("row_length", ctypes.c_size_t),
                ("layer_height", ctypes.c_size_t), ("hint_type", ctypes.c_int), ("hint_id", ctypes.c_int)]


class BatchOp(ctypes.Structure):
    """cudaMemcpy3DBatchOp: source, destination, extent (width, height, depth), access order, flags."""

    _fields_ = [("src", Operand), ("dst", Operand), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t),
                ("depth", ctypes.c_size_t), ("order", ctypes.c_int), ("flags", ctypes.c_uint)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="64,16")
    parser.add_argument("--chunks", default="4,16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    assert ctypes.sizeof(BatchOp) == 112, ctypes.sizeof(BatchOp)
    backend = backends.use("cuda")
    clock = Clock(backend.device)
    ceil = ceiling(clock, backend.device, int(100e6), args.reps)
    ceil.setdefault("h2d", ceil.get("memcpy", 1.0))
    print(f"ceiling h2d {ceil['h2d']:.1f} d2h {ceil['d2h']:.1f} GB/s", flush=True)
    rows: list[dict] = []
    for page_size in map(int, args.page_sizes.split(",")):
        rows += probe_page(clock, backend, page_size, args, ceil)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ceiling": ceil, "rows": rows}, out, indent=1)


def emit(rows: list[dict], ceil: dict, **row) -> None:
    row["pct"] = 100 * row["gbps"] / ceil[row.get("dir", "h2d")]
    rows.append(row)
    print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)


def probe_page(clock: Clock, backend, page_size: int, args, ceil: dict) -> list[dict]:
    w = StagedWorkload(Geometry(4, 192, 128, "bf16", 0), page_size, 8, backend.device, "allocator")
    rows: list[dict] = []
    lib = backend.runtime.lib
    batch3d = getattr(lib, "cudaMemcpy3DBatchAsync", None)
    with w.host_pool("page_first_direct", "staged") as host:
        mover = host._mover("staged")  # noqa: SLF001 -- a probe takes the path apart
        binding = host._bind(w.dev, range(0, 1))  # noqa: SLF001
        indices = host._validator(w.host_idx, w.dev_idx, binding.geometry.tokens, True)  # noqa: SLF001
        transfer = Transfer(True, binding.pairs, indices, range(0, 1), host.page_size)
        for chunks in map(int, args.chunks.split(",")):
            runs.PIPELINE_CHUNKS = chunks
            mover._plans.clear()  # noqa: SLF001
            prepared = mover.plan(transfer)
            staging = torch.empty(prepared.plan.slot_bytes * len(prepared.plan.chunks), dtype=torch.uint8, device=backend.device)
            ops = []  # every copy of the load, each chunk in its own part of `staging`
            for pair, offset, (hosts, stagings, widths, heights, hps, sps), ends in zip(
                    transfer.pairs, prepared.plan.offsets, prepared.copies, prepared.ends):
                for c in range(len(prepared.plan.chunks)):
                    base = staging.data_ptr() + c * prepared.plan.slot_bytes + offset
                    for i in range(ends[c], ends[c + 1]):
                        ops.append((base + stagings[i], sps[i], pair.host.data_ptr() + hosts[i], hps[i], widths[i], heights[i]))
            nbytes = sum(o[4] * o[5] for o in ops)
            stream = torch.cuda.current_stream().cuda_stream

            def loop(ops: list = ops, stream: int = stream) -> None:
                for dst, dp, src, sp, width, height in ops:
                    backend.runtime.memcpy_2d(dst, dp, src, sp, width, height, stream)

            seconds, host_s = clock.time(loop, args.reps)
            emit(rows, ceil, page=page_size, chunks=len(prepared.plan.chunks), what="2-D copy loop", copies=len(ops),
                 gbps=gbps(nbytes, seconds), host_us=host_s * 1e6, host_us_per_copy=host_s * 1e6 / len(ops))
            if batch3d is not None:
                table = (BatchOp * len(ops))()
                for op, (dst, dp, src, sp, width, height) in zip(table, ops):
                    op.src = Operand(OPERAND_POINTER, 0, src, sp, 0, 0, 0)
                    op.dst = Operand(OPERAND_POINTER, 0, dst, dp, 0, 0, 0)
                    op.width, op.height, op.depth, op.order, op.flags = width, height, 1, ACCESS_ORDER_STREAM, 0

                def one_batch(ops: list = ops, table=table, stream: int = stream) -> None:
                    code = batch3d(ctypes.c_size_t(len(ops)), table, ctypes.c_ulonglong(0), ctypes.c_void_p(stream))
                    if code:
                        raise RuntimeError(f"cudaMemcpy3DBatchAsync: {backend.runtime.error_name(code)}")

                try:
                    seconds, host_s = clock.time(one_batch, args.reps)
                    emit(rows, ceil, page=page_size, chunks=len(prepared.plan.chunks), what="one 3-D batch", copies=len(ops),
                         gbps=gbps(nbytes, seconds), host_us=host_s * 1e6, host_us_per_copy=host_s * 1e6 / len(ops))
                    staging.zero_()
                    loop()
                    expect = staging.clone()
                    staging.zero_()
                    one_batch()
                    torch.cuda.synchronize()
                    print(f"  3-D batch bytes equal to the 2-D loop's: {torch.equal(staging, expect)}", flush=True)
                except RuntimeError as exc:
                    print(f"  3-D batch refused: {exc}", flush=True)
            del staging
            for io in ("kernel", "direct", "staged"):
                back_to_back(clock, w, host, io, page_size, len(prepared.plan.chunks), args.reps, ceil, rows)
    return rows


def back_to_back(clock: Clock, w, host, io: str, page_size: int, chunks: int, reps: int, ceil: dict, rows: list[dict]) -> None:
    """One per-layer load from an idle GPU, and all layers back to back (device time / layers)."""
    def one() -> None:
        host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0, io_backend=io)

    def every_layer() -> None:
        for layer in range(w.layers):
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, layer, io_backend=io)

    seconds, host_s = clock.time(one, reps)
    emit(rows, ceil, page=page_size, chunks=chunks, what=f"{io} load, one call", gbps=gbps(w.layer_bytes, seconds), host_us=host_s * 1e6)
    seconds, host_s = clock.time(every_layer, max(3, reps // 2))
    emit(rows, ceil, page=page_size, chunks=chunks, what=f"{io} load, {w.layers} layers back to back",
         gbps=gbps(w.layer_bytes * w.layers, seconds), host_us=host_s * 1e6 / w.layers)


if __name__ == "__main__":
    main()
