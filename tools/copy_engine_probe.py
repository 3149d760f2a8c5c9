"""What the copy engines cost the staged io path, apart from the pipeline: the host-side
copies of one per-layer load (allocator-placed pages, as the bench places them) as a
loop of 2-D copies against one cudaMemcpy3DBatchAsync and a batch per chunk, each way
and both ways at once, with the host's cost of each call the path makes
(`--batched-only` stops there); with `--descriptors-only`, only the same copies as
2-D copies against their rows as 1-D copies in cudaMemcpyBatchAsync, for a
page_first_direct and a layer_first host; the same copies on one stream, K and V on two streams,
and round-robin over two or three, timed on the device and on the host; a chunk-by-chunk timeline of one staged
load beside the kernel as it is, at 32 blocks, with cached device-side writes, a
device-to-device copy, a sleep and nothing; then per-layer loads of every io path
issued one at a time from an idle GPU and all layers back to back, as an engine
issues them.  `--chunks`: full chunks before the taper (staged_plan.PIPELINE_CHUNKS).

Run on an NVIDIA host (CUDA >= 12.8 for the batched call): python3 tools/copy_engine_probe.py [--page-sizes 64,16] [--batched-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import time

import numpy as np
import torch
from staged_probe import layer_transfer  # a sibling in tools/, on the path when run as a script

from portable_kv import backends
from portable_kv.bench.measure import Clock, gbps
from portable_kv.bench.sections import ceiling
from portable_kv.bench.staged import StagedWorkload
from portable_kv.bench.workload import Geometry
from portable_kv.io import staged_plan
from portable_kv.io.engine import CopyBatch

OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
PER_THREAD_STREAM = 2  # cudaStreamPerThread: the batched call refuses the legacy default stream
BATCH_FAILIDX_UNTIL = 13000  # 12.8/12.9 take a failIdx argument before the flags; 13.0 dropped it
# cudaMemcpy3DBatchOp (CUDA >= 12.8, 112 bytes): two pointer operands (type, then a union at
# offset 8 whose pointer member is ptr, rowLength, layerHeight, locHint), the extent in
# elements (bytes between pointers), the source access order and flags.
BATCH_OP = np.dtype({
    "names": ["src_type", "src", "src_pitch", "src_height", "dst_type", "dst", "dst_pitch", "dst_height", "width", "height", "depth", "order"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<i4"],
    "offsets": [0, 8, 16, 24, 40, 48, 56, 64, 80, 88, 96, 104],
    "itemsize": 112,
})


def batch_2d(runtime, copies: np.ndarray, stream: int) -> None:
    """One cudaMemcpy3DBatchAsync of 2-D copies (rows: dst, dst_pitch, src, src_pitch, width, height)."""
    ops = np.zeros(len(copies), BATCH_OP)
    ops["src_type"] = ops["dst_type"] = OPERAND_POINTER
    ops["dst"], ops["dst_pitch"], ops["src"], ops["src_pitch"], ops["width"], ops["height"] = copies.T
    ops["src_height"] = ops["dst_height"] = ops["height"]
    ops["depth"], ops["order"] = 1, SRC_ACCESS_ORDER_STREAM
    args = [ctypes.c_size_t(len(ops)), ctypes.c_void_p(ops.ctypes.data)]
    if runtime.version < BATCH_FAILIDX_UNTIL:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    args += [ctypes.c_ulonglong(0), ctypes.c_void_p(stream or PER_THREAD_STREAM)]
    code = runtime.lib.cudaMemcpy3DBatchAsync(*args)
    if code:
        raise RuntimeError(f"cudaMemcpy3DBatchAsync: {runtime.error_name(code)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="64,16")
    parser.add_argument("--chunks", default="4,16", help="comma-separated counts of full chunks before the taper")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--host-memory", default="pinned", choices=("pinned", "registered"))
    parser.add_argument("--device-pages", default="random", choices=("random", "ascending"),
                        help="ascending: the device side of each load in address order (the kernel's writes walk memory in order)")
    parser.add_argument("--timeline-only", action="store_true")
    parser.add_argument("--batched-only", action="store_true", help="only the staged copies as 2-D loops against cudaMemcpy3DBatchAsync")
    parser.add_argument("--tail", help="comma-separated staged_plan.TAIL_BYTES values: only staged loads and backups of a layer_first host at each, alternating")
    parser.add_argument("--taper", help="comma-separated staged_plan.TAPER values, as --tail")
    parser.add_argument("--blocks", help="comma-separated block quotas of the kernel between staging and the KV buffers, as --tail")
    parser.add_argument("--descriptors-only", action="store_true",
                        help="only the staged copies as 2-D loops against 1-D descriptors in cudaMemcpyBatchAsync, page_first_direct and layer_first hosts")
    parser.add_argument("--json")
    args = parser.parse_args()
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
    if args.device_pages == "ascending":
        pages = w.dev_idx.view(-1, page_size)
        w.dev_idx = pages[pages[:, 0].argsort()].reshape(-1)
    for setting in ("tail", "taper", "blocks"):
        if getattr(args, setting):
            with w.host_pool("layer_first", "staged", args.host_memory) as host:
                rows += setting_ab(clock, w, host, page_size, setting, [float(v) for v in getattr(args, setting).split(",")], args.reps, ceil)
    if args.tail or args.taper or args.blocks:
        return rows
    if args.descriptors_only:
        for layout in ("page_first_direct", "layer_first"):
            with w.host_pool(layout, "staged", args.host_memory) as host:
                rows += descriptors(clock, backend, w, host, layout, page_size, args.reps, ceil)
        return rows
    with w.host_pool("page_first_direct", "staged", args.host_memory) as host:
        mover = host._mover("staged")  # noqa: SLF001 -- a probe takes the path apart
        transfer = layer_transfer(host, w)
        for chunks in map(int, args.chunks.split(",")):
            staged_plan.PIPELINE_CHUNKS = chunks
            host._validator.clear()  # noqa: SLF001 -- plans are kept with the validated indices
            transfer = layer_transfer(host, w)
            prepared = mover.prepared(transfer)
            staging = torch.empty(prepared.plan.slot_bytes * len(prepared.plan.chunks), dtype=torch.uint8, device=backend.device)
            ops = []  # every copy of the load, each chunk in its own part of `staging`
            for pair, offset, (hosts, stagings, widths, heights, hps, sps), ends in zip(
                    transfer.pairs, prepared.plan.offsets, prepared.copies, prepared.ends):
                for c in range(len(prepared.plan.chunks)):
                    base = staging.data_ptr() + c * prepared.plan.slot_bytes + offset
                    for i in range(ends[c], ends[c + 1]):
                        ops.append((base + stagings[i], sps[i], pair.host.data_ptr() + hosts[i], hps[i], widths[i], heights[i]))
            k_copies = sum(ends[-1] for ends in prepared.ends[:1])
            nbytes = sum(o[4] * o[5] for o in ops)
            batched(clock, backend, prepared, ops, staging, page_size, ceil, rows, args.reps)
            if page_size == 64:
                enqueue_costs(clock, backend, ops, rows)
            if args.batched_only:
                continue
            stream = torch.cuda.current_stream().cuda_stream

            def loop(ops: list = ops, stream: int = stream) -> None:
                for dst, dp, src, sp, width, height in ops:
                    backend.runtime.memcpy_2d(dst, dp, src, sp, width, height, stream)

            seconds, host_s = clock.time(loop, args.reps)
            emit(rows, ceil, page=page_size, chunks=len(prepared.plan.chunks), what="2-D copy loop", copies=len(ops),
                 gbps=gbps(nbytes, seconds), host_us=host_s * 1e6, host_us_per_copy=host_s * 1e6 / len(ops))
            spreads = (("K and V on 2 streams", [ops[:k_copies], ops[k_copies:]]),
                       ("copies round-robin over 2 streams", [ops[0::2], ops[1::2]]),
                       ("copies round-robin over 3 streams", [ops[0::3], ops[1::3], ops[2::3]]))
            for what, parts in spreads:
                side = [torch.cuda.Stream() for _ in parts]

                def spread_loop(parts: list = parts, side: list = side) -> None:
                    current = torch.cuda.current_stream()
                    for stream_j, part in zip(side, parts):
                        stream_j.wait_stream(current)
                        handle = stream_j.cuda_stream
                        for dst, dp, src, sp, width, height in part:
                            backend.runtime.memcpy_2d(dst, dp, src, sp, width, height, handle)
                    for stream_j in side:
                        current.wait_stream(stream_j)

                seconds, host_s = clock.time(spread_loop, args.reps)
                emit(rows, ceil, page=page_size, chunks=len(prepared.plan.chunks), what=what, copies=len(ops),
                     gbps=gbps(nbytes, seconds), host_us=host_s * 1e6)
            del staging
            timeline(w, host, page_size, len(prepared.plan.chunks))
            if args.timeline_only:
                continue
            for io in ("kernel", "direct", "staged"):
                back_to_back(clock, w, host, io, page_size, len(prepared.plan.chunks), args.reps, ceil, rows)
    return rows


def setting_ab(clock: Clock, w, host, page_size: int, setting: str, values: list[float], reps: int, ceil: dict) -> list[dict]:
    """One staging setting at each value (`tail`: staged_plan.TAIL_BYTES; `taper`: staged_plan.TAPER;
    `blocks`: the block quota of the kernel between staging and the KV buffers): staged
    loads one call and back to back, and all-layer backups, every value twice,
    alternating, so that a drift of the machine shows between rounds."""
    mover = host._mover("staged")  # noqa: SLF001
    rows: list[dict] = []
    for _ in range(2):
        for value in values:
            if setting == "tail":
                staged_plan.TAIL_BYTES = int(value)
            elif setting == "taper":
                staged_plan.TAPER = value
            else:
                mover.kernel.block_quota = int(value)
            host._validator.clear()  # noqa: SLF001 -- plans are kept with the validated indices
            prepared = mover.prepared(layer_transfer(host, w))
            print(f"  {setting} {value}: {len(prepared.plan.chunks)} chunks, {prepared.plan.copy_count} copies", flush=True)
            before = len(rows)
            back_to_back(clock, w, host, "staged", page_size, len(prepared.plan.chunks), reps, ceil, rows)
            backup(clock, w, host, "staged", page_size, reps, ceil, rows)
            for row in rows[before:]:
                row[setting] = value
    return rows


def descriptors(clock: Clock, backend, w, host, layout: str, page_size: int, reps: int, ceil: dict) -> list[dict]:
    """A staged load's host-side copies (one per run and chunk, K and V) as the staged path
    issues them (a loop of 2-D copies on one stream) against the same bytes as 1-D
    descriptors (each 2-D copy's rows) in cudaMemcpyBatchAsync: all in one call on one
    stream, spread over 4 streams as the direct path does, and one call per chunk."""
    runtime = backend.runtime
    mover = host._mover("staged")  # noqa: SLF001
    host._validator.clear()  # noqa: SLF001 -- plans are kept with the validated indices
    transfer = layer_transfer(host, w)
    prepared = mover.prepared(transfer)
    chunks = len(prepared.plan.chunks)
    staging = torch.empty(prepared.plan.slot_bytes * chunks, dtype=torch.uint8, device=backend.device)
    ops, chunk_of_op = [], []
    for pair, offset, (hosts, stagings, widths, heights, hps, sps), ends in zip(
            transfer.pairs, prepared.plan.offsets, prepared.copies, prepared.ends):
        for c in range(chunks):
            base = staging.data_ptr() + c * prepared.plan.slot_bytes + offset
            for i in range(ends[c], ends[c + 1]):
                ops.append((base + stagings[i], sps[i], pair.host.data_ptr() + hosts[i], hps[i], widths[i], heights[i]))
                chunk_of_op.append(c)
    row_dst = np.concatenate([dst + np.arange(h, dtype=np.uint64) * dp for dst, dp, _, _, _, h in ops]).astype(np.uint64)
    row_src = np.concatenate([src + np.arange(h, dtype=np.uint64) * sp for _, _, src, sp, _, h in ops]).astype(np.uint64)
    row_size = np.concatenate([np.full(h, width, np.uint64) for _, _, _, _, width, h in ops])
    row_chunk = np.concatenate([np.full(op[5], c) for op, c in zip(ops, chunk_of_op)])
    nbytes = int(row_size.sum())
    streams = [torch.cuda.Stream() for _ in range(4)]

    def batch(part) -> CopyBatch:
        return CopyBatch(np.ascontiguousarray(row_dst[part]), np.ascontiguousarray(row_src[part]), np.ascontiguousarray(row_size[part]))

    everything = batch(slice(None))
    quarters = [batch(part) for part in np.array_split(np.arange(len(row_size)), 4)]
    per_chunk = [batch(row_chunk == c) for c in range(chunks)]

    def on(used: list, calls: list):
        def run() -> None:
            current = torch.cuda.current_stream()
            for stream in used:
                stream.wait_stream(current)
            for stream, call in zip(itertools.cycle(used), calls):
                call(stream.cuda_stream)
            for stream in used:
                current.wait_stream(stream)
        return run

    def loop_2d(handle: int) -> None:
        for row in ops:
            runtime.memcpy_2d(*row, handle)

    def loop_2d_back(handle: int) -> None:
        for dst, dp, src, sp, width, height in ops:
            runtime.memcpy_2d(src, sp, dst, dp, width, height, handle)

    def back(b: CopyBatch) -> CopyBatch:
        return CopyBatch(b.src, b.dst, b.sizes)

    cases = [("h2d", "2-D copies, a loop on one stream", on(streams[:1], [loop_2d])),
             ("h2d", "1-D descriptors, one batch on one stream", on(streams[:1], [lambda h: runtime.memcpy_batch(everything, h)])),
             ("h2d", "1-D descriptors, a batch on each of 4 streams", on(streams, [lambda h, b=b: runtime.memcpy_batch(b, h) for b in quarters])),
             ("h2d", "1-D descriptors, a batch per chunk on one stream", on(streams[:1], [lambda h: [runtime.memcpy_batch(b, h) for b in per_chunk]]))]
    if len(row_size) <= 4 * len(ops):  # rows few and large: the same copies the other way (a backup's)
        backs = [back(b) for b in per_chunk]
        cases += [("d2h", "2-D copies, a loop on one stream", on(streams[:1], [loop_2d_back])),
                  ("d2h", "1-D descriptors, a batch per chunk on one stream", on(streams[:1], [lambda h: [runtime.memcpy_batch(b, h) for b in backs]]))]
    rows: list[dict] = []
    for direction, what, fn in cases:
        seconds, host_s = clock.time(fn, reps)
        emit(rows, ceil, page=page_size, layout=layout, chunks=chunks, dir=direction, what=f"copies alone, {what}", copies=len(ops),
             descriptors=len(row_size), gbps=gbps(nbytes, seconds), host_us=host_s * 1e6)
    return rows


def batched(clock: Clock, backend, prepared, ops: list, staging: torch.Tensor, page_size: int, ceil: dict, rows: list[dict], reps: int) -> None:
    """The load's copies on a side stream as a loop of 2-D copies, as one batched call
    (cudaMemcpy3DBatchAsync) and as one batched call per chunk, each way; the batch's
    bytes against the loop's; then a load's copies and a backup's at once, on two streams."""
    runtime = backend.runtime
    chunks = len(prepared.plan.chunks)
    table = np.array(ops, dtype=np.uint64)  # dst, dst_pitch, src, src_pitch, width, height: host to staging
    back = table[:, [2, 3, 0, 1, 4, 5]].copy()  # staging to host
    chunk_of = (table[:, 0] - staging.data_ptr()) // prepared.plan.slot_bytes  # each chunk has its own part of `staging`
    per_chunk = [np.flatnonzero(chunk_of == c) for c in range(chunks)]
    nbytes = int((table[:, 4] * table[:, 5]).sum())
    load_stream, backup_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def on(stream, fn):
        def run() -> None:
            stream.wait_stream(torch.cuda.current_stream())
            fn(stream.cuda_stream)
            torch.cuda.current_stream().wait_stream(stream)
        return run

    def loop(t):
        return lambda handle: [runtime.memcpy_2d(*row, handle) for row in t.tolist()]

    def one_batch(t):
        return lambda handle: batch_2d(runtime, t, handle)

    def chunked(t):
        return lambda handle: [batch_2d(runtime, t[part], handle) for part in per_chunk]

    print(f"  batched 2-D copies: runtime {runtime.version}", flush=True)
    try:
        staging.zero_()
        on(load_stream, loop(table))()
        expect = staging.clone()
        staging.zero_()
        on(load_stream, one_batch(table))()
        torch.cuda.synchronize()
        print(f"  one 3-D batch: bytes equal to the loop's: {torch.equal(staging, expect)}", flush=True)
    except RuntimeError as exc:
        print(f"  one 3-D batch refused: {exc}", flush=True)
        return
    for direction, t, stream in (("h2d", table, load_stream), ("d2h", back, backup_stream)):
        for what, fn in (("2-D copy loop", loop(t)), ("one 3-D batch", one_batch(t)), ("a 3-D batch per chunk", chunked(t))):
            seconds, host_s = clock.time(on(stream, fn), reps)
            emit(rows, ceil, page=page_size, chunks=chunks, dir=direction, what=f"copies alone, {what}", copies=len(t),
                 gbps=gbps(nbytes, seconds), host_us=host_s * 1e6)
    half, largest = len(table) // 2, int(np.argmax(table[:, 4] * table[:, 5]))
    cases = (("2-D copy loops", loop, table[:half], back[half:]), ("3-D batches", one_batch, table[:half], back[half:]),
             # the one largest copy each way: the link with no per-copy cost
             ("the largest copy alone", loop, table[largest:largest + 1], back[largest:largest + 1]))
    for what, make, load, backup in cases:
        loads, backups = make(load), make(backup)

        def both(a=loads, b=backups) -> None:
            current = torch.cuda.current_stream()
            load_stream.wait_stream(current)
            backup_stream.wait_stream(current)
            a(load_stream.cuda_stream)
            b(backup_stream.cuda_stream)
            current.wait_stream(load_stream)
            current.wait_stream(backup_stream)
        moved = int((load[:, 4] * load[:, 5]).sum() + (backup[:, 4] * backup[:, 5]).sum())
        seconds, host_s = clock.time(both, reps)
        emit(rows, ceil, page=page_size, chunks=chunks, dir="both", what=f"copies alone both ways, {what}", copies=len(load) + len(backup),
             gbps=gbps(moved, seconds), host_us=host_s * 1e6)


def enqueue_costs(clock: Clock, backend, ops: list, rows: list[dict]) -> None:
    """Host microseconds each call the staged path makes costs, issued back to back: a 2-D
    copy (4 rows of a load's) on the legacy default stream and on a side stream, four of
    them as one 3-D batch, an event recorded on one stream and waited on by another through
    torch and through the runtime's own calls."""
    runtime, lib = backend.runtime, backend.runtime.lib
    dst, dp, src, sp, width, height = ops[0]
    one = (dst, dp, src, sp, width, min(height, 4))
    side = torch.cuda.Stream()
    current = torch.cuda.current_stream()
    event = torch.cuda.Event()
    event.record(side)  # torch creates the event at its first record
    four = np.array([one] * 4, dtype=np.uint64)
    record, wait = lib.cudaEventRecord, lib.cudaStreamWaitEvent
    handle, side_handle, current_handle = ctypes.c_void_p(event.cuda_event), ctypes.c_void_p(side.cuda_stream), ctypes.c_void_p(current.cuda_stream)

    def torch_events() -> None:
        event.record(side)
        current.wait_event(event)

    def runtime_events() -> None:
        record(handle, side_handle)
        wait(current_handle, handle, 0)

    costs = {"2-D copy, legacy default stream": lambda: runtime.memcpy_2d(*one, 0),
             "2-D copy, side stream": lambda: runtime.memcpy_2d(*one, side.cuda_stream),
             "4 2-D copies, side stream": lambda: [runtime.memcpy_2d(*one, side.cuda_stream) for _ in range(4)],
             "4 2-D copies as one 3-D batch, side stream": lambda: batch_2d(runtime, four, side.cuda_stream),
             "event record + wait, torch": torch_events,
             "event record + wait, cudaEventRecord + cudaStreamWaitEvent": runtime_events}
    for what, fn in costs.items():
        us = clock.host_us(fn, 2000, 50)
        rows.append({"what": f"host cost: {what}", "host_us": us})
        print(f"  host cost: {what}: {us:.1f} us", flush=True)


def timeline(w, host, page_size: int, chunks: int) -> None:
    """One staged per-layer load with an event before and after each chunk's copies (on the
    copy stream) and each chunk's kernel (on the current stream): where the time goes.  The
    kernel as it is (device-side writes streamed), at 32 blocks, with the kernel path's
    cached device-side writes, and replaced by a device-to-device copy of its bytes, by a
    sleep of about its length, and by nothing: what beside the copies slows them."""
    mover = host._mover("staged")  # noqa: SLF001
    copy, kernel = mover._copy, mover._kernel  # noqa: SLF001
    marks: list[tuple[str, int, object, object]] = []

    def timed(name: str, fn, stream_of):
        def wrapper(transfer, prepared, chunk, slot, *rest):
            stream = stream_of(*rest)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            fn(transfer, prepared, chunk, slot, *rest)
            end.record(stream)
            marks.append((name, chunk, begin, end))
        return wrapper

    cycles = int(1.9e9 * w.layer_bytes / chunks / 70e9)  # the kernel's time at ~70 GB/s
    def wide(*a) -> None:
        mover.kernel.block_quota = 32
        kernel(*a)
        mover.kernel.block_quota = 8

    chunk_bytes = int(w.layer_bytes / chunks)
    scratch = torch.empty(2 * chunk_bytes, dtype=torch.uint8, device=w.dev.device)

    def churn(*a) -> None:  # as many bytes through L2 as the kernel moves, on every SM, briefly
        scratch[:chunk_bytes].copy_(scratch[chunk_bytes:])

    def cached_stores(*a) -> None:  # the kernel path's device-side writes, which stay in L2
        mover.kernel.stream_device = False
        kernel(*a)
        mover.kernel.stream_device = True

    kernels = {"kernel": kernel, "kernel at 32 blocks": wide, "kernel, cached device stores": cached_stores,
               "device-to-device copy (torch)": churn, "sleep": lambda *a: torch.cuda._sleep(cycles), "none": lambda *a: None}
    mover._copy = timed("copy", copy, lambda handle: torch.cuda.ExternalStream(handle))  # noqa: SLF001
    for variant, fn in kernels.items():
        mover._kernel = timed(variant, fn, lambda: torch.cuda.current_stream())  # noqa: SLF001
        for _ in range(2):
            marks.clear()
            torch.cuda.synchronize()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            t0 = time.perf_counter()
            host.load_to_device_per_layer(w.dev, w.host_idx, w.dev_idx, 0, io_backend="staged")
            host_us = (time.perf_counter() - t0) * 1e6
            last = torch.cuda.Event(enable_timing=True)
            last.record()
            torch.cuda.synchronize()
        copy_us = [b.elapsed_time(e) * 1e3 for name, _, b, e in marks if name == "copy"]
        first = min(origin.elapsed_time(b) for name, _, b, e in marks if name == "copy") * 1e3
        print(f"  timeline, page {page_size}, {chunks} chunks, {variant}: host {host_us:.0f} us, device {origin.elapsed_time(last) * 1e3:.0f} us, "
              f"first copy at {first:.0f} us, copies {w.layer_bytes / sum(copy_us) / 1e3:.1f} GB/s", flush=True)
        if variant == "kernel":
            for name, chunk, begin, end in marks:
                print(f"    {name:6s} chunk {chunk:2d}  {origin.elapsed_time(begin) * 1e3:8.1f} .. {origin.elapsed_time(end) * 1e3:8.1f} us", flush=True)
    mover._copy, mover._kernel = copy, kernel  # noqa: SLF001


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


def backup(clock: Clock, w, host, io: str, page_size: int, reps: int, ceil: dict, rows: list[dict]) -> None:
    """An all-layer backup."""
    def all_layers() -> None:
        host.backup_from_device_all_layer(w.dev, w.host_idx, w.dev_idx, io_backend=io)

    seconds, host_s = clock.time(all_layers, max(3, reps // 3), warmup=1)
    emit(rows, ceil, page=page_size, what=f"{io} backup, all layers", dir="d2h", gbps=gbps(w.layer_bytes * w.layers, seconds), host_us=host_s * 1e6)


if __name__ == "__main__":
    main()
