"""A GPU backend whose 'device' is the CPU and whose kernels are Python models of
kernels_common/kv_copy.h and kv_bulk.h: it runs the real argument packing of io/kernel_args.py
(struct layout, access width, vector counts, layer tables) through the real
KernelMover and BulkMover, and executes the copy the kernel would do, vector by vector, on raw
addresses.  Its copy engines are memmove over the real plans, row by row for 2-D
copies, each done when its call returns (no streams to order)."""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from portable_kv.backends.cuda import KERNEL_SOURCE
from portable_kv.backends.gpu import GpuBackend
from portable_kv.backends.jit import KernelSpec
from portable_kv.backends.runtime import DeviceRuntime
from portable_kv.io.bulk import BulkArgs
from portable_kv.io.bulk_pieces import PIECE_FIELDS
from portable_kv.io.copier import CopyBatch
from portable_kv.io.kernel_args import KERNEL_WIDTHS, CopyArgs
from portable_kv.io.mover import Mover
from portable_kv.io.streams import InlineStreams, Streams


def pkv_div(n: int, magic: int, shift: int) -> int:
    """kv_copy.h's pkv_div: a 64-bit multiply-high, an add and a shift."""
    return (((n * magic) >> 64) + n) % (1 << 64) >> shift


def run_kernel_model(params: int, width: int) -> None:
    """What every thread of pkv_copy_<width> does, for every vector of the flat space."""
    args = CopyArgs.from_address(ctypes.c_void_p.from_address(params).value)
    host_idx = np.ctypeslib.as_array((ctypes.c_int64 * args.tokens).from_address(args.host_indices))
    dev_idx = np.ctypeslib.as_array((ctypes.c_int64 * args.tokens).from_address(args.device_indices))
    for v in range(args.total_vecs):
        t = args.job[1 if v >= args.job[1].vec_begin else 0]
        per_chunk = t.chunk_bytes // width
        local = v - t.vec_begin
        item = pkv_div(local, t.chunk_vecs_magic, t.chunk_vecs_shift)
        byte = (local - item * per_chunk) * width
        token_item = pkv_div(item, t.groups_magic, t.groups_shift)
        group = item - token_item * t.groups
        layer = pkv_div(token_item, args.tokens_magic, args.tokens_shift)
        i = token_item - layer * args.tokens
        layer += args.layer_begin
        ht, dt = int(host_idx[i]), int(dev_idx[i])
        if not (0 <= ht < t.host_tokens and 0 <= dt < t.device_tokens):
            ctypes.c_int32.from_address(args.error_flag).value = 1
            continue
        page = pkv_div(ht, args.page_magic, args.page_shift)
        host = t.host_base + page * t.host_page + (ht - page * args.page_size) * t.host_token + layer * t.host_layer + group * t.host_group + byte
        base = ctypes.c_uint64.from_address(t.device_layers + 8 * layer).value
        dev = base + dt * t.device_token + group * t.device_group + byte
        src, dst = (host, dev) if args.to_device else (dev, host)
        ctypes.memmove(dst, src, width)


BULK_ENTRY = 0xB  # the simulated entry point of pkv_bulk


def run_bulk_model(params: int) -> None:
    """What pkv_bulk does: every piece of every stage of every layer, at pkv_bulk_addresses."""
    args = BulkArgs.from_address(ctypes.c_void_p.from_address(params).value)
    first = np.ctypeslib.as_array((ctypes.c_int64 * (args.stages + 1)).from_address(args.stage_first))
    pieces = np.ctypeslib.as_array((ctypes.c_int64 * (int(first[-1]) * PIECE_FIELDS)).from_address(args.pieces)).reshape(-1, PIECE_FIELDS)
    stage_bytes = np.ctypeslib.as_array((ctypes.c_int64 * args.stages).from_address(args.stage_bytes))
    for unit in range(args.layers * args.stages):
        layer, stage = args.layer_begin + unit // args.stages, unit % args.stages
        stage_pieces = pieces[first[stage]:first[stage + 1]]
        assert stage_pieces[:, 2].sum() == stage_bytes[stage] and (stage_pieces[:, 2] % 16 == 0).all()
        assert (stage_pieces[:, 3] + stage_pieces[:, 2]).max() <= args.buffer_bytes, "a stage overflows its buffer"
        for host_off, dev_off, size, _, job in stage_pieces.tolist():
            j = args.job[job]
            host = j.host_base + host_off + layer * j.host_layer
            dev = ctypes.c_uint64.from_address(j.device_layers + 8 * layer).value + dev_off
            src, dst = (host, dev) if args.to_device else (dev, host)
            ctypes.memmove(dst, src, size)


