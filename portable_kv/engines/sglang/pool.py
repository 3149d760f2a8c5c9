"""What SGLang's two kinds of host pool share (docs/API.md, "The SGLang host-pool surface").

`SGLangPool` is a mixin placed before a host pool class: it sizes the pool from
SGLang's constructor arguments as SGLang does, maps SGLang's io choice to a
portable_kv path (`io_mapping`), and packs MTP draft layers after the
target's.  The transfers follow the device pools SGLang passes on each call:
the target's on target calls, a draft's own one-layer pool on `is_draft=True`
loads.  Whatever the pool's kind (MHA's K and V, MLA's latent), the same code
moves its buffers, named by the kind.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import config
from ...device_pool import MHA, DeviceKVPool, MLADevicePool, PoolKind
from .surface import SGLangSurface

SGLANG_IO_CHOICES = config.SGLANG_IO_CHOICES  # what SGLang's `--hicache-io-backend` offers for host pools on GPUs


def io_mapping() -> dict[str, str]:
    """SGLang's `--hicache-io-backend` choice -> the portable_kv io path, from PORTABLE_KV_SGLANG_IO.

    SGLang offers `kernel` and `direct` and passes one on every call; the setting
    lets its pools use `staged` or `auto` too: one path (every call takes it) or
    pairs (``kernel=auto,direct=staged``).
    """
    raw = config.SGLANG_IO.raw()  # validated where it is read
    return config.sglang_io_mapping(raw) if raw else {}


def sglang_host_tokens(host_to_device_ratio: float, host_size: float, page_size: int, device_capacity_tokens: int,
                       token_bytes: int, host_token_capacity: int | None) -> int:
    """Host token slots as SGLang's `HostKVCache` sizes them: `host_token_capacity` exactly,
    else `host_size` GB or ``int(device_capacity_tokens * ratio)`` tokens, plus one padding page."""
    if host_token_capacity is not None:
        if host_token_capacity <= 0 or host_token_capacity % page_size:
            raise ValueError(f"host_token_capacity: expected a positive multiple of page_size={page_size}, got {host_token_capacity}")
        return host_token_capacity
    wanted = int(host_size * 1e9 // token_bytes) if host_size and host_size > 0 else int(device_capacity_tokens * host_to_device_ratio)
    return (wanted // page_size + 1) * page_size


def check_layer_bounds(start_layer: Any, end_layer: Any) -> None:
    for name, value in (("start_layer", start_layer), ("end_layer", end_layer)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name}: expected an int, got {value!r}")


def fallback_builder(pool_class: type, sglang_class: type, reason: Callable[[dict[str, Any]], str | None], what: str) -> Callable[..., Any]:
    """What install() binds in place of one of SGLang's host-pool classes: a callable that builds
    `pool_class` (portable_kv's), or `sglang_class` with a log line on `pool_class`'s module logger
    for arguments `reason` names.  `reason` reads the arguments as bound to `pool_class`'s
    constructor, by parameter name, those left to their defaults absent."""
    parameters = inspect.signature(pool_class.__init__)
    logger = logging.getLogger(pool_class.__module__)

    def build_host_pool(*args: Any, **kwargs: Any) -> Any:
        why = reason(parameters.bind_partial(None, *args, **kwargs).arguments)
        if why:
            logger.info("portable_kv: SGLang's own %s (%s)", what, why)
            return sglang_class(*args, **kwargs)
        return pool_class(*args, **kwargs)

    build_host_pool.sglang_class = sglang_class
    return build_host_pool


class SGLangPool(SGLangSurface):
    """A host pool built from SGLang's constructor arguments, with its packed drafts.

    MTP drafts (`draft_buffer_infos`, one layer each) are packed after the
    target's layers, as in SGLang's own pools: host layer ``target_layer_num +
    depth`` is draft ``depth``'s layer.  SGLang loads a packed layer into the
    draft's own device pool (``is_draft=True``) and backs every layer up given
    the target's device pool; the pool keeps one packed device view (target
    layers, then each draft's) whose per-layer tensors follow the pools SGLang
    passes, so a relocated buffer is followed, never written behind.
    """

    kind: PoolKind
    stores_page_envelope = False
    shared_allocation_domain = None
    # SGLang's staged write-back kernel: the controller asks before moving indices.
    can_use_write_back_jit = False
    # Stored as SGLang passes them: `end_layer` comes inclusive from a device pool's
    # default (`layer_num - 1`) and exclusive from the model runner; SGLang's own
    # host pools keep it as given and never read it back for a transfer.
    start_layer = 0
    end_layer: int | None = None

    def _init_from_sglang(self, target: Any, draft_buffers: Sequence[tuple[Sequence[torch.Tensor], ...]], *, host_to_device_ratio: float,
                          host_size: float, page_size: int, layout: str, pin_memory: bool, device_capacity_tokens: int, start_layer: int,
                          end_layer: int | None, pool_label: str, allocator_type: str, host_token_capacity: int | None,
                          io_backend: str | None) -> None:
        """Build the pool over `target` (a device pool of this kind) and the drafts' per-buffer layer lists."""
        packed = _packed_device_pool(target, draft_buffers, page_size)
        token_bytes = packed.layer_num * sum(h * d for h, d in _row_shapes(packed)) * packed.dtype.itemsize
        tokens = sglang_host_tokens(host_to_device_ratio, host_size, page_size, device_capacity_tokens, token_bytes, host_token_capacity)
        self._io_for = io_mapping()
        if io_backend is None:
            # SGLang passes the io backend on every call; this is only the default.
            io_backend = "direct" if layout == "page_first_direct" else "kernel"
        # The host pool sizes by ratio to the device rows, rounded up to pages:
        # half a token under the target rounds up to exactly `tokens`.
        super().__init__(packed, host_to_device_ratio=(tokens - 0.5) / packed.size, layout=layout, io_backend=self._io(io_backend),
                         pin_memory=pin_memory)
        self.target_layer_num = target.layer_num
        # SGLang's kernel io passes device indices on the GPU and host indices on the CPU.
        # Reading the device ones on the host would hold the scheduler thread until the load
        # stream, which waits for the model's stream, reached the call: the forward could
        # not be enqueued ahead.  SGLang's allocator hands them out; the kernels bound-check
        # them (an index outside the pools is skipped and flagged, the next call raises).
        self._validator.read_gpu_indices = False
        self._packed = packed if draft_buffers else None
        self.start_layer = start_layer
        self.end_layer = start_layer + target.layer_num if end_layer is None else end_layer
        self.pool_label = pool_label
        self.allocator_type = allocator_type
        self.device_capacity_tokens = device_capacity_tokens
        self._init_slots()

    # -- transfers as SGLang calls them ------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = None, is_draft: bool = False) -> None:
        """H2D, one layer.  ``is_draft``: `layer_id` is a packed draft layer and
        `device_pool` that draft's own one-layer device pool.  A target call for a
        layer past the target's is nothing to do, as in SGLang's pools: its
        transfer engine walks every transfer layer over every pool of a group."""
        layers = self._layer(layer_id)
        if is_draft:
            if not self.target_layer_num <= layer_id < self.layer_num:
                raise ValueError(f"layer_id: expected a packed draft layer in [{self.target_layer_num}, {self.layer_num}) with is_draft=True, got {layer_id}")
            device_pool = self._with_draft(device_pool, layer_id)
        elif layer_id >= self.target_layer_num:
            return
        else:
            device_pool = self._with_target(device_pool, layers)
        self._transfer(device_pool, host_indices, device_indices, layers, True, self._io(io_backend), False)

    def load_to_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        super().load_to_device_all_layer(self._with_target(device_pool), host_indices, device_indices, self._io(io_backend))

    def backup_from_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                     io_backend: str | None = None) -> None:
        super().backup_from_device_per_layer(self._with_target(device_pool, self._layer(layer_id)), host_indices, device_indices, layer_id,
                                             self._io(io_backend))

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        """D2H, every layer: the target's from `device_pool`, each packed draft's from its own device pool."""
        super().backup_from_device_all_layer(self._with_target(device_pool), host_indices, device_indices, self._io(io_backend))

    def _io(self, io_backend: str | None) -> str | None:
        return self._io_for.get(io_backend, io_backend) if type(io_backend) is str else io_backend

    def _with_target(self, device_pool: Any, layers: range | None = None) -> Any:
        """The device view a target transfer of `layers` (default: all) moves: `device_pool`
        itself, or with drafts the packed view with `device_pool`'s per-layer tensors in front."""
        packed = self._packed
        if packed is None:
            return device_pool
        given = [getattr(device_pool, name, None) for name in self.kind.buffers]
        if not all(isinstance(g, Sequence) and len(g) == self.target_layer_num for g in given):
            raise ValueError(f"device_pool: expected the target model's device pool of {self.target_layer_num} layers "
                             f"(this pool packs {self.layer_num - self.target_layer_num} draft layers after them)")
        # A per-layer call follows its own layer only: it is on the per-call host-time budget.
        moved = range(self.target_layer_num) if layers is None else range(layers.start, min(layers.stop, self.target_layer_num))
        for name, tensors in zip(self.kind.buffers, given):
            _follow(getattr(packed, name), tensors, moved)
        return packed

    def _with_draft(self, device_pool: Any, layer_id: int) -> Any:
        packed = self._packed
        given = [getattr(device_pool, name, None) for name in self.kind.buffers]
        if packed is None or not all(isinstance(g, Sequence) and len(g) == 1 for g in given):
            raise ValueError("device_pool: with is_draft=True, expected the one-layer device pool of the draft packed at layer_id")
        for name, tensors in zip(self.kind.buffers, given):
            getattr(packed, name)[layer_id] = tensors[0]
        return packed


