"""What a benchmark moves: one device pool and random whole pages on both sides."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import portable_kv as pk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}
# A per-layer load of 100 MB lasts ~2 ms over PCIe Gen5: long enough that launch
# and event overheads vanish in the median.  On the CPU backend 4 MB keeps a run short.
GPU_LOAD_BYTES = 100e6
CPU_LOAD_BYTES = 4e6


@dataclass(frozen=True)
class Geometry:
    """The model's KV shape on one GPU, as the bench's flags give it."""

    heads: int
    k_dim: int
    v_dim: int
    dtype: str
    pages: int  # pages per call; 0: enough for the per-layer target above

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Geometry:
        for name in ("heads", "k_dim", "v_dim"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
        if args.pages < 0:
            raise ValueError(f"--pages: expected an integer >= 0, got {args.pages}")
        return cls(args.heads, args.k_dim, args.v_dim, args.dtype, args.pages)


class Workload:
    """One device pool and `pages` random pages on each side (distinct, shuffled)."""

    def __init__(self, geometry: Geometry, page_size: int, layers: int, device: torch.device) -> None:
        self.dtype = DTYPES[geometry.dtype]
        self.token_layer_bytes = geometry.heads * (geometry.k_dim + geometry.v_dim) * self.dtype.itemsize
        target = GPU_LOAD_BYTES if device.type != "cpu" else CPU_LOAD_BYTES
        self.pages = geometry.pages or -(-int(target // self.token_layer_bytes) // page_size)
        self.page_size, self.layers = page_size, layers
        self.host_pages = self.pages + max(8, self.pages // 8)
        self.dev = pk.DeviceKVPool(layers, self.host_pages * page_size, page_size, geometry.heads, geometry.k_dim, geometry.v_dim,
                                   dtype=self.dtype, device=device)
        gen = torch.Generator().manual_seed(0)
        self.dev_idx = self._random_pages(gen)
        self.host_idx = self._random_pages(gen)
        self.layer_bytes = self.pages * page_size * self.token_layer_bytes

    def _random_pages(self, gen: torch.Generator) -> torch.Tensor:
        pages = torch.randperm(self.host_pages, generator=gen)[: self.pages]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def host_pool(self, layout: str, io: str, host_memory: str = "pinned") -> pk.AsymmetricHostPool:
        return pk.AsymmetricHostPool(self.dev, host_to_device_ratio=1.0, layout=layout, io_backend=io, host_memory=host_memory)

    def halves(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Two disjoint index pairs (host, device) of equal size: a load and a backup that run at once."""
        half = self.pages // 2 * self.page_size
        return ((self.host_idx[:half].clone(), self.dev_idx[:half].clone()),
                (self.host_idx[half:2 * half].clone(), self.dev_idx[half:2 * half].clone()))