class SimulatedRuntime(DeviceRuntime):
    """A runtime with no library: launches run the kernel model, copies are memmove."""

    prefix = "sim"
    code_suffix = "cubin"
    kernel_source = KERNEL_SOURCE
    batch_min_version = 0
    bulk_threads = 32
    bulk_blocks = 4
    one_call_copy_bytes = 1 << 20  # as cuda's

    def __init__(self) -> None:
        self.launches: list[tuple[int, int, int]] = []  # (width or BULK_ENTRY, grid, block)
        self.registered: list[tuple[int, int]] = []
        self.copies_2d: list[tuple[int, int, int, int, int, int]] = []  # (dst, dst_pitch, src, src_pitch, width, height)
        super().__init__(_VersionOnly(), 0)
        self.device = torch.device("cpu")
        self.has_batch = True  # batch_call below

    import_bindings = staticmethod(lambda: (None, None))  # no vendor binding: nothing is compiled

    def arch(self) -> str:
        return "model"

    def compiler(self) -> str:
        return "python"

    def compile(self, spec: KernelSpec) -> bytes:
        return b""

    def code_object(self) -> bytes:
        return b""  # the model needs none, and the kernel cache stays untouched

    def load(self, image: bytes) -> dict[int, int]:
        return {w: w for w in KERNEL_WIDTHS}

    def function(self, name: str) -> int:
        assert name == "pkv_bulk"
        return BULK_ENTRY

    def allow_shared(self, function: int, nbytes: int) -> None:
        raise AssertionError("the simulated bulk kernel walks its plan with vectors: no shared memory")

    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int, shared_bytes: int = 0) -> None:
        self.launches.append((kernel, grid, block))
        if kernel == BULK_ENTRY:
            run_bulk_model(params)
        else:
            run_kernel_model(params, kernel)

    def batch_call(self, batch: CopyBatch, stream: int) -> int:
        for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
            ctypes.memmove(dst, src, size)
        return 0

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        self.copies_2d.append((dst, dst_pitch, src, src_pitch, width, height))
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)

    def current_stream(self) -> int:
        return 0

    def streams(self) -> Streams:
        return InlineStreams(self.current_stream)

    def register_host(self, address: int, nbytes: int) -> int:
        self.registered.append((address, nbytes))
        return address

    def unregister_host(self, address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != address]

    def _bind(self) -> None:
        pass

    def version_text(self) -> str:
        return "model"


class _VersionOnly:
    """The one library symbol DeviceRuntime calls when it is built."""

    @staticmethod
    def simRuntimeGetVersion(version) -> int:  # noqa: N802 -- the runtime library's symbol name
        version._obj.value = 1
        return 0


class SimulatedGpuBackend(GpuBackend):
    name = "simulated"
    vendor = "cpu"

    def __init__(self) -> None:
        super().__init__(SimulatedRuntime())
        # Every mover handed out, newest last; weakly, so that a dropped pool's mover goes.
        self.created: list[weakref.ref[Mover]] = []

    def mover(self, io: str, context=None) -> Mover:
        mover = super().mover(io, context)
        self.created.append(weakref.ref(mover))
        return mover

    @classmethod
    def unavailable_reason(cls):
        return None

    @property
    def offers_bulk(self) -> bool:
        return True  # the vector walker's model: the real BulkMover, plan and launch arguments

    def synchronize(self) -> None:
        pass
