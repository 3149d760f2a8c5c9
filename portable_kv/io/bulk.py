"""The `bulk` io path: a few kernel blocks move a transfer's pieces through shared memory.

The `kernel` path keeps ~100 KB of 16-byte loads in flight with 16 blocks of 512
threads, and the model loses those SMs while it runs (11-26% of a matmul beside
it on the H200).  One thread can keep as much in flight with bulk asynchronous
copies (cp.async.bulk, Hopper's TMA): a block of one warp fetches a whole stage
of pieces into shared memory with one barrier and stores it out, so 2-4 blocks
carry the link.  The piece list (bulk_pieces.py) is made on the host once per
plan and direction; a call sets its layer and launches.  Where bulk copies do not
exist (before sm_90; gfx942), the same pieces are walked with wide non-temporal
vector copies (kv_bulk.h).

Transfers the pieces cannot carry (rows or strides not 16-byte aligned; indices
the pool asked not to read on the host) go to the kernel path.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol

import numpy as np
import torch

from ..transfer import Transfer
from .bulk_pieces import STAGE_BYTES, BulkPieces, bulk_pieces, why_not_bulk
from .copier import Copier, CopyBatch
from .kernel_args import MAX_JOBS
from .mover import Launch, Mover
from .streams import MadeOn, Streams

# A block of one warp moved ~12.5 GB/s from host memory with 128 KiB in flight on the H200
# (32 KiB stages, 4 buffers); 4 such blocks reached 50.6 GB/s, 93% of the link (SM-issued
# 128-byte reads, bulk copies included, stop near 51.5: docs/DESIGN.md); 2 blocks 35, 8 no more.
BULK_BLOCKS = 4
STAGE_BUFFERS = 4  # stage buffers per block, each STAGE_BYTES: 128 KiB of shared memory in flight


class BulkJob(ctypes.Structure):
    """Mirror of PkvBulkJob (kernels_common/kv_bulk.h)."""

    _fields_ = [("host_base", ctypes.c_uint64), ("device_layers", ctypes.c_uint64), ("host_layer", ctypes.c_int64)]


class BulkArgs(ctypes.Structure):
    """Mirror of PkvBulkArgs: the bulk kernel's one by-value parameter."""

    _fields_ = [
        ("job", BulkJob * MAX_JOBS),
        ("pieces", ctypes.c_uint64),
        ("stage_first", ctypes.c_uint64),
        ("stage_bytes", ctypes.c_uint64),
        ("stages", ctypes.c_int64),
        ("layer_begin", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("to_device", ctypes.c_int64),
        ("buffer_bytes", ctypes.c_int64),
        ("buffers", ctypes.c_int64),
    ]


class BulkRuntime(Protocol):
    def bind_thread(self) -> None: ...
    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None: ...
    def streams(self) -> Streams: ...


class BulkLauncher(Protocol):
    """A GPU backend as the bulk mover launches through it (backends/gpu.py)."""

    device: torch.device
    runtime: BulkRuntime
    bulk_threads: int
    bulk_copies: bool  # stages move through shared memory (sm_90); else the vector walker, which uses none

    def bulk_kernel(self, shared_bytes: int) -> int: ...


def device_array(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A piece-list array on the device, copied in the current stream's order from page-locked memory
    (from pageable memory the copy would wait for the stream: indices.py's rule)."""
    values = torch.from_numpy(values)
    if device.type == "cpu":
        return values.clone()
    return values.pin_memory().to(device, non_blocking=True)


class BulkLaunch(Launch):
    """The bulk kernel's arguments and device piece list for one transfer: a call sets the
    layer and launches."""

    path = "bulk"

    def __init__(self, mover: BulkMover, transfer: Transfer, pieces: BulkPieces, stream: int | None) -> None:
        backend = mover.backend
        self.backend, self.runtime = backend, backend.runtime
        # The piece list on the device, copied on this stream; another waits for it once.
        self.arrays = [device_array(a, backend.device) for a in (pieces.pieces, pieces.stage_first, pieces.stage_bytes)]
        self.made = MadeOn(mover.streams, stream)
        self.tables = [p.layer_table for p in transfer.pairs]  # what the arguments point into
        args = self.args = BulkArgs()
        for job, (pair, table) in enumerate(zip(transfer.pairs, self.tables)):
            args.job[job].host_base = pair.host.data_ptr()
            args.job[job].device_layers = table.addresses.data_ptr()
            args.job[job].host_layer = pair.strides.layer
        args.pieces, args.stage_first, args.stage_bytes = (a.data_ptr() for a in self.arrays)
        args.stages, args.layer_begin, args.layers = pieces.stages, transfer.layers.start, len(transfer.layers)
        args.to_device, args.buffer_bytes, args.buffers = transfer.to_device, pieces.buffer_bytes, mover.buffers
        self.grid = max(1, min(mover.blocks, pieces.stages * len(transfer.layers)))
        self.shared_bytes = mover.buffers * pieces.buffer_bytes if backend.bulk_copies else 0
        self.kernel = backend.bulk_kernel(self.shared_bytes)
        self._param_array = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params = ctypes.addressof(self._param_array)
        self.lock = threading.Lock()

    def run(self, layers: range, stream: int | None) -> None:
        self.runtime.bind_thread()
        self.made.order(stream)
        with self.lock:  # one struct per launch, as KernelLaunch's
            self.args.layer_begin = layers.start
            self.runtime.launch(self.kernel, self.grid, self.backend.bulk_threads, self.params, stream, self.shared_bytes)


class NothingToMove(Launch):
    """A transfer whose every token was outside a pool: each call raises the flag."""

    path = "bulk"

    def __init__(self, transfer: Transfer) -> None:
        self.flag = transfer.flag

    def run(self, layers: range, stream: int | None) -> None:
        self.flag.set()


class BulkMover(Mover):
    """The bulk kernel for one host pool, handing to the kernel path (`fallback`) what it
    cannot carry, with the reason."""

    io = "bulk"

    def __init__(self, backend: BulkLauncher, fallback: Mover, blocks: int = BULK_BLOCKS,
                 buffers: int = STAGE_BUFFERS, stage_bytes: int = STAGE_BYTES) -> None:
        self.backend, self.blocks, self.buffers, self.stage_bytes = backend, blocks, buffers, stage_bytes
        self.fallback = fallback
        self.streams = backend.runtime.streams()

    def build(self, transfer: Transfer) -> Launch:
        reason = why_not_bulk(transfer) if transfer.indices.host_readable else "indices the pool does not read on the host"
        if reason is not None:
            launch = self.fallback.build(transfer)
            launch.reason = reason
            return launch
        pieces = bulk_pieces(transfer, self.stage_bytes)
        if not pieces.stages:
            return NothingToMove(transfer)
        if pieces.skipped:
            transfer.flag.set()
        self.backend.runtime.bind_thread()
        return BulkLaunch(self, transfer, pieces, self.streams.current())


class WalkerLaunch(Launch):
    """The bulk kernel's model on the host: the same pieces, each piece of each layer one
    memmove at the address pkv_bulk_addresses computes, so the planner runs bit-exact in CI."""

    path = "bulk"

    def __init__(self, copier: Copier, transfer: Transfer, pieces: BulkPieces) -> None:
        self.copier, self.transfer, self.pieces = copier, transfer, pieces

    def run(self, layers: range, stream: int | None) -> None:
        transfer = self.transfer
        if self.pieces.skipped:
            transfer.flag.set()
        host, device, size, _, job = self.pieces.pieces.T
        for layer in layers:
            host_addr = np.array([p.host.data_ptr() + layer * p.strides.layer for p in transfer.pairs], np.int64)[job] + host
            device_addr = np.array([p.device[layer].data_ptr() for p in transfer.pairs], np.int64)[job] + device
            dst, src = (device_addr, host_addr) if transfer.to_device else (host_addr, device_addr)
            self.copier.memcpy_batch(CopyBatch(dst.view(np.uint64), src.view(np.uint64), size.view(np.uint64)), 0)


class PieceWalker(Mover):
    """The bulk io path on the cpu backend: WalkerLaunch for every transfer."""

    io = "bulk"

    def __init__(self, copier: Copier, stage_bytes: int = STAGE_BYTES) -> None:
        self.copier, self.stage_bytes = copier, stage_bytes

    def build(self, transfer: Transfer) -> Launch:
        return WalkerLaunch(self.copier, transfer, bulk_pieces(transfer, self.stage_bytes))
