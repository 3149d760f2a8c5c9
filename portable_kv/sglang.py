"""portable_kv as SGLang 0.5.23's HiCache host pool (docs/API.md, "The SGLang host-pool surface").

`install()` makes SGLang's host-pool builder return `SGLangHostPool` for MHA
models, asymmetric ones (K and V head dims differ) included.  MLA models keep
SGLang's own pool: portable_kv moves split K/V pages, not MLA's one latent row.
sglang is imported here only, and only when `install()` runs.
"""

from __future__ import annotations

import logging
from typing import Any

from .device_pool import DeviceKVPool
from .pool import AsymmetricHostPool

logger = logging.getLogger(__name__)

# The modules that hold `get_mha_host_pool_cls` under that name: where SGLang
# defines it, and the assembler, which bound it by name at its import.
_BUILDER_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
)
_original_builder: Any = None


def unsupported_reason(buffer_info: Any) -> str | None:
    """Why SGLang's device buffers described by `buffer_info` cannot get a portable_kv pool, or None."""
    name = type(buffer_info).__name__
    if name != "MHABufferInfo":
        return f"{name}: portable_kv holds MHA K/V pages; MLA and other pools keep SGLang's own host pool"
    if buffer_info.scales is not None:
        return "per-token KV scales (MXFP8): portable_kv moves K and V only"
    if buffer_info.transfer_buffers is not None:
        return "relocatable device buffers (transfer_buffers): portable_kv binds per-layer tensors"
    return None


class SGLangHostPool(AsymmetricHostPool):
    """An AsymmetricHostPool built from SGLang's host-pool constructor arguments.

    Sized as SGLang sizes its pool (``int(device_capacity_tokens * ratio)``
    tokens, or `host_size` GB, plus one page), so the radix tree sees the same
    capacity; ``host_token_capacity`` fixes the size exactly.  The device
    buffers of `buffer_info` give the geometry; transfers then take SGLang's
    device pool as given on each call (see SGLangSurface).
    """

    stores_page_envelope = False
    shared_allocation_domain = None
    # SGLang's staged write-back kernel: the controller asks before moving indices.
    can_use_write_back_jit = False

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
        *,
        device_capacity_tokens: int,
        start_layer: int = 0,
        end_layer: int | None = None,
        draft_buffer_infos: tuple = (),
        write_back_staging: Any = None,
        pool_label: str = "kv",
        head_group_num: int = 1,
        host_token_capacity: int | None = None,
        io_backend: str | None = None,
    ) -> None:
        reason = unsupported_reason(buffer_info)
        if reason:
            raise NotImplementedError(f"buffer_info: {reason}")
        if draft_buffer_infos:
            raise NotImplementedError("draft_buffer_infos: packed speculative-draft layers are not supported; leave portable_kv uninstalled for MTP models")
        if head_group_num != 1:
            raise NotImplementedError(f"head_group_num: only SGLang's page_unified layout groups heads; got {head_group_num}")
        if page_size != buffer_info.page_size:
            raise ValueError(f"page_size: expected the device pool's page size {buffer_info.page_size}, got {page_size}")
        device_pool = DeviceKVPool.from_buffers(buffer_info.buffers.k, buffer_info.buffers.v, page_size)
        layers = len(buffer_info.buffers.k)
        token_bytes = layers * buffer_info.head_num * (buffer_info.head_dim + buffer_info.v_head_dim) * buffer_info.dtype.itemsize
        if host_token_capacity is not None:
            if host_token_capacity <= 0 or host_token_capacity % page_size:
                raise ValueError(f"host_token_capacity: expected a positive multiple of page_size={page_size}, got {host_token_capacity}")
            tokens = host_token_capacity
        else:
            wanted = int(host_size * 1e9 // token_bytes) if host_size and host_size > 0 else int(device_capacity_tokens * host_to_device_ratio)
            tokens = (wanted // page_size + 1) * page_size  # SGLang's padding page
        if io_backend is None:
            # SGLang passes the io backend on every call; this is only the default.
            io_backend = "direct" if layout == "page_first_direct" else "kernel"
        # AsymmetricHostPool sizes by ratio to the device rows, rounded up to pages:
        # half a token under the target rounds up to exactly `tokens`.
        super().__init__(
            device_pool,
            host_to_device_ratio=(tokens - 0.5) / device_pool.size,
            layout=layout,
            io_backend=io_backend,
            pin_memory=pin_memory,
        )
        if end_layer is not None and end_layer - start_layer != self.layer_num:
            raise ValueError(f"end_layer: expected start_layer + {self.layer_num} layers = {start_layer + self.layer_num}, got {end_layer}")
        self.start_layer = start_layer
        self.pool_label = pool_label
        self.allocator_type = allocator_type
        self.device_capacity_tokens = device_capacity_tokens


def install() -> None:
    """Make SGLang's HiCache build portable_kv host pools for MHA models (idempotent).

    Replaces `get_mha_host_pool_cls` where SGLang defines it and where its
    pool assembler bound it, whichever was imported first.  Buffers portable_kv
    does not hold (MLA, MXFP8 scales, relocatable pools; `unsupported_reason`)
    still get SGLang's own class, with a log line saying why.
    """
    import importlib

    global _original_builder
    modules = [importlib.import_module(name) for name in _BUILDER_MODULES]
    if _original_builder is None:
        _original_builder = modules[0].get_mha_host_pool_cls
    original = _original_builder

    def get_mha_host_pool_cls(buffer_info: Any) -> type:
        reason = unsupported_reason(buffer_info)
        if reason:
            logger.info("portable_kv: SGLang's own host pool for this model (%s)", reason)
            return original(buffer_info)
        return SGLangHostPool

    for module in modules:
        module.get_mha_host_pool_cls = get_mha_host_pool_cls
    logger.info("portable_kv: SGLang's HiCache builds portable_kv host pools for MHA models")


def uninstall() -> None:
    """Give SGLang its own host-pool builder back."""
    import importlib

    global _original_builder
    if _original_builder is None:
        return
    for name in _BUILDER_MODULES:
        importlib.import_module(name).get_mha_host_pool_cls = _original_builder
    _original_builder = None
