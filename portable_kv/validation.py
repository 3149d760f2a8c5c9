"""Index validation: everything a transfer's indices must satisfy before a byte moves.

Engines pass the same index tensors to every per-layer call, so a validated pair
(indices.py) is kept and found again by the identity of the caller's tensors and
their version counters.  Version counters miss writes made through `.numpy()`,
`.data` or DLPack, so for CPU-resident indices the pair also holds a snapshot of
the values, compared on every reuse: what moves is always what was validated.
GPU-resident indices are not compared (that would be a device round trip per
call): an engine that rewrites them in place behind torch's back must pass a new
tensor (docs/API.md, Guarantees).  Indices the pool copied for one submission of
SGLang's (`stable_copies`) are its own, which nobody writes: they are found again
by identity alone, with no comparison, in inference mode too.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from .cache import IdentityCache
from .indices import IndexPair
from .layout import PAGE_LAYOUTS

INDEX_DTYPES = (torch.int64, torch.int32)
VALIDATED_KEPT = 4  # a per-layer load's pair, a backup's pair, and spares: an engine interleaves them


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


def _as_owned(t: torch.Tensor) -> torch.Tensor:
    """Indices the pool already owns (stable_copies): dense int64 that nobody writes."""
    return t


def _owned_int64(t: torch.Tensor) -> torch.Tensor:
    """A contiguous int64 copy the caller cannot change: kernels read data_ptr() as a dense array,
    so a strided or expanded view would be read wrongly, and a later in-place write would
    change indices that were already validated."""
    return t.to(torch.int64, copy=True, memory_format=torch.contiguous_format)


_DIRECTIONS = {True: object(), False: object()}  # loads, backups


def _version(indices: torch.Tensor) -> int | None:
    """The tensor's version counter; None for a tensor made under torch.inference_mode(),
    which has none (reading it raises): its CPU-resident values are compared with the
    snapshot on every reuse, and GPU-resident ones are never reused (`_reusable`)."""
    return None if indices.is_inference() else indices._version


def _stamp(host_indices: torch.Tensor, device_indices: torch.Tensor, device_tokens: int, to_device: bool) -> tuple:
    return _version(host_indices), _version(device_indices), device_tokens, to_device


def _reusable(indices: torch.Tensor) -> bool:
    """Whether a kept pair may stand for these indices again: an in-place write to an
    inference tensor on the GPU moves no version counter and has no snapshot to compare
    (that would be a device round trip per call), so such indices are validated anew each
    call; `prepare()` validates once and keeps its own copy (docs/API.md)."""
    return indices.device.type == "cpu" or not indices.is_inference()


def _snapshot(given: torch.Tensor, owned: torch.Tensor) -> torch.Tensor | None:
    """The values CPU-resident indices were validated with: the pool's own int64 copy where
    the caller's tensor is int64 (nobody writes it), else a dense copy in the caller's dtype."""
    if given.device.type != "cpu":
        return None
    return owned if given.dtype == owned.dtype else given.clone(memory_format=torch.contiguous_format)


class IndexValidator:
    """Validates a transfer's index tensors for one host pool, keeping the last few pairs."""

    def __init__(self, host_tokens: int, page_size: int, layout: str, validate: bool) -> None:
        self.host_tokens, self.page_size, self.layout, self.validate = host_tokens, page_size, layout, validate
        self.validations = 0  # how many pairs were validated (not found kept): tests count them
        # False: GPU-resident indices are not read on the host (SGLangHostPool: SGLang's
        # kernel io passes both on the GPU, its load stream held behind the model's); the
        # kernels bound-check them.
        self.read_gpu_indices = True
        self._kept: IdentityCache[IndexPair] = IdentityCache(VALIDATED_KEPT)
        # The copies `stable_copies` handed out (the pool's own, never written after), by id;
        # each entry goes with its tensor.  Not a WeakSet: that compares tensors with ==.
        self._stable: dict[int, weakref.ref[torch.Tensor]] = {}

    def stable_copies(self, host_indices: Any, device_indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense int64 copies of a submission's indices, on their devices (a GPU copy ordered on
        the current stream), that the pool owns: its calls with them are validated once and then
        found by identity alone.  Refuses what is not an index tensor, as a transfer would."""
        host = _owned_int64(index_tensor("host_indices", host_indices))
        dev = _owned_int64(index_tensor("device_indices", device_indices))
        stable = self._stable
        for copy in (host, dev):
            key = id(copy)
            stable[key] = weakref.ref(copy, lambda _, key=key: stable.pop(key, None))
        return host, dev

    def _is_stable(self, indices: Any) -> bool:
        ref = self._stable.get(id(indices))
        return ref is not None and ref() is indices

    def __call__(self, host_indices: Any, device_indices: Any, device_tokens: int, to_device: bool) -> IndexPair:
        # The direction is part of the key, not only of the stamp: a load and a backup of
        # the same tensors are kept side by side, and what is known of each pair with it.
        tensors = (host_indices, device_indices, _DIRECTIONS[to_device])
        if type(host_indices) is torch.Tensor and type(device_indices) is torch.Tensor:
            kept = self._kept.lookup(tensors, _stamp(host_indices, device_indices, device_tokens, to_device))
            if kept is not None and (self._is_stable(host_indices) and self._is_stable(device_indices)
                                     or kept.unchanged(host_indices, device_indices) and _reusable(host_indices) and _reusable(device_indices)):
                return kept
        pair = self._validate(host_indices, device_indices, device_tokens, to_device)  # refuses what is not a tensor
        return self._kept.store(tensors, pair, _stamp(host_indices, device_indices, device_tokens, to_device))

    def validate_once(self, host_indices: Any, device_indices: Any, device_tokens: int, to_device: bool) -> IndexPair:
        """A pair validated now and not kept here: a prepared transfer keeps it (prepared.py)."""
        return self._validate(host_indices, device_indices, device_tokens, to_device)

    def _validate(self, host_indices: Any, device_indices: Any, device_tokens: int, to_device: bool) -> IndexPair:
        host = index_tensor("host_indices", host_indices)
        dev = index_tensor("device_indices", device_indices)
        if host.numel() != dev.numel():
            raise ValueError(f"device_indices: expected the length of host_indices ({host.numel()}), got {dev.numel()}")
        # The pool's own copies (stable_copies) are neither copied again nor snapshotted:
        # nobody writes them.
        stable = self._is_stable(host) and self._is_stable(dev)
        own = _as_owned if stable else _owned_int64

        def snapshots() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return (None, None) if stable else (_snapshot(host_indices, host), _snapshot(device_indices, dev))

        host = own(host)
        if (dev.device.type != "cpu" or host.device.type != "cpu") and not self.read_gpu_indices:
            # Reading GPU-resident indices would block the host until the current stream
            # reaches this call (an engine's load stream waits for its model stream): the
            # kernels bound-check every index instead, skipping and flagging one outside the
            # pools; CPU-resident ones are checked here as always.
            if self.validate and host.device.type == "cpu":
                self._check(host.numpy(), "host_indices", self.host_tokens, unique=not to_device)
            if dev.device.type == "cpu":
                dev = own(dev)  # checked and kept as one copy, as below
                if self.validate:
                    self._check(dev.numpy(), "device_indices", device_tokens, unique=to_device)
            self.validations += 1
            return IndexPair(host, dev, snapshots(), host_readable=False)
        dev = own(dev)
        kept_values = snapshots()
        if dev.device != host.device:
            dev = dev.to(host.device)
        pair = IndexPair(host, dev, kept_values)
        if self.validate:
            host_np, dev_np = pair.numpy()  # GPU-resident indices: one copy, after the stream that produced them
            self._check(host_np, "host_indices", self.host_tokens, unique=not to_device)
            self._check(dev_np, "device_indices", device_tokens, unique=to_device)
        self.validations += 1
        return pair

    def _check(self, values: np.ndarray, name: str, limit: int, unique: bool) -> None:
        check_range(name, values, limit)
        if self.layout in PAGE_LAYOUTS:
            check_whole_pages(name, values, self.page_size, self.layout)
        if unique:
            # Two writes to one slot would race on a GPU: the result would depend on timing.
            check_unique(name, values)

    def clear(self) -> None:
        self._kept.clear()
