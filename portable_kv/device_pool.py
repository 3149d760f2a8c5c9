"""The device side: an engine's per-layer K and V buffers, and their checked geometry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import backends
from .cache import IdentityCache


class DeviceKVPool:
    """Per-layer K and V buffers on the device: (tokens, heads, head_dim) each."""

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        page_size: int,
        k_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        v_heads: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_tokens", num_tokens),
            ("page_size", page_size),
            ("k_heads", k_heads),
            ("k_head_dim", k_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            positive_int(name, value)
        v_heads = k_heads if v_heads is None else positive_int("v_heads", v_heads)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        # Refused here, not first when a host pool is made from it: no buffer is allocated.
        backends.current().check_dtype(dtype)
        if num_tokens % page_size:
            raise ValueError(f"num_tokens: expected a multiple of page_size={page_size}, got {num_tokens}")
        device = torch.device(device) if device is not None else backends.current().device
        self.k_buffer = [torch.zeros(num_tokens, k_heads, k_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(num_tokens, v_heads, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size
        self._describe()

    @classmethod
    def from_buffers(cls, k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor], page_size: int) -> DeviceKVPool:
        """Wrap an engine's per-layer buffers; never copies."""
        pool = cls.__new__(cls)
        pool.k_buffer, pool.v_buffer = list(k_buffer), list(v_buffer)
        pool.page_size = positive_int("page_size", page_size)
        pool._describe()
        backends.current().check_dtype(pool.dtype)
        return pool

    def _describe(self) -> None:
        geometry = device_geometry(self)
        self.layer_num, self.size = geometry.layers, geometry.tokens
        self.dtype, self.device = geometry.dtype, geometry.device


class DeviceGeometry:
    """What a (possibly duck-typed) device pool looks like, checked once."""

    def __init__(self, pool: Any) -> None:
        k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
        if not isinstance(k, Sequence) or not isinstance(v, Sequence) or not k or len(k) != len(v):
            raise TypeError("device_pool: expected k_buffer and v_buffer, equal-length lists of per-layer tensors")
        first_k, first_v = k[0], v[0]
        for side, buffers, first in (("k_buffer", k, first_k), ("v_buffer", v, first_v)):
            for layer, t in enumerate(buffers):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"device_pool.{side}[{layer}]: expected a torch.Tensor, got {type(t).__name__}")
                if t.dim() != 3 or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(
                        f"device_pool.{side}[{layer}]: expected shape {tuple(first.shape)}, dtype {first.dtype} on {first.device} "
                        f"like layer 0, got {tuple(t.shape)}, {t.dtype} on {t.device}"
                    )
                if not t.is_contiguous():
                    raise ValueError(f"device_pool.{side}[{layer}]: expected a contiguous (tokens, heads, head_dim) tensor")
        if first_k.shape[0] != first_v.shape[0] or first_k.dtype != first_v.dtype or first_k.device != first_v.device:
            raise ValueError("device_pool: k_buffer and v_buffer must agree in tokens, dtype and device")
        self.layers, self.tokens = len(k), int(first_k.shape[0])
        self.k_heads, self.k_dim = int(first_k.shape[1]), int(first_k.shape[2])
        self.v_heads, self.v_dim = int(first_v.shape[1]), int(first_v.shape[2])
        self.dtype, self.device = first_k.dtype, first_k.device


# Checked once per set of per-layer tensors: an engine that swaps a buffer gets it re-checked.
_geometry_cache: IdentityCache[DeviceGeometry] = IdentityCache(64)


def device_geometry(pool: Any) -> DeviceGeometry:
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, Sequence) or not isinstance(v, Sequence):
        return DeviceGeometry(pool)  # raises the error that names what is missing
    return _geometry_cache.get([*k, *v], lambda: DeviceGeometry(pool))


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)
