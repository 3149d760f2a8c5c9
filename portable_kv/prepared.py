"""A transfer prepared once and launched per layer: `host.prepare(...)` (docs/API.md).

An engine loads one set of pages layer after layer (61 calls for DeepSeek-V3), and
backs up one set for every layer at once.  Everything about such a transfer that
does not change between its calls is done at `prepare()`: the device pool's
geometry is checked and its tensor pairs bound, the indices are copied into the
plan (so the caller may reuse or change its tensors afterwards: the plan moves the
indices it was given), validated once per direction, and the io path's plan and
launch arguments are built at the first call of each kind and kept with those
copies.  `plan.load(layer)` then checks the layer and the pool, and enqueues.

A plan holds the device pool's per-layer buffers as they were at `prepare()`;
after an engine replaces a buffer, prepare again.  A plan of a closed pool raises.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .indices import IndexPair
from .transfer import TensorPair, Transfer
from .validation import IndexValidator


class PlannedPool(Protocol):
    """What a plan asks of its host pool (pool.py's HostPool)."""

    layer_num: int
    page_size: int
    _validator: IndexValidator

    def _layer(self, layer_id: int) -> range: ...
    def _run(self, plan: PreparedTransfer, to_device: bool, layers: range) -> None: ...


class PreparedTransfer:
    """One pair of index tensors of one host pool and one device pool, on one io path."""

    def __init__(self, pool: PlannedPool, pairs: tuple[TensorPair, ...], device_tokens: int, host_indices: Any, device_indices: Any,
                 io: str) -> None:
        self.pool, self.io = pool, io
        self._pairs = pairs
        self._device_tokens = device_tokens
        self._layers = [range(layer, layer + 1) for layer in range(pool.layer_num)]
        self._all = range(pool.layer_num)
        # The plan's own copies: an engine that rewrites its tensors after prepare() does
        # not change what the plan moves (and its inference tensors need no version counter).
        self._given = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in (host_indices, device_indices))
        self._indices: dict[bool, IndexPair] = {}
        self.tokens = self.indices(True).tokens  # validated now: bad input raises at prepare()
        self.nbytes_per_layer = int(sum(self.tokens * p.device_token_bytes for p in pairs))

    def indices(self, to_device: bool) -> IndexPair:
        """The validated pair for one direction (a load's destinations are device slots, a
        backup's host slots: each must be distinct), validated at its first use."""
        pair = self._indices.get(to_device)
        if pair is None:
            pair = self._indices[to_device] = self.pool._validator.validate_once(*self._given, self._device_tokens, to_device)
        return pair

    def load(self, layer_id: int) -> None:
        """`load_to_device_per_layer` of the prepared indices: H2D, one layer."""
        layers = self._layers[layer_id] if type(layer_id) is int and 0 <= layer_id < len(self._layers) else self.pool._layer(layer_id)
        self.pool._run(self, True, layers)

    def load_all(self) -> None:
        """`load_to_device_all_layer` of the prepared indices."""
        self.pool._run(self, True, self._all)

    def backup(self, layer_id: int | None = None) -> None:
        """D2H: every layer (None, `backup_from_device_all_layer`), or one."""
        layers = self._all if layer_id is None else self.pool._layer(layer_id)
        self.pool._run(self, False, layers)

    def transfer(self, to_device: bool, layers: range, host_writes: int) -> Transfer:
        return Transfer(to_device, self._pairs, self.indices(to_device), layers, self.pool.page_size, host_writes)

    def __repr__(self) -> str:
        return f"PreparedTransfer(io={self.io!r}, tokens={self.tokens}, layers={len(self._all)})"

