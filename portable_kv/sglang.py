"""portable_kv as SGLang 0.5.23's HiCache host pool (docs/API.md, "The SGLang host-pool surface").

`install()` makes SGLang's host-pool builder return `SGLangHostPool` for MHA
models, asymmetric ones (K and V head dims differ) included, wherever SGLang's
assembler builds one: a plain pool, the full and SWA pools of a hybrid
sliding-window stack (MiMo-V2-Flash), and pools with MTP draft layers packed
after the target's.  MLA models keep SGLang's own pool: portable_kv moves split
K/V pages, not MLA's one latent row.  sglang is imported only when `install()`
runs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

from . import config
from .device_pool import DeviceKVPool
from .io.mover import IO_PATHS
from .pool import AsymmetricHostPool

logger = logging.getLogger(__name__)

# The modules that hold `get_mha_host_pool_cls` under that name: where SGLang
# defines it, and the assembler, which bound it by name at its import.
_BUILDER_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
)
# SGLang's own functions that install() replaced, to give back on uninstall().
_originals: dict[str, Any] = {}
# The release of SGLang whose pool assembler, controller and host pools this module drives.
SGLANG_VERSION = "0.5.23"
# What SGLang's `--hicache-io-backend` offers for MHA pools on GPUs.
SGLANG_IO_CHOICES = ("kernel", "direct")


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

    MTP drafts (`draft_buffer_infos`, one layer each) are packed after the
    target's layers, as in SGLang's own pool: host layer ``target_layer_num +
    depth`` is draft ``depth``'s layer.  SGLang loads a packed layer into the
    draft's own device pool (``is_draft=True``) and backs every layer up given
    the target's device pool; the pool keeps one packed device view (target
    layers, then each draft's) whose per-layer tensors follow the pools SGLang
    passes, so a relocated buffer is followed, never written behind.
    """

    stores_page_envelope = False
    shared_allocation_domain = None
    # SGLang's staged write-back kernel: the controller asks before moving indices.
    can_use_write_back_jit = False
    # Stored as SGLang passes them: `end_layer` comes inclusive from a device pool's
    # default (`layer_num - 1`) and exclusive from the model runner; SGLang's own
    # host pool keeps it as given and never reads it back for a transfer.
    start_layer = 0
    end_layer: int | None = None

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
        for name, info in (("buffer_info", buffer_info), *((f"draft_buffer_infos[{d}]", i) for d, i in enumerate(draft_buffer_infos))):
            reason = unsupported_reason(info)
            if reason:
                raise NotImplementedError(f"{name}: {reason}")
        if head_group_num != 1:
            raise NotImplementedError(f"head_group_num: only SGLang's page_unified layout groups heads; got {head_group_num}")
        if page_size != buffer_info.page_size:
            raise ValueError(f"page_size: expected the device pool's page size {buffer_info.page_size}, got {page_size}")
        for name, value in (("start_layer", start_layer), ("end_layer", end_layer)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}: expected an int, got {value!r}")
        target = DeviceKVPool.from_buffers(buffer_info.buffers.k, buffer_info.buffers.v, page_size)
        packed = _packed_device_pool(target, draft_buffer_infos, page_size)
        layers = packed.layer_num
        token_bytes = layers * buffer_info.head_num * (buffer_info.head_dim + buffer_info.v_head_dim) * buffer_info.dtype.itemsize
        if host_token_capacity is not None:
            if host_token_capacity <= 0 or host_token_capacity % page_size:
                raise ValueError(f"host_token_capacity: expected a positive multiple of page_size={page_size}, got {host_token_capacity}")
            tokens = host_token_capacity
        else:
            wanted = int(host_size * 1e9 // token_bytes) if host_size and host_size > 0 else int(device_capacity_tokens * host_to_device_ratio)
            tokens = (wanted // page_size + 1) * page_size  # SGLang's padding page
        self._io_for = io_mapping()
        if io_backend is None:
            # SGLang passes the io backend on every call; this is only the default.
            io_backend = "direct" if layout == "page_first_direct" else "kernel"
        # AsymmetricHostPool sizes by ratio to the device rows, rounded up to pages:
        # half a token under the target rounds up to exactly `tokens`.
        super().__init__(
            packed,
            host_to_device_ratio=(tokens - 0.5) / packed.size,
            layout=layout,
            io_backend=self._io(io_backend),
            pin_memory=pin_memory,
        )
        self.target_layer_num = target.layer_num
        # SGLang's kernel io passes device indices on the GPU and host indices on the CPU.
        # Reading the device ones on the host would hold the scheduler thread until the load
        # stream, which waits for the model's stream, reached the call: the forward could
        # not be enqueued ahead.  SGLang's allocator hands them out; the kernels bound-check
        # them (an index outside the pools is skipped and flagged, the next call raises).
        self._validator.read_gpu_indices = False
        self._packed = packed if draft_buffer_infos else None
        self.start_layer = start_layer
        self.end_layer = start_layer + target.layer_num if end_layer is None else end_layer
        self.pool_label = pool_label
        self.allocator_type = allocator_type
        self.device_capacity_tokens = device_capacity_tokens

    # -- transfers as SGLang calls them ------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = None, is_draft: bool = False) -> None:
        """H2D, one layer.  ``is_draft``: `layer_id` is a packed draft layer and
        `device_pool` that draft's own one-layer device pool.  A target call for a
        layer past the target's is nothing to do, as in SGLang's pool: its
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
        self._transfer(device_pool, host_indices, device_indices, layers, True, self._io(io_backend))

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
        k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
        if not isinstance(k, Sequence) or not isinstance(v, Sequence) or len(k) != self.target_layer_num or len(v) != self.target_layer_num:
            raise ValueError(f"device_pool: expected the target model's device pool of {self.target_layer_num} layers "
                             f"(this pool packs {self.layer_num - self.target_layer_num} draft layers after them)")
        # A per-layer call follows its own layer only: it is on the per-call host-time budget.
        moved = range(self.target_layer_num) if layers is None else range(layers.start, min(layers.stop, self.target_layer_num))
        _follow(packed.k_buffer, k, moved)
        _follow(packed.v_buffer, v, moved)
        return packed

    def _with_draft(self, device_pool: Any, layer_id: int) -> Any:
        packed = self._packed
        k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
        if packed is None or not isinstance(k, Sequence) or not isinstance(v, Sequence) or len(k) != 1 or len(v) != 1:
            raise ValueError("device_pool: with is_draft=True, expected the one-layer device pool of the draft packed at layer_id")
        packed.k_buffer[layer_id], packed.v_buffer[layer_id] = k[0], v[0]
        return packed


def _packed_device_pool(target: DeviceKVPool, draft_buffer_infos: Sequence[Any], page_size: int) -> DeviceKVPool:
    """The target's layers, then each draft's one layer, checked to share the target's geometry."""
    if not draft_buffer_infos:
        return target
    k, v = list(target.k_buffer), list(target.v_buffer)
    for depth, info in enumerate(draft_buffer_infos):
        draft_k, draft_v = list(info.buffers.k), list(info.buffers.v)
        name = f"draft_buffer_infos[{depth}]"
        if len(draft_k) != 1 or len(draft_v) != 1:
            raise ValueError(f"{name}: expected one packed draft layer, got {len(draft_k)}")
        for side, mine, theirs in (("K", k[0], draft_k[0]), ("V", v[0], draft_v[0])):
            if (theirs.shape, theirs.dtype, theirs.device) != (mine.shape, mine.dtype, mine.device):
                raise ValueError(f"{name}: expected {side} rows like the target's, {tuple(mine.shape)} {mine.dtype} on {mine.device}, "
                                 f"got {tuple(theirs.shape)} {theirs.dtype} on {theirs.device}")
        k += draft_k
        v += draft_v
    return DeviceKVPool.from_buffers(k, v, page_size)


def _follow(packed: list, given: Sequence[torch.Tensor], layers: range) -> None:
    """Put the per-layer tensors SGLang passed into the packed view (the pool's binding
    sees a changed tensor by identity and checks that layer again)."""
    for layer in layers:
        packed[layer] = given[layer]


def io_mapping() -> dict[str, str]:
    """SGLang's `--hicache-io-backend` choice -> the portable_kv io path, from PORTABLE_KV_SGLANG_IO.

    SGLang offers `kernel` and `direct` and passes one on every call; the setting
    lets its pools use `staged` or `auto` too: one path (every call takes it) or
    pairs (``kernel=auto,direct=staged``).
    """
    raw = config.SGLANG_IO.raw()
    if not raw:
        return {}
    pairs = [part.strip() for part in raw.split(",") if part.strip()]
    if len(pairs) == 1 and "=" not in pairs[0]:
        pairs = [f"{choice}={pairs[0]}" for choice in SGLANG_IO_CHOICES]
    mapping = {}
    for pair in pairs:
        choice, _, path = (text.strip() for text in pair.partition("="))
        if choice not in SGLANG_IO_CHOICES or path not in IO_PATHS:
            raise config.ConfigError(f"{config.SGLANG_IO.name}: expected one of {', '.join(IO_PATHS)} or pairs like "
                                     f"kernel=staged,direct=auto (SGLang's choices: {', '.join(SGLANG_IO_CHOICES)}), got {raw!r}")
        mapping[choice] = path
    return mapping


def install() -> None:
    """Make SGLang's HiCache build portable_kv host pools for MHA-family models (idempotent).

    Replaces `get_mha_host_pool_cls` where SGLang defines it and where its
    pool assembler bound it, whichever was imported first: every MHA host pool
    SGLang builds is then portable_kv's, the plain pool, the full and SWA pools
    of a hybrid sliding-window stack and the pools MTP drafts are packed into.
    Buffers portable_kv does not hold (MLA, MXFP8 scales, relocatable pools;
    `unsupported_reason`) still get SGLang's own class, with a log line saying
    why; so does `--enable-unified-memory`'s shared full/SWA arena.
    """
    modules = _sglang_modules()
    if not _originals:
        _originals["builder"] = modules[0].get_mha_host_pool_cls
        _originals["envelope"] = modules[1]._uses_unified_page_envelope_host
    original, envelope = _originals["builder"], _originals["envelope"]

    def get_mha_host_pool_cls(buffer_info: Any) -> type:
        reason = unsupported_reason(buffer_info)
        if reason:
            logger.info("portable_kv: SGLang's own host pool for this model (%s)", reason)
            return original(buffer_info)
        return SGLangHostPool

    def uses_unified_page_envelope_host(*args: Any, **kwargs: Any) -> bool:
        unified = envelope(*args, **kwargs)
        if unified:
            logger.info("portable_kv: SGLang's own UnifiedPageEnvelopeHostPool for this hybrid pool pair (--enable-unified-memory "
                        "keeps full and SWA pages in one shared host arena; portable_kv holds one pool per geometry)")
        return unified

    for module in modules:
        module.get_mha_host_pool_cls = get_mha_host_pool_cls
    modules[1]._uses_unified_page_envelope_host = uses_unified_page_envelope_host
    logger.info("portable_kv: SGLang's HiCache builds portable_kv host pools for MHA models")


def plugin() -> None:
    """SGLang's general-plugin hook (entry point group ``sglang.srt.plugins``).

    SGLang calls it early in every server process, the spawned schedulers
    included, where a call to `install()` in the launcher would not reach.
    It installs only where PORTABLE_KV_SGLANG=1.
    """
    if config.SGLANG.flag():
        install()


def uninstall() -> None:
    """Give SGLang its own host-pool builder back."""
    if not _originals:
        return
    modules = _sglang_modules()
    for module in modules:
        module.get_mha_host_pool_cls = _originals["builder"]
    modules[1]._uses_unified_page_envelope_host = _originals["envelope"]
    _originals.clear()


def _sglang_modules() -> list[Any]:
    """SGLang's modules `install()` patches, or one line saying which SGLang this release drives."""
    try:
        modules = [importlib.import_module(name) for name in _BUILDER_MODULES]
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "sglang":
            raise
        raise ImportError(f"portable_kv.sglang drives SGLang {SGLANG_VERSION}'s HiCache, which is not installed here: "
                          f"pip install sglang=={SGLANG_VERSION} (docs/API.md, \"The SGLang host-pool surface\")", name="sglang") from None
    version = getattr(importlib.import_module("sglang"), "__version__", None)
    if version != SGLANG_VERSION:
        logger.warning("portable_kv: drives SGLang %s's HiCache, found %s; its pool assembler may call the host pool differently",
                       SGLANG_VERSION, version)
    return modules
