"""What a benchmark moves: one device pool (MHA's K and V, or MLA's latent) and random whole pages on both sides."""

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
# The MLA row group's pools: DeepSeek-V3/R1's latent (kv_lora_rank 512 + qk_rope_head_dim 64), 61 layers.
MLA_DIM, MLA_ROPE, MLA_LAYERS = 576, 64, 61


@dataclass(frozen=True)
class Geometry:
    """The model's KV shape on one GPU, as the bench's flags give it, and the MLA row group's latent."""

    heads: int
    k_dim: int
    v_dim: int
    dtype: str
    pages: int  # pages per call; 0: enough for the per-layer target above
    mla_dim: int = MLA_DIM  # latent elements per token of the MLA rows; 0: no MLA rows
    mla_layers: int = MLA_LAYERS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Geometry:
        for name in ("heads", "k_dim", "v_dim", "mla_layers"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
        for name in ("pages", "mla_dim"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 0, got {getattr(args, name)}")
        return cls(args.heads, args.k_dim, args.v_dim, args.dtype, args.pages, args.mla_dim, args.mla_layers)


class Workload:
    """One device pool and `pages` random pages on each side (distinct, shuffled); `pool` "MLA":
    a latent pool of `geometry.mla_dim` elements a token instead of K and V."""

    def __init__(self, geometry: Geometry, page_size: int, layers: int, device: torch.device, pool: str = "MHA") -> None:
        self.dtype = DTYPES[geometry.dtype]
        self.pool = pool
        row = geometry.mla_dim if pool == "MLA" else geometry.heads * (geometry.k_dim + geometry.v_dim)
        self.token_layer_bytes = row * self.dtype.itemsize
        target = GPU_LOAD_BYTES if device.type != "cpu" else CPU_LOAD_BYTES
        self.pages = geometry.pages or -(-int(target // self.token_layer_bytes) // page_size)
        self.page_size, self.layers = page_size, layers
        self.host_pages = self.pages + max(8, self.pages // 8)
        tokens = self.host_pages * page_size
        if pool == "MLA":
            rope = MLA_ROPE if geometry.mla_dim > MLA_ROPE else 0
            self.dev = pk.MLADevicePool(layers, tokens, page_size, geometry.mla_dim, self.dtype, device, qk_rope_head_dim=rope)
        else:
            self.dev = pk.DeviceKVPool(layers, tokens, page_size, geometry.heads, geometry.k_dim, geometry.v_dim, dtype=self.dtype, device=device)
        gen = torch.Generator().manual_seed(0)
        self.dev_idx = self._random_pages(gen)
        self.host_idx = self._random_pages(gen)
        self.layer_bytes = self.pages * page_size * self.token_layer_bytes

    def _random_pages(self, gen: torch.Generator) -> torch.Tensor:
        pages = torch.randperm(self.host_pages, generator=gen)[: self.pages]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def host_pool(self, layout: str, io: str, host_memory: str = "pinned", ratio: float = 1.0) -> pk.AsymmetricHostPool | pk.MLAHostPool:
        pool = pk.MLAHostPool if self.pool == "MLA" else pk.AsymmetricHostPool
        return pool(self.dev, host_to_device_ratio=ratio, layout=layout, io_backend=io, host_memory=host_memory)

    def halves(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Two disjoint index pairs (host, device) of equal size: a load and a backup that run at once."""
        half = self.pages // 2 * self.page_size
        return ((self.host_idx[:half].clone(), self.dev_idx[:half].clone()),
                (self.host_idx[half:2 * half].clone(), self.dev_idx[half:2 * half].clone()))
