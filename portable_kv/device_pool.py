"""The device side: an engine's per-layer buffers, and their checked geometry.

Two kinds of pool, as SGLang keeps them: MHA pools hold K and V per layer
(`k_buffer`, `v_buffer`), MLA pools one latent buffer per layer (`kv_buffer`:
the compressed KV and the rotary key, one "head").  A kind names the buffers;
everything below the pools (the copy kernels, the planners, the pages) moves
whichever buffers a pool has, each one strided gather.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from . import backends


class PoolKind(NamedTuple):
    """What a pool's per-layer buffers are."""

    name: str
    buffers: tuple[str, ...]  # attribute names, the same on a device pool and its host pool (SGLang's)
    labels: tuple[str, ...]  # what errors call each buffer


MHA = PoolKind("MHA", ("k_buffer", "v_buffer"), ("K", "V"))
MLA = PoolKind("MLA", ("kv_buffer",), ("latent",))


class DeviceKVPool:
    """Per-layer K and V buffers on the device: (tokens, heads, head_dim) each."""

    kind = MHA

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
        for name, value in (("k_heads", k_heads), ("k_head_dim", k_head_dim), ("v_head_dim", v_head_dim)):
            positive_int(name, value)
        v_heads = k_heads if v_heads is None else positive_int("v_heads", v_heads)
        device = _check_pool(num_layers, num_tokens, page_size, dtype, device, k_heads * k_head_dim + v_heads * v_head_dim)
        with torch.inference_mode(False):  # see _check_pool
            self.k_buffer = [torch.zeros(num_tokens, k_heads, k_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(num_tokens, v_heads, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size
        _describe(self)

    @classmethod
    def from_buffers(cls, k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor], page_size: int) -> DeviceKVPool:
        """Wrap an engine's per-layer buffers; never copies."""
        pool = cls.__new__(cls)
        pool.k_buffer, pool.v_buffer = list(k_buffer), list(v_buffer)
        return _wrapped(pool, page_size)


class MLADevicePool:
    """Per-layer latent buffers on the device: (tokens, 1, kv_cache_dim) each, as SGLang's MLATokenToKVPool.

    `kv_cache_dim` is `kv_lora_rank + qk_rope_head_dim` (DeepSeek-V3: 512 + 64);
    fp8 caches are stored as uint8 (or float8_e4m3fn) elements."""

    kind = MLA

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        page_size: int,
        kv_cache_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int = 0,
    ) -> None:
        positive_int("kv_cache_dim", kv_cache_dim)
        self.kv_lora_rank, self.qk_rope_head_dim = latent_split(kv_cache_dim, kv_lora_rank, qk_rope_head_dim)
        device = _check_pool(num_layers, num_tokens, page_size, dtype, device, kv_cache_dim)
        with torch.inference_mode(False):  # see _check_pool
            self.kv_buffer = [torch.zeros(num_tokens, 1, kv_cache_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size
        _describe(self)
        self.kv_cache_dim = kv_cache_dim

    @classmethod
    def from_buffers(cls, kv_buffer: Sequence[torch.Tensor], page_size: int, *, kv_lora_rank: int | None = None,
                     qk_rope_head_dim: int = 0) -> MLADevicePool:
        """Wrap an engine's per-layer latent buffers; never copies."""
        pool = cls.__new__(cls)
        pool.kv_buffer = list(kv_buffer)
        _wrapped(pool, page_size)
        pool.kv_cache_dim = int(pool.kv_buffer[0].shape[2])
        pool.kv_lora_rank, pool.qk_rope_head_dim = latent_split(pool.kv_cache_dim, kv_lora_rank, qk_rope_head_dim)
        return pool


def latent_split(kv_cache_dim: int, kv_lora_rank: int | None, qk_rope_head_dim: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) of a latent row; the rank defaults to the rest of the row."""
    if isinstance(qk_rope_head_dim, bool) or not isinstance(qk_rope_head_dim, (int, np.integer)) or not 0 <= qk_rope_head_dim < kv_cache_dim:
        raise ValueError(f"qk_rope_head_dim: expected an int in [0, {kv_cache_dim}) (kv_cache_dim {kv_cache_dim}), got {qk_rope_head_dim!r}")
    if kv_lora_rank is None:
        return kv_cache_dim - int(qk_rope_head_dim), int(qk_rope_head_dim)
    # fp8 caches that pack scales into the row (SGLang's DSA) are wider than rank + rope.
    if positive_int("kv_lora_rank", kv_lora_rank) + qk_rope_head_dim > kv_cache_dim:
        raise ValueError(f"kv_lora_rank: expected kv_lora_rank + qk_rope_head_dim <= kv_cache_dim {kv_cache_dim}, got {kv_lora_rank} + {qk_rope_head_dim}")
    return int(kv_lora_rank), int(qk_rope_head_dim)


def _check_pool(num_layers: int, num_tokens: int, page_size: int, dtype: torch.dtype, device: torch.device | str | None,
                token_elements: int) -> torch.device:
    """Every argument of a device pool checked, and the device able to hold it, before a buffer is allocated.

    The buffers are then allocated under ``torch.inference_mode(False)``: a pool built
    inside inference mode still takes pages outside it (storage threads, an engine's
    own copies), which an inference tensor refuses."""
    for name, value in (("num_layers", num_layers), ("num_tokens", num_tokens), ("page_size", page_size)):
        positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    # Refused here, not first when a host pool is made from it: no buffer is allocated.
    backends.current().check_dtype(dtype)
    if num_tokens % page_size:
        raise ValueError(f"num_tokens: expected a multiple of page_size={page_size}, got {num_tokens}")
    target = check_device(device) if device is not None else backends.current().device
    nbytes = num_layers * num_tokens * token_elements * dtype.itemsize
    capacity, what = device_capacity(target)
    if capacity is not None and nbytes > capacity:
        raise ValueError(f"num_tokens: {num_layers} layers of {num_tokens} tokens need {nbytes / 1e9:.3g} GB of {target} memory, "
                         f"more than {what} ({capacity / 1e9:.3g} GB); lower num_tokens or num_layers")
    return target


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device that exists on this machine; ValueError naming `device` and what there is."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device or a device string such as 'cuda:0' or 'cpu', got {device!r}") from None
    if target.type == "cpu":
        return target
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ["cpu", *(f"cuda:{i}" for i in range(gpus))]
    if target.type != "cuda" or gpus == 0 or (target.index is not None and target.index >= gpus):
        raise ValueError(f"device: {str(target)!r} is not a device of this machine; available: {', '.join(available)}")
    return target


def device_capacity(device: torch.device) -> tuple[int | None, str]:
    """Bytes a device holds in all, and how that was found; None where it cannot be read."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"{device} holds in all"
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
        except (ValueError, OSError):
            return None, ""
    return None, ""


def _wrapped(pool: Any, page_size: int) -> Any:
    pool.page_size = positive_int("page_size", page_size)
    _describe(pool)
    backends.current().check_dtype(pool.dtype)
    if pool.size % pool.page_size:  # the constructor's rule: tokens are whole pages
        raise ValueError(f"page_size: expected a divisor of the buffers' {pool.size} tokens (whole pages), got {pool.page_size}")
    return pool


def _describe(pool: Any) -> None:
    geometry = device_geometry(pool, pool.kind)
    pool.layer_num, pool.size = geometry.layers, geometry.tokens
    pool.dtype, pool.device = geometry.dtype, geometry.device


class DeviceGeometry:
    """What a (possibly duck-typed) device pool of one kind looks like, checked once."""

    def __init__(self, pool: Any, kind: PoolKind) -> None:
        lists: list[Any] = [getattr(pool, name, None) for name in kind.buffers]
        if not all(isinstance(b, Sequence) and b for b in lists) or len({len(b) for b in lists}) != 1:
            names = " and ".join(kind.buffers)
            raise TypeError(f"device_pool: expected {names}, {'equal-length lists' if len(lists) > 1 else 'a list'} of per-layer tensors"
                            f"{' (an MLA pool)' if kind is MLA else ''}")
        firsts = [b[0] for b in lists]
        for side, buffers, first in zip(kind.buffers, lists, firsts):
            for layer, t in enumerate(buffers):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"device_pool.{side}[{layer}]: expected a torch.Tensor, got {type(t).__name__}")
                if t.dim() != 3:
                    raise ValueError(f"device_pool.{side}[{layer}]: expected a 3-D (tokens, heads, head_dim) tensor, got {t.dim()}-D "
                                     f"of shape {tuple(t.shape)}")
                if t.dtype != first.dtype:
                    raise TypeError(f"device_pool.{side}[{layer}]: expected dtype {first.dtype} like layer 0, got {t.dtype}")
                if t.shape != first.shape or t.device != first.device:
                    raise ValueError(
                        f"device_pool.{side}[{layer}]: expected shape {tuple(first.shape)}, dtype {first.dtype} on {first.device} "
                        f"like layer 0, got {tuple(t.shape)}, {t.dtype} on {t.device}"
                    )
                if not t.is_contiguous():
                    raise ValueError(f"device_pool.{side}[{layer}]: expected a contiguous (tokens, heads, head_dim) tensor")
        if kind is MLA and firsts[0].shape[1] != 1:
            raise ValueError(f"device_pool.kv_buffer: expected (tokens, 1, kv_cache_dim) tensors (MLA keeps one head), got {tuple(firsts[0].shape)}")
        first = firsts[0]
        if any(t.dtype != first.dtype for t in firsts[1:]):
            raise TypeError(f"device_pool: {' and '.join(kind.buffers)} must agree in dtype, got {', '.join(str(t.dtype) for t in firsts)}")
        if any(t.shape[0] != first.shape[0] or t.device != first.device for t in firsts[1:]):
            raise ValueError(f"device_pool: {' and '.join(kind.buffers)} must agree in tokens and device")
        self.kind = kind
        self.layers, self.tokens = len(lists[0]), int(first.shape[0])
        self.shapes = tuple((int(t.shape[1]), int(t.shape[2])) for t in firsts)  # (heads, head_dim) per buffer
        self.dtype, self.device = first.dtype, first.device

    @property
    def token_elements(self) -> int:
        """Elements of one token of one layer, every buffer."""
        return sum(heads * dim for heads, dim in self.shapes)

    def describe(self) -> str:
        return ", ".join([f"{self.layers} layers", *(f"{label} {h}x{d}" for label, (h, d) in zip(self.kind.labels, self.shapes))])


def device_geometry(pool: Any, kind: PoolKind = MHA) -> DeviceGeometry:
    """The checked geometry of an engine's device pool: a host pool asks once per device pool it
    is bound to, and again where the engine swaps a per-layer tensor (pool.py's binding)."""
    return DeviceGeometry(pool, kind)


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)
