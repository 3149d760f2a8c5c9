"""A GPU backend whose 'device' is the CPU and whose kernel is a Python model of
kernels_common/kv_copy.h: it runs the real argument packing of backends/gpu.py
(struct layout, access width, vector counts, layer tables) and executes the
copy the kernel would do, vector by vector, on raw addresses."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from portable_kv.backends.cuda import KERNEL_SOURCE
from portable_kv.backends.gpu import KERNEL_WIDTHS, CopyArgs, GpuBackend
from portable_kv.plan import CopyBatch


def run_kernel_model(params: int, width: int) -> None:
    """What every thread of pkv_copy_<width> does, for every vector of the flat space."""
    args = CopyArgs.from_address(ctypes.c_void_p.from_address(params).value)
    host_idx = np.ctypeslib.as_array((ctypes.c_int64 * args.tokens).from_address(args.host_indices))
    dev_idx = np.ctypeslib.as_array((ctypes.c_int64 * args.tokens).from_address(args.device_indices))
    for v in range(args.total_vecs):
        t = args.job[1 if v >= args.job[1].vec_begin else 0]
        per_chunk = t.chunk_bytes // width
        local = v - t.vec_begin
        item, byte = divmod(local, per_chunk)
        byte *= width
        item, group = divmod(item, t.groups)
        layer, i = divmod(item, args.tokens)
        layer += args.layer_begin
        ht, dt = int(host_idx[i]), int(dev_idx[i])
        if not (0 <= ht < t.host_tokens and 0 <= dt < t.device_tokens):
            ctypes.c_int32.from_address(args.error_flag).value = 1
            continue
        host = t.host_base + (ht // args.page_size) * t.host_page + (ht % args.page_size) * t.host_token + layer * t.host_layer + group * t.host_group + byte
        base = ctypes.c_uint64.from_address(t.device_layers + 8 * layer).value
        dev = base + dt * t.device_token + group * t.device_group + byte
        src, dst = (host, dev) if args.to_device else (dev, host)
        ctypes.memmove(dst, src, width)


class SimulatedGpuBackend(GpuBackend):
    name = "simulated"
    vendor = "cpu"
    default_block_quota = 16
    vendor_kernel = KERNEL_SOURCE
    code_suffix = "cubin"

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[int, int, int]] = []  # (width, grid, block)

    @classmethod
    def unavailable_reason(cls):
        return None

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def arch(self) -> str:
        return "model"

    def compiler_version(self) -> str:
        return "python"

    def compile(self, arch: str) -> bytes:
        return b""

    def load(self, image: bytes) -> dict[int, object]:
        return {w: w for w in KERNEL_WIDTHS}

    def launch(self, kernel, grid: int, block: int, params: int, stream: int) -> None:
        self.launches.append((kernel, grid, block))
        run_kernel_model(params, kernel)

    def memcpy_batch(self, batch: CopyBatch, stream: int) -> None:
        for dst, src, size in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist()):
            ctypes.memmove(dst, src, size)

    def stream(self) -> int:
        return 0

    def code_object(self) -> bytes:
        return b""

    def synchronize(self) -> None:
        pass
