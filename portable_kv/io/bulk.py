"""The `bulk` io path: a few kernel blocks move a transfer's pieces through shared memory.

The `kernel` path keeps ~100 KB of 16-byte loads in flight with 16 blocks of 512
threads, and the model loses those SMs while it runs (11-26% of a matmul beside
it on the H200).  One thread can keep as much in flight with bulk asynchronous
copies (cp.async.bulk, Hopper's TMA): a block of one warp fetches a whole stage
of pieces into shared memory with one barrier and stores it out, so 2-4 blocks
carry the link.  The plan (bulk_plan.py) is made on the host once per index
pair; a call sets its layer and launches.  Where bulk copies do not exist
(before sm_90; gfx942), the same plan is walked with wide non-temporal vector
copies (kv_bulk.h).

Transfers the plan cannot carry (rows or strides not 16-byte aligned; indices
the pool asked not to read on the host) go to the kernel path.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Protocol

import numpy as np
import torch

from ..transfer import Transfer
from .bulk_plan import STAGE_BYTES, BulkPlan, bulk_plan, why_not_bulk
from .engine import CopyBatch, CopyEngine
from .kernel_args import MAX_JOBS, LayerTable, LayerTables
from .mover import Mover, MoverFactory, share_flag

# A block of one warp moved ~12.5 GB/s from host memory with 128 KiB in flight on the H200
# (32 KiB stages, 4 buffers); 4 such blocks reached 50.6 GB/s, 93% of the link (SM-issued
# 128-byte reads, bulk copies included, stop near 51.5: docs/DESIGN.md); 2 blocks 35, 8 no more.
BULK_BLOCKS = 4
STAGE_BUFFERS = 4  # stage buffers per block, each STAGE_BYTES: 128 KiB of shared memory in flight
LAUNCHES_KEPT = 8  # per thread: a load and a backup interleaved, per-layer and all-layer, and spares


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
    def current_stream(self) -> int: ...
    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None: ...


class BulkLauncher(Protocol):
    """A GPU backend as the bulk mover launches through it (backends/gpu.py)."""

    device: torch.device
    runtime: BulkRuntime
    layer_tables: LayerTables
    bulk_threads: int
    bulk_copies: bool  # stages move through shared memory (sm_90); else the vector walker, which uses none

    def bulk_kernel(self, shared_bytes: int) -> int: ...


def device_array(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A plan array on the device, copied in the current stream's order from page-locked memory
    (from pageable memory the copy would wait for the stream: indices.py's rule)."""
    values = torch.from_numpy(values)
    if device.type == "cpu":
        return values.clone()
    return values.pin_memory().to(device, non_blocking=True)


class PreparedBulk:
    """A bulk launch ready to go but for its layer, made for one transfer's pairs and indices."""

    def __init__(self, transfer: Transfer, plan: BulkPlan, tables: list[LayerTable], device: torch.device, blocks: int,
                 buffers: int, shared: bool) -> None:
        self._pairs = tuple(weakref.ref(p) for p in transfer.pairs)
        self._indices = weakref.ref(transfer.indices)
        # The device copies of the plan, and the layer tables they point into, live as long as the launch.
        self.arrays = [device_array(a, device) for a in (plan.pieces, plan.stage_first, plan.stage_bytes)]
        self.tables = tables
        args = self.args = BulkArgs()
        for job, (pair, table) in enumerate(zip(transfer.pairs, tables)):
            args.job[job].host_base = pair.host.data_ptr()
            args.job[job].device_layers = table.addresses.data_ptr()
            args.job[job].host_layer = pair.strides.layer
        args.pieces, args.stage_first, args.stage_bytes = (a.data_ptr() for a in self.arrays)
        args.stages, args.layer_begin, args.layers = plan.stages, transfer.layers.start, len(transfer.layers)
        args.to_device, args.buffer_bytes, args.buffers = transfer.to_device, plan.buffer_bytes, buffers
        self.grid = max(1, min(blocks, plan.stages * len(transfer.layers)))
        self.shared_bytes = buffers * plan.buffer_bytes if shared else 0
        self._param_array = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params = ctypes.addressof(self._param_array)
        self.setting: tuple = ()

    def made_for(self, transfer: Transfer) -> bool:
        return (self._indices() is transfer.indices and len(self._pairs) == len(transfer.pairs)
                and all(ref() is pair for ref, pair in zip(self._pairs, transfer.pairs)))


