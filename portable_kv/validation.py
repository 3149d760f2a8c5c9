"""Index validation: everything a transfer's indices must satisfy before a byte moves.

A plan (plan.py) validates its own copies of the caller's indices once per direction;
nothing here is kept between calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .indices import IndexPair
from .layout import PAGE_LAYOUTS

INDEX_DTYPES = (torch.int64, torch.int32)


def index_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D torch.Tensor of int64 or int32, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int64 or int32, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a tensor on the CPU or the GPU, got one on {value.device}")
    return value


def check_range(name: str, values: np.ndarray, limit: int) -> None:
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0:
        raise ValueError(f"{name}: expected indices >= 0, got {low}")
    if high >= limit:
        raise ValueError(f"{name}: expected indices < {limit} (the pool's tokens), got {high}")


def check_whole_pages(name: str, values: np.ndarray, page_size: int, layout: str) -> None:
    if values.size % page_size:
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: expected a length divisible by page_size={page_size}, got {values.size}")
    pages = values.reshape(-1, page_size)
    if (pages[:, 0] % page_size).any():
        bad = int(pages[(pages[:, 0] % page_size) != 0][0, 0])
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: each run of {page_size} must start at a multiple of {page_size}, got {bad}")
    if page_size > 1 and (np.diff(pages, axis=1) != 1).any():
        row = int(np.flatnonzero((np.diff(pages, axis=1) != 1).any(axis=1))[0])
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: run {row} is not {page_size} consecutive tokens")


def check_unique(name: str, values: np.ndarray) -> None:
    if np.unique(values).size != values.size:
        raise ValueError(f"{name}: expected distinct destination slots, got duplicates (two writes to one slot race)")


def owned_int64(t: torch.Tensor) -> torch.Tensor:
    """A contiguous int64 copy the caller cannot change: kernels read data_ptr() as a dense array,
    so a strided or expanded view would be read wrongly, and a later in-place write would
    change indices that were already validated.  Made outside inference mode, so the copy
    is an ordinary tensor whatever mode the caller is in."""
    with torch.inference_mode(False):
        return t.to(torch.int64, copy=True, memory_format=torch.contiguous_format)


class IndexValidator:
    """Validates a plan's index copies for one host pool, once per direction."""

    def __init__(self, host_tokens: int, page_size: int, layout: str, validate: bool) -> None:
        self.host_tokens, self.page_size, self.layout, self.validate = host_tokens, page_size, layout, validate
        # False: GPU-resident indices are not read on the host (SGLangHostPool: SGLang's
        # kernel io passes both on the GPU, its load stream held behind the model's); the
        # kernels bound-check them.
        self.read_gpu_indices = True

    def pair(self, host: torch.Tensor, dev: torch.Tensor, device_tokens: int) -> IndexPair:
        """The pair of a plan's own copies (`owned_int64`), checked for what holds in either
        direction (ranges, whole pages); `check_direction` adds the distinct destinations."""
        if (dev.device.type != "cpu" or host.device.type != "cpu") and not self.read_gpu_indices:
            # Reading GPU-resident indices would block the host until the current stream
            # reaches this call (an engine's load stream waits for its model stream): the
            # kernels bound-check every index instead, skipping and flagging one outside the
            # pools; CPU-resident ones are checked here as always.
            if self.validate and host.device.type == "cpu":
                self._check(host.numpy(), "host_indices", self.host_tokens)
            if self.validate and dev.device.type == "cpu":
                self._check(dev.numpy(), "device_indices", device_tokens)
            return IndexPair(host, dev, host_readable=False)
        if dev.device != host.device:
            dev = dev.to(host.device)
        pair = IndexPair(host, dev)
        if self.validate:
            host_np, dev_np = pair.numpy()  # GPU-resident indices: one copy, after the stream that produced them
            self._check(host_np, "host_indices", self.host_tokens)
            self._check(dev_np, "device_indices", device_tokens)
        return pair

    def check_direction(self, pair: IndexPair, to_device: bool) -> None:
        """Distinct destinations: device slots of a load, host slots of a backup.  Two writes
        to one slot would race on a GPU: the result would depend on timing."""
        if not self.validate:
            return
        name, side = ("device_indices", 1) if to_device else ("host_indices", 0)
        if pair.host_readable:
            check_unique(name, pair.numpy()[side])
        elif pair.given[side].device.type == "cpu":
            check_unique(name, pair.given[side].numpy())

    def _check(self, values: np.ndarray, name: str, limit: int) -> None:
        check_range(name, values, limit)
        if self.layout in PAGE_LAYOUTS:
            check_whole_pages(name, values, self.page_size, self.layout)


def check_lengths(host: torch.Tensor, dev: torch.Tensor) -> None:
    if host.numel() != dev.numel():
        raise ValueError(f"device_indices: expected the length of host_indices ({host.numel()}), got {dev.numel()}")
