"""A transfer's token indices, validated, and what is read off them.

A plan (plan.py) owns one pair per direction, made from its own copies of the caller's
indices.  What the io paths compute from the values (the copies on the device, the
values on the host, the tokens inside both pools) is computed at first use and kept
as fields of the pair, which lives exactly as long as its plan.
"""

from __future__ import annotations

import numpy as np
import torch


class IndexPair:
    """Host and device token indices of one transfer as validation passed them.  `on` gives
    them on a device as contiguous int64: kernels read them by address."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor, host_readable: bool = True) -> None:
        # As given: copies are made where and when a launch asks, so GPU-resident indices
        # are read on the host only by the paths that plan on the host (never by kernel io).
        self._given = (host, device)
        # False: the owner asked that GPU-resident indices not be read on the host (the read
        # would wait for the stream that produces them); a path that must plan on the host
        # still may, and waits, so `auto` takes the kernel path for such a pair.
        self.host_readable = host_readable
        self.tokens = int(host.numel())
        self._on: tuple[torch.Tensor, torch.Tensor] | None = None
        self._numpy: tuple[np.ndarray, np.ndarray] | None = None
        self._inside: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, bool]] = {}

    @property
    def given(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._given

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices on `device` (the backend's), copied on the current stream at first use:
        a launch on another stream waits for that copy once (streams.MadeOn)."""
        if self._on is None:
            self._on = (_dense(_copy_to(self._given[0], device)), _dense(_copy_to(self._given[1], device)))
        return self._on

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """The values on the host: GPU-resident ones after the stream that produces them."""
        if self._numpy is None:
            host, dev = (_dense(t.cpu()) for t in self._given)
            self._numpy = (host.numpy(), dev.numpy())
        return self._numpy

    def inside(self, host_tokens: int, device_tokens: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The indices of the tokens inside both pools, and whether any token was left out.

        The copy kernels check every index against both pools; the host-side launches (the
        copy descriptors, the staging schedule, the CPU oracle) keep the same guarantee with this."""
        kept = self._inside.get((host_tokens, device_tokens))
        if kept is None:
            host, dev = self.numpy()
            ok = (host >= 0) & (host < host_tokens) & (dev >= 0) & (dev < device_tokens)
            kept = self._inside[(host_tokens, device_tokens)] = (host, dev, False) if ok.all() else (host[ok], dev[ok], True)
        return kept


def _copy_to(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To a GPU: stream-ordered, so a kernel launched after reads the copy."""
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
