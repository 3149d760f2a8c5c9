"""portable_kv's state pool as SGLang 0.5.23's `MambaPoolHost` (docs/API.md, "SGLang host pools served and not served").

Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Kimi-Linear, Nemotron-H)
keep, per request, a recurrent state checkpoint in a slot: per Mamba layer a
temporal (SSM) state and one or more conv states, each a (layers, slots, ...)
device tensor of its own dtype.  `SGLangStateHostPool` holds each state
tensor in a `SlotRowsHostPool` (slots.py), so portable_kv's io paths move the
bytes on every backend, and answers SGLang's `MambaPoolHost` contract: its
constructor as SGLang's pool assembler calls it, slots (page_size 1), the
per-layer load and the all-layer backup, MTP drafts' states packed after the
target's layers, and pages for L3 tiers in SGLang's byte order (the temporal
state's rows of a slot over all layers, then each conv state's).  It
subclasses SGLang's class so that SGLang's `isinstance` tests take their
Mamba branch; SGLang's constructor never runs.  This module imports sglang.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from ...allocator import PageRunAllocator
from ...host_memory import check_available
from .pool import fallback_builder
from .slots import SlotRows, SlotRowsHostPool, contiguous_slots
from .surface import HostSlots, PhysicalNames

logger = logging.getLogger(__name__)

# What SGLang's Mamba host pool offers: one state slot is one page in either.
STATE_LAYOUTS = ("page_first", "page_first_direct")


def state_unsupported_reason(buffer_info: Any, layout: str = "page_first_direct", mtp_draft_buffer_infos: tuple = ()) -> str | None:
    """Why SGLang's Mamba host pool for these arguments stays SGLang's own, or None."""
    for name, info in (("buffer_info", buffer_info), *((f"mtp_draft_buffer_infos[{d}]", i) for d, i in enumerate(mtp_draft_buffer_infos))):
        if not isinstance(info, MambaStateBufferInfo):
            return f"{name}: expected SGLang's MambaStateBufferInfo, got {type(info).__name__}"
        if info.extra_checkpoint_buffers:
            return (f"{name}: slot side states (extra_checkpoint_buffers) ride with the checkpoint; "
                    "portable_kv's state pool holds the temporal and conv states")
        if not all(contiguous_slots(t) for t in (info.temporal, *info.conv)):
            return (f"{name}: strided state slots (a unified state envelope, or the CPU AMX conv layout); "
                    "portable_kv moves contiguous slot rows")
    if layout not in STATE_LAYOUTS:
        return f"layout: {layout!r} (SGLang's Mamba host pool holds {', '.join(STATE_LAYOUTS)})"
    return None


class SGLangStateHostPool(HostSlots, PhysicalNames, MambaPoolHost):
    """Recurrent state checkpoints in host memory, one slot per request checkpoint, each state tensor a `SlotRowsHostPool`.

    Sized as SGLang sizes its Mamba pool (``int(device_capacity * ratio)``
    slots, or `host_size` GB, plus one).  `temporal_buffer` and `conv_buffer`
    are SGLang's shapes, (slots, layers, 1, *state shape), viewing the state
    pools' memory.  Transfers follow the device pool SGLang passes on each
    call: the target's Mamba pool, or on ``is_draft=True`` loads a draft's.
    """

    page_size = 1
    device = "cpu"
    # SGLang's pool group ANDs this over its pools: True keeps the host indices of a
    # write on the CPU for pools that need them there; this pool takes either.
    can_use_write_back_jit = True
    slot_state_device_tensors: tuple = ()
    slot_state_buffers: tuple = ()

    def __init__(
        self,
        buffer_info: MambaStateBufferInfo,
        host_to_device_ratio: float,
        host_size: float,
        *,
        device_capacity: int,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        layout: str = "page_first_direct",
        mtp_draft_buffer_infos: tuple = (),
        io_backend: str | None = None,
    ) -> None:
        drafts = tuple(mtp_draft_buffer_infos)
        reason = state_unsupported_reason(buffer_info, layout, drafts)
        if reason:
            raise NotImplementedError(reason)
        buffer_info.validate()
        for depth, draft in enumerate(drafts):
            draft.validate()
            _check_draft(depth, buffer_info, draft)
        self.buffer_info, self.mtp_draft_buffer_infos = buffer_info, drafts
        self.device_pool = None
        self.layout, self.pin_memory, self.allocator_type = layout, pin_memory, allocator_type
        self.num_mamba_layers = int(buffer_info.temporal.shape[0]) + len(drafts)
        self.conv_state_shapes = [conv.shape[2:] for conv in buffer_info.conv]
        self.temporal_state_shape = buffer_info.temporal.shape[2:]
        self.temporal_state_elem_size = math.prod(self.temporal_state_shape)
        self.conv_state_elem_sizes = [math.prod(shape) for shape in self.conv_state_shapes]
        self.conv_dtype, self.temporal_dtype = buffer_info.conv[0].dtype, buffer_info.temporal.dtype
        self.dtype = self.conv_dtype
        self.size_per_token = self.get_size_per_token()
        wanted = int(host_size * 1e9 // self.size_per_token) if host_size and host_size > 0 else int(device_capacity * host_to_device_ratio)
        self.size = self.page_num = wanted + 1  # SGLang's padding slot
        if self.size <= device_capacity:
            logger.warning("portable_kv: the host state pool (%d slots) is no larger than the device's (%d); raise --hicache-ratio",
                           self.size, device_capacity)
        check_available(self.size * self.size_per_token)

        # Per-layer slot views of each device state tensor, made once per tensor
        # (SGLang's state tensors never move after allocation) and kept by identity,
        # so a pool's binding finds the same views on every call.
        self._views: dict[int, tuple[torch.Tensor, SlotRows]] = {}
        self._device_pools: dict[int, tuple[Any, list[SlotRows]]] = {}
        self._states: list[SlotRowsHostPool] = []
        try:
            for index, (name, tensor) in enumerate(self._state_tensors(buffer_info)):
                self._states.append(SlotRowsHostPool(
                    self._rows(tensor), [self._rows(self._state_tensors(d)[index][1]) for d in drafts], slots=self.size, layout=layout,
                    pin_memory=pin_memory, io_backend=io_backend, pool_label=name, allocator_type=allocator_type))
        except BaseException:
            for state in self._states:
                state.close()
            raise
        host = iter(state.kv_buffer for state in self._states)
        layers = self.num_mamba_layers
        self.temporal_buffer = (next(host).view(self.size, layers, 1, *self.temporal_state_shape) if self.temporal_state_elem_size
                                else torch.empty((self.size, layers, 1, *self.temporal_state_shape), dtype=self.temporal_dtype))
        self.conv_buffer = [next(host).view(self.size, layers, 1, *shape) for shape in self.conv_state_shapes]
        self.kv_buffer = [buffer for buffer in (self.temporal_buffer, *self.conv_buffer) if buffer.numel()]
        self._slots = PageRunAllocator(self.size, 1)  # one state slot a page (HostSlots)
        self._destroyed = False
        self.lock = threading.RLock()

    def _state_tensors(self, info: MambaStateBufferInfo) -> list[tuple[str, torch.Tensor]]:
        """The state tensors a slot holds, in SGLang's page order: temporal (none in conv-only models), then each conv."""
        temporal = [("temporal", info.temporal)] if self.temporal_state_elem_size else []
        return temporal + [(f"conv_{i}", conv) for i, conv in enumerate(info.conv)]

    def _rows(self, tensor: torch.Tensor) -> SlotRows:
        held = self._views.get(id(tensor))
        if held is None or held[0] is not tensor:
            held = self._views[id(tensor)] = (tensor, SlotRows(tensor.unbind(0)))
        return held[1]

    def _rows_of(self, device_pool: Any) -> list[SlotRows]:
        """Each state's slot rows in `device_pool` (SGLang's MambaPool, or its MambaStateBufferInfo)."""
        held = self._device_pools.get(id(device_pool))
        if held is None or held[0] is not device_pool:
            info = device_pool if isinstance(device_pool, MambaStateBufferInfo) else device_pool.get_device_pool_infos()[0].buffer_info
            held = self._device_pools[id(device_pool)] = (device_pool, [self._rows(t) for _, t in self._state_tensors(info)])
        return held[1]

    def init_kv_buffer(self) -> list[torch.Tensor]:
        """The host buffers, allocated at construction."""
        return self.kv_buffer

    # -- sizes --------------------------------------------------------------------------

    def get_size_per_token(self) -> int:
        """Bytes of one slot: every state over every layer (drafts' too)."""
        conv = sum(size * self.conv_dtype.itemsize for size in self.conv_state_elem_sizes)
        return (conv + self.temporal_state_elem_size * self.temporal_dtype.itemsize) * self.num_mamba_layers

    # -- transfers as SGLang calls them ------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = "kernel", *, is_draft: bool = False) -> None:
        """H2D, one Mamba layer of every state.  ``is_draft``: `layer_id` is a packed draft
        layer and `device_pool` that draft's own one-layer Mamba pool."""
        for state, rows in zip(self._states, self._rows_of(device_pool)):
            state.load_to_device_per_layer(rows, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                     io_backend: str | None = "kernel") -> None:
        """D2H, every layer of every state: the target's from `device_pool`, each packed draft's from its own pool."""
        for state, rows in zip(self._states, self._rows_of(device_pool)):
            state.backup_from_device_all_layer(rows, host_indices, device_indices, io_backend)

    # -- pages for L3 tiers -------------------------------------------------------------

    def get_data_page(self, index: Any, flat: bool = True) -> torch.Tensor:
        """Slot `index` as bytes: each state's rows over all layers in turn (SGLang's flat Mamba page)."""
        return torch.cat([state.page_bytes(index) for state in self._states])

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: Any, data_page: torch.Tensor) -> None:
        data = data_page.contiguous().view(torch.uint8).reshape(-1)
        if data.numel() != self.size_per_token:
            raise ValueError(f"data_page: expected {self.size_per_token} bytes (one state slot), got {data.numel()}")
        start = 0
        for state in self._states:
            size = state.layer_num * state.row_bytes
            state.set_page_bytes(index, data[start : start + size])
            start += size

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """Per slot, each state's block: ``[temporal, conv_0, ...]`` (no temporal in conv-only models), as SGLang's."""
        metas = [state.get_page_buffer_meta(indices) for state in self._states]
        pointers = [p for per_slot in zip(*(m[0] for m in metas)) for p in per_slot]
        sizes = [s for per_slot in zip(*(m[1] for m in metas)) for s in per_slot]
        return pointers, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return all(state.is_stride_page_aligned(page_size_bytes) for state in self._states)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """The host tensors a storage tier registers: temporal, then each conv state."""
        return [self.temporal_buffer, *self.conv_buffer]

    def destroy(self) -> None:
        """Release the host memory; idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        for state in self._states:
            state.close()
        self.kv_buffer = None


def _check_draft(depth: int, target: MambaStateBufferInfo, draft: MambaStateBufferInfo) -> None:
    name = f"mtp_draft_buffer_infos[{depth}]"
    if draft.temporal.shape[0] != 1 or len(draft.conv) != len(target.conv):
        raise ValueError(f"{name}: expected one Mamba layer with {len(target.conv)} conv states, got "
                         f"{draft.temporal.shape[0]} layers and {len(draft.conv)} conv states")
    for mine, theirs in zip((target.temporal, *target.conv), (draft.temporal, *draft.conv)):
        if (theirs.shape[1:], theirs.dtype, theirs.device) != (mine.shape[1:], mine.dtype, mine.device):
            raise ValueError(f"{name}: expected states like the target's, {tuple(mine.shape[1:])} {mine.dtype} on {mine.device}, "
                             f"got {tuple(theirs.shape[1:])} {theirs.dtype} on {theirs.device}")


def host_pool_builder(sglang_class: type) -> Callable[..., Any]:
    """What install() binds as the assembler's `MambaPoolHost`: portable_kv's state pool, or
    SGLang's own class (with a log line) for arguments `state_unsupported_reason` names."""

    def reason(given: dict[str, Any]) -> str | None:
        return state_unsupported_reason(given["buffer_info"], given.get("layout", "layer_first"), tuple(given.get("mtp_draft_buffer_infos", ())))

    return fallback_builder(SGLangStateHostPool, sglang_class, reason, "Mamba host pool")
