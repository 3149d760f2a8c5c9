"""A transfer's token indices, validated, and everything known about them.

Engines pass the same index tensors to every per-layer call (48 loads of one set
of pages), so what is computed from a pair of index tensors is computed once and
kept with the pair: its copies on the device, per stream; the tokens inside both
pools; each io path's plan.  It is all in one cache (`known`), least recently
used first out, keyed by what it was computed for; an entry computed for an
engine's tensors refers to them weakly and goes when they do.  The pair itself
goes when the host pool's validator lets it go (validation.py), and all of it
with it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from .cache import IdentityCache

# Facts kept per pair: device copies on a few streams, the in-bounds tokens, the DMA
# runs of K and V, a staged plan and an auto choice per kind of call (one layer or all).
KNOWN_KEPT = 32

Fact = TypeVar("Fact")

_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype, _memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class IndexPair:
    """Host and device token indices of one transfer as validation passed them, with the
    values they were validated from where those can change unseen.  `on` gives them on a
    device as contiguous int64: kernels read them by address, so strided, stride-0 and
    offset views are made dense."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor,
                 snapshots: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                 host_readable: bool = True) -> None:
        # As given: copies are made where and when a mover asks, so GPU-resident indices
        # are read on the host only by the paths that plan on the host (never by kernel io).
        self._given = (host, device)
        # False: the owner asked that GPU-resident indices not be read on the host (the read
        # would wait for the stream that produces them); a path that must plan on the host
        # still may, and waits, so `auto` takes the kernel path for such a pair.
        self.host_readable = host_readable
        self.tokens = int(host.numel())
        # The CPU-resident values validated, compared on reuse: version counters miss writes
        # made through .numpy(), .data or DLPack.
        self.snapshots = snapshots
        self._known: IdentityCache[Any] = IdentityCache(KNOWN_KEPT)

    def unchanged(self, host: torch.Tensor, device: torch.Tensor) -> bool:
        """Whether the caller's tensors still hold the values this pair was validated from."""
        for given, snapshot in zip((host, device), self.snapshots):
            if snapshot is not None and not _same_values(given, snapshot):
                return False
        return True

    def known(self, objects: Sequence[object], key: Hashable, build: Callable[[], Fact], stamp: Hashable = None) -> Fact:
        """A fact about these indices and `objects` (by identity): kept, or built now and kept."""
        return self._known.get(objects, build, stamp, key)

    def on(self, device: torch.device, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices on `device`; on a GPU, copied on `stream`, which must be the current one,
        and kept for it: a kernel on another stream has no order after that stream's copy."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        return self.known((), ("on", device, None if device.type == "cpu" else stream),
                          lambda: (_dense(_copy_to(self._given[0], device)), _dense(_copy_to(self._given[1], device))))

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        host, dev = self.on(torch.device("cpu"))
        return host.numpy(), dev.numpy()

    def inside(self, host_tokens: int, device_tokens: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The indices of the tokens inside both pools, and whether any token was left out.

        The copy kernels check every index against both pools; the host-side movers (the
        DMA plan, the staged plan, the CPU oracle) keep the same guarantee with this."""
        def build() -> tuple[np.ndarray, np.ndarray, bool]:
            host, dev = self.numpy()
            ok = (host >= 0) & (host < host_tokens) & (dev >= 0) & (dev < device_tokens)
            return (host, dev, False) if ok.all() else (host[ok], dev[ok], True)

        return self.known((), ("inside", host_tokens, device_tokens), build)


def _copy_to(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To the CPU: a blocking copy, after the stream that may still be writing GPU-resident
    indices (a non-blocking copy read at once could see the values before they exist).  To
    a GPU: stream-ordered, so a kernel launched after reads the copy."""
    if device.type == "cpu":
        return indices.to(device)
    if indices.device.type == "cpu" and not indices.is_pinned():
        # From pageable memory the driver first waits for the stream's earlier work on the
        # host (CUDA's and HIP's rule for async copies to the device): an engine's load stream
        # waiting for its model stream would hold the caller until the model got there.
        # Dense first: a view whose elements share memory (expand) cannot be pinned in place.
        indices = indices.contiguous().pin_memory()
    return indices.to(device, non_blocking=True)


def _dense(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(torch.int64).contiguous()


def _same_values(given: torch.Tensor, snapshot: torch.Tensor) -> bool:
    """Whether CPU indices still hold the snapshot's values: one memcmp where the caller's
    tensor is dense, a fraction of torch.equal's time (docs/DESIGN.md, "The host path")."""
    if given.dtype == snapshot.dtype and given.is_contiguous() and given.numel() == snapshot.numel():
        return _memcmp(given.data_ptr(), snapshot.data_ptr(), given.numel() * given.element_size()) == 0
    return torch.equal(given, snapshot)
