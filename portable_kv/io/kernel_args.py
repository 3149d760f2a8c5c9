"""What a copy kernel is given: the ctypes mirrors of kv_copy.h's structs, the job templates
and filled arguments of one transfer, the access width and the grid.  The C kernels take
the structs; the Triton kernel takes the same numbers as scalars.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from ..transfer import LayerTable, TensorPair, Transfer

# Tensor jobs in one launch (PkvCopyArgs.job): K and V; an MLA pool's one latent buffer leaves
# the second empty (it starts at the last vector, so no vector is its).
MAX_JOBS = 2
KERNEL_WIDTHS = (16, 8, 4, 2, 1)  # bytes per access; one entry point each (kv_copy.h)
BLOCK = 512  # threads per block: PKV_BLOCK in kv_copy.h
UNROLL = 4  # vectors in flight per thread: PKV_UNROLL in kv_copy.h
# Integer dtypes of each element width: moves are bit copies, and integer views of
# the same width serve every dtype (float8 included, whose CPU index ops torch lacks).
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class TensorJob(ctypes.Structure):
    """Mirror of PkvTensorJob (kernels_common/kv_copy.h)."""

    _fields_ = [
        ("host_base", ctypes.c_uint64),
        ("device_layers", ctypes.c_uint64),
        ("host_page", ctypes.c_int64),
        ("host_token", ctypes.c_int64),
        ("host_layer", ctypes.c_int64),
        ("host_group", ctypes.c_int64),
        ("device_token", ctypes.c_int64),
        ("device_group", ctypes.c_int64),
        ("host_tokens", ctypes.c_int64),
        ("device_tokens", ctypes.c_int64),
        ("chunk_bytes", ctypes.c_int64),
        ("groups", ctypes.c_int64),
        ("vec_begin", ctypes.c_int64),
        ("chunk_vecs_magic", ctypes.c_uint64),
        ("groups_magic", ctypes.c_uint64),
        ("chunk_vecs_shift", ctypes.c_int64),
        ("groups_shift", ctypes.c_int64),
    ]


class CopyArgs(ctypes.Structure):
    """Mirror of PkvCopyArgs: the kernel's one by-value parameter."""

    _fields_ = [
        ("job", TensorJob * MAX_JOBS),
        ("host_indices", ctypes.c_uint64),
        ("device_indices", ctypes.c_uint64),
        ("error_flag", ctypes.c_uint64),
        ("tokens", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("layer_begin", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("total_vecs", ctypes.c_int64),
        ("to_device", ctypes.c_int64),
        ("stream_device", ctypes.c_int64),
        ("tokens_magic", ctypes.c_uint64),
        ("page_magic", ctypes.c_uint64),
        ("tokens_shift", ctypes.c_int64),
        ("page_shift", ctypes.c_int64),
    ]


def divisor(d: int) -> tuple[int, int]:
    """The magic and shift that divide by d in kv_copy.h's pkv_div:
    n // d == ((n * magic >> 64) + n) >> shift for every 0 <= n < 2**63.
    With shift = ceil(log2 d), magic = floor(2**64 * (2**shift - d) / d) + 1 < 2**64
    (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994)."""
    if d < 1:
        raise ValueError(f"divisor: expected a positive integer, got {d}")
    shift = (d - 1).bit_length()
    return ((1 << 64) * ((1 << shift) - d)) // d + 1, shift


def _divisor_fields(name: str, d: int) -> dict[str, int]:
    magic, shift = divisor(d)
    return {f"{name}_magic": magic, f"{name}_shift": shift}


def access_width(*values: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that every address and size is aligned to."""
    common = math.gcd(*values) if values else 16
    return next(w for w in KERNEL_WIDTHS if common % w == 0)


def pair_width(pair: TensorPair, table: LayerTable) -> int:
    """The widest access every address and stride of one buffer (K, V or the latent) is aligned to."""
    s, c = pair.strides, pair.chunks
    return access_width(pair.host.data_ptr(), table.alignment, s.page, s.token, s.layer, c.host_group,
                        pair.device_token_bytes, c.device_group, c.chunk_bytes)


def grid_size(total_vecs: int, block_quota: int) -> int:
    """A persistent grid: no more blocks than the quota, none without work."""
    return max(1, min(block_quota, -(-total_vecs // (BLOCK * UNROLL))))


class JobTemplate:
    """The kernel arguments that depend only on the host pool and the device buffers."""

    def __init__(self, pairs: tuple[TensorPair, ...], tables: Sequence[LayerTable | None]) -> None:
        if not 1 <= len(pairs) <= MAX_JOBS:
            raise ValueError(f"pairs: the copy kernel moves 1 to {MAX_JOBS} buffers in one launch, got {len(pairs)}")
        self.tables = tuple(tables)  # keeps the address tables alive while the template is in use
        self.width = math.gcd(*(pair_width(pair, table) for pair, table in zip(pairs, tables)))
        self.jobs: list[dict[str, int]] = []
        self.vecs_per_row: list[int] = []  # vectors per (token, layer)
        for pair, table in zip(pairs, tables):
            s, c = pair.strides, pair.chunks
            self.jobs.append(dict(
                host_base=pair.host.data_ptr(), device_layers=table.addresses.data_ptr(),
                host_page=s.page, host_token=s.token, host_layer=s.layer, host_group=c.host_group,
                device_token=pair.device_token_bytes, device_group=c.device_group,
                host_tokens=s.tokens, device_tokens=pair.device[0].shape[0],
                chunk_bytes=c.chunk_bytes, groups=c.groups,
            ))
            self.jobs[-1].update(_divisor_fields("chunk_vecs", c.chunk_bytes // self.width), **_divisor_fields("groups", c.groups))
            self.vecs_per_row.append(c.groups * c.chunk_bytes // self.width)

    def write(self, args: CopyArgs) -> None:
        for job, fields in zip(args.job, self.jobs):
            for name, value in fields.items():
                setattr(job, name, value)


class KernelArgs:
    """The struct the kernel takes by value, filled for one transfer but for its layer (the
    launch copies it at the call, so it may change after), and the access width it needs."""

    def __init__(self, transfer: Transfer, indices: tuple[torch.Tensor, torch.Tensor], error_flag: int) -> None:
        template = JobTemplate(transfer.pairs, [p.layer_table for p in transfer.pairs])
        self.template = template  # keeps the layer tables alive
        self.indices = indices  # ... and the index copies the struct points at
        self.width = template.width
        self.args = CopyArgs()
        template.write(self.args)
        args = self.args
        args.error_flag = error_flag
        rows = transfer.tokens * len(transfer.layers)
        begin = 0
        for job in range(MAX_JOBS):
            args.job[job].vec_begin = begin
            begin += rows * (template.vecs_per_row[job] if job < len(template.vecs_per_row) else 0)
        args.total_vecs = begin
        args.host_indices, args.device_indices = indices[0].data_ptr(), indices[1].data_ptr()
        args.tokens, args.layer_begin, args.layers = transfer.tokens, transfer.layers.start, len(transfer.layers)
        args.page_size = transfer.page_size
        # (an empty transfer has no vectors, so nothing divides by its 0 tokens)
        for name, value in (_divisor_fields("tokens", max(transfer.tokens, 1)) | _divisor_fields("page", transfer.page_size)).items():
            setattr(args, name, value)
        args.to_device = transfer.to_device
        self._param_array = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params = ctypes.addressof(self._param_array)