def _row_shapes(pool: Any) -> list[tuple[int, int]]:
    return [(int(getattr(pool, name)[0].shape[1]), int(getattr(pool, name)[0].shape[2])) for name in pool.kind.buffers]


def _packed_device_pool(target: Any, draft_buffers: Sequence[tuple[Sequence[torch.Tensor], ...]], page_size: int) -> Any:
    """The target's layers, then each draft's one layer, checked to share the target's geometry."""
    if not draft_buffers:
        return target
    kind = target.kind
    lists = [list(getattr(target, name)) for name in kind.buffers]
    for depth, buffers in enumerate(draft_buffers):
        name = f"draft_buffer_infos[{depth}]"
        layers = [len(b) for b in buffers]
        if any(n != 1 for n in layers):
            raise ValueError(f"{name}: expected one packed draft layer, got {max(layers)}")
        for label, mine, theirs in zip(kind.labels, lists, buffers):
            mine, theirs = mine[0], theirs[0]
            if (theirs.shape, theirs.dtype, theirs.device) != (mine.shape, mine.dtype, mine.device):
                raise ValueError(f"{name}: expected {label} rows like the target's, {tuple(mine.shape)} {mine.dtype} on {mine.device}, "
                                 f"got {tuple(theirs.shape)} {theirs.dtype} on {theirs.device}")
        for mine, theirs in zip(lists, buffers):
            mine += list(theirs)
    if kind is MHA:
        return DeviceKVPool.from_buffers(*lists, page_size)
    return MLADevicePool.from_buffers(lists[0], page_size, kv_lora_rank=target.kv_lora_rank, qk_rope_head_dim=target.qk_rope_head_dim)


def _follow(packed: list, given: Sequence[torch.Tensor], layers: range) -> None:
    """Put the per-layer tensors SGLang passed into the packed view (the pool's binding
    sees a changed tensor by identity and checks that layer again)."""
    for layer in layers:
        packed[layer] = given[layer]
