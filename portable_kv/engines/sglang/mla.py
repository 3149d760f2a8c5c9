"""portable_kv's MLA pool as SGLang 0.5.23's `MLATokenToKVPoolHost` (docs/API.md, "The SGLang MLA host pool").

`SGLangMLAHostPool` takes SGLang's MLA host-pool constructor (a captured
`MLABufferInfo`, not a device pool) and is an `MLAHostPool` underneath: the
same checks, movers and pages as every portable_kv pool, in the shapes and
byte order of SGLang's own MLA pool.  It subclasses SGLang's
`MLATokenToKVPoolHost` so that SGLang's `isinstance` tests (the cache
controller's L3 checks, Mooncake's object layout and keys) take their MLA
branch; portable_kv's methods come first in the MRO and SGLang's
constructor never runs.  This module imports sglang; `portable_kv.engines.sglang`
loads it when `install()` runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost

from ...device_pool import MLADevicePool
from ...mla import MLAHostPool
from .pool import SGLangPool, check_layer_bounds, fallback_builder
from .surface import MLASurface

# SGLang's MLA layouts that stay SGLang's: page_unified (no SGLang transfer moves it)
# and page_first_kv_split (Ascend NPUs' split latent and indexer buffers).
SGLANG_ONLY_LAYOUTS = ("page_unified", "page_first_kv_split")


def mla_unsupported_reason(buffer_info: Any, layout: str = "", draft_buffer_infos: tuple = (), dcp_size: int = 1,
                           layer_shard_enabled: bool = False) -> str | None:
    """Why SGLang's MLA host pool for these arguments stays SGLang's own, or None."""
    for name, info in (("buffer_info", buffer_info), *((f"draft_buffer_infos[{d}]", i) for d, i in enumerate(draft_buffer_infos))):
        if isinstance(info, MLAHostAllocation):
            return f"{name}: an allocator-only MLAHostAllocation has no device buffers; portable_kv pools hold and move pages"
        if not isinstance(info, MLABufferInfo):
            return f"{name}: expected SGLang's MLABufferInfo, got {type(info).__name__}"
        if not isinstance(info.buffers, tuple) or info.native_buffers is not None:
            return f"{name}: the NPU's split MLA buffers (page_first_kv_split); portable_kv binds one latent tensor per layer"
        if info.scales is not None:
            return f"{name}: FP4 KV with separate block scales; portable_kv moves the latent rows only"
    if not buffer_info.buffers:
        return "buffer_info: no layers (an empty pipeline stage)"
    if layout in SGLANG_ONLY_LAYOUTS:
        return f"layout: {layout!r} is SGLang's own (portable_kv's MLA pool holds layer_first, page_first, page_first_direct)"
    if dcp_size != 1:
        return (f"dcp_size: decode context parallelism (dcp_size={dcp_size}) widens pages over the DCP ranks and keeps this rank's "
                "share of each; portable_kv's MLA pool holds whole pages (dcp_size=1)")
    if layer_shard_enabled:
        return "layer_shard_enabled: a layer-sharded device pool (DSA's layer split) moves a subset of layers per rank; portable_kv's pool moves every layer"
    return None


class SGLangMLAHostPool(SGLangPool, MLASurface, MLAHostPool, MLATokenToKVPoolHost):
    """An MLAHostPool built from SGLang's MLA host-pool constructor arguments.

    Sized as SGLang sizes its pool; `kv_buffer` is one tensor in SGLang's shape
    for the layout, of the device pool's storage dtype (uint8 for fp8 caches).
    MTP drafts pack after the target's layers (SGLangPool).  Transfers follow
    the device pools SGLang passes on each call, where SGLang's own pool uses
    the buffers it captured: for SGLang's device pools these are the same
    tensors.
    """

    # SGLang's MLA pool asks these of itself; portable_kv's movers need neither.
    can_use_jit = False
    staging_page_capacity = 0
    staging_token_capacity = 0
    staging_buffer = None
    _is_dummy = False

    def __init__(
        self,
        buffer_info: Any,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        override_kv_cache_dim: int | None = None,
        draft_buffer_infos: tuple = (),
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        device_capacity_tokens: int,
        start_layer: int = 0,
        end_layer: int | None = None,
        target_layer_num: int | None = None,
        layer_shard_enabled: bool = False,
        pool_label: str = "kv",
        host_token_capacity: int | None = None,
        io_backend: str | None = None,
    ) -> None:
        reason = mla_unsupported_reason(buffer_info, layout, tuple(draft_buffer_infos), dcp_size, layer_shard_enabled)
        if reason:
            raise NotImplementedError(reason)
        for info in (buffer_info, *draft_buffer_infos):
            info.validate()
        if page_size != buffer_info.page_size:
            raise ValueError(f"page_size: expected the device pool's page size {buffer_info.page_size}, got {page_size}")
        layers = len(buffer_info.buffers)
        if buffer_info.layer_indices != tuple(range(buffer_info.device_layer_num)):
            raise ValueError(f"buffer_info: expected every slot of the device pool, 0..{buffer_info.device_layer_num - 1}, "
                             f"got {buffer_info.layer_indices}")
        if target_layer_num is not None and target_layer_num != layers:
            raise ValueError(f"target_layer_num: expected the device pool's {layers} layers, got {target_layer_num}")
        width = int(buffer_info.buffers[0].shape[2])
        if override_kv_cache_dim is not None and override_kv_cache_dim != width:
            # SGLang passes the device pool's own row width (DSA's fp8 rows are wider than rank + rope).
            raise ValueError(f"override_kv_cache_dim: expected the device rows' width {width}, got {override_kv_cache_dim}")
        check_layer_bounds(start_layer, end_layer)
        target = MLADevicePool.from_buffers(buffer_info.buffers, page_size, kv_lora_rank=buffer_info.kv_lora_rank,
                                            qk_rope_head_dim=buffer_info.qk_rope_head_dim)
        self._init_from_sglang(
            target, [(info.buffers,) for info in draft_buffer_infos],
            host_to_device_ratio=host_to_device_ratio, host_size=host_size, page_size=page_size, layout=layout, pin_memory=pin_memory,
            device_capacity_tokens=device_capacity_tokens, start_layer=start_layer, end_layer=end_layer, pool_label=pool_label,
            allocator_type=allocator_type, host_token_capacity=host_token_capacity, io_backend=io_backend)
        self.override_kv_cache_dim = override_kv_cache_dim
        self.dsa_kv_cache_store_fp8 = buffer_info.packed_fp8
        # SGLang's `synchronized` methods (PageInterleaveHostPool's, around this pool) take it.
        self.lock = threading.RLock()

    def init_kv_buffer(self) -> torch.Tensor | None:
        """The host buffer, allocated at construction (SGLang's base constructor calls this to allocate)."""
        return self.kv_buffer

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """SGLang's per-layer registration triples: a pointer to each layer's first row, `kv_buffer[i]`'s
        bytes, one layer's page in bytes (page_first: pointers into the first token's slab, as SGLang's)."""
        self._check_open()
        buffer = self.kv_buffer
        refs = buffer.transpose(0, 1) if self.layout == "page_first" else buffer
        layers = range(self.layer_num)
        return [refs[i].data_ptr() for i in layers], [buffer[i].nbytes for i in layers], [self.token_stride_size * self.page_size] * self.layer_num


def host_pool_builder(sglang_class: type) -> Callable[..., Any]:
    """What install() binds as the assembler's `MLATokenToKVPoolHost`: portable_kv's pool, or
    SGLang's own class (with a log line) for arguments `mla_unsupported_reason` names."""

    def reason(given: dict[str, Any]) -> str | None:
        return mla_unsupported_reason(given["buffer_info"], given.get("layout", ""), tuple(given.get("draft_buffer_infos", ())),
                                      given.get("dcp_size", 1), given.get("layer_shard_enabled", False))

    return fallback_builder(SGLangMLAHostPool, sglang_class, reason, "MLA host pool")