class BulkMover(Mover):
    """The bulk kernel for one host pool, falling back to the kernel path where it cannot carry a
    transfer (`fallback`).  `last_path` says which one the latest call took, and `last_reason` why."""

    io = "bulk"

    def __init__(self, backend: BulkLauncher, fallback: MoverFactory, blocks: int = BULK_BLOCKS,
                 buffers: int = STAGE_BUFFERS, stage_bytes: int = STAGE_BYTES) -> None:
        super().__init__(backend.device)
        self.backend, self.blocks, self.buffers, self.stage_bytes = backend, blocks, buffers, stage_bytes
        self.fallback = fallback()
        self.parts = (self.fallback,)
        share_flag(self.bad_index, *self.parts)
        self.last_path, self.last_reason = "", ""
        self._local = threading.local()

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        local = self._local
        launch: PreparedBulk | None = getattr(local, "last", None)
        runtime = self.backend.runtime
        if launch is None:
            runtime.bind_thread()
            local.kept, local.last = {}, None
        stream = runtime.current_stream()
        setting = (transfer.to_device, len(transfer.layers), stream)
        if launch is None or launch.setting != setting or not launch.made_for(transfer):
            launch = self._launch(transfer, setting)
            if launch is None:
                self.fallback.move(transfer)
                self.last_path = "kernel"
                return
            local.last = launch
        launch.args.layer_begin = transfer.layers.start
        runtime.launch(self.backend.bulk_kernel(launch.shared_bytes), launch.grid, self.backend.bulk_threads, launch.params,
                       stream, launch.shared_bytes)
        self.last_path = "bulk"

    def _launch(self, transfer: Transfer, setting: tuple) -> PreparedBulk | None:
        kept: dict[tuple, PreparedBulk] = self._local.kept
        key = (id(transfer.indices), *map(id, transfer.pairs), *setting)
        launch = kept.get(key)
        if launch is not None and launch.made_for(transfer):
            return launch
        reason = why_not_bulk(transfer) if transfer.indices.host_readable else "indices the pool does not read on the host"
        if reason is not None:
            self.last_reason = reason
            return None
        plan = bulk_plan(transfer, self.stage_bytes)
        if plan.skipped:
            self.bad_index.set()
        if not plan.stages:
            return None
        tables = [self.backend.layer_tables.of(p.device) for p in transfer.pairs]
        launch = PreparedBulk(transfer, plan, tables, self.backend.device, self.blocks, self.buffers, self.backend.bulk_copies)
        launch.setting = setting
        kept.pop(key, None)
        kept[key] = launch
        while len(kept) > LAUNCHES_KEPT:
            del kept[next(iter(kept))]
        self.last_reason = ""
        return launch

    def close(self) -> None:
        self.fallback.close()
        self._local = threading.local()


class PlanWalker(Mover):
    """The bulk kernel's model on the host: the same plan, each piece of each layer one memmove
    at the address pkv_bulk_addresses computes, so the planner runs bit-exact in CI."""

    io = "bulk"

    def __init__(self, engine: CopyEngine, stage_bytes: int = STAGE_BYTES) -> None:
        super().__init__(engine.device)
        self.engine, self.stage_bytes = engine, stage_bytes
        self.last_path, self.last_reason = "bulk", ""

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        plan = bulk_plan(transfer, self.stage_bytes)
        if plan.skipped:
            self.bad_index.set()
        host, device, size, _, job = plan.pieces.T
        for layer in transfer.layers:
            host_addr = np.array([p.host.data_ptr() + layer * p.strides.layer for p in transfer.pairs], np.int64)[job] + host
            device_addr = np.array([p.device[layer].data_ptr() for p in transfer.pairs], np.int64)[job] + device
            dst, src = (device_addr, host_addr) if transfer.to_device else (host_addr, device_addr)
            self.engine.memcpy_batch(CopyBatch(dst.view(np.uint64), src.view(np.uint64), size.view(np.uint64)), 0)

    def close(self) -> None:
        """Nothing kept: plans live with the indices."""
