"""portable_kv as SGLang 0.5.23's HiCache host pool (docs/API.md, "The SGLang host-pool surface").

`install()` makes SGLang's pool assembler build portable_kv pools wherever it
builds an MHA, an MLA, a Mamba state (mamba.py) or a DSA indexer (dsa.py) host pool: `SGLangHostPool` for MHA models, asymmetric
ones (K and V head dims differ) included (a plain pool, the full and SWA pools
of a hybrid sliding-window stack such as MiMo-V2-Flash), `SGLangMLAHostPool`
(mla.py) for MLA models (DeepSeek-V3/R1, Kimi-K2), each with MTP draft
layers packed after the target's.  sglang is imported only when `install()`
runs or `SGLangMLAHostPool` is asked for.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ... import config
from ...device_pool import DeviceKVPool
from ...pool import AsymmetricHostPool
from .pool import SGLANG_IO_CHOICES, SGLangPool, check_layer_bounds, io_mapping

logger = logging.getLogger(__name__)

# The modules that hold `get_mha_host_pool_cls` under that name: where SGLang
# defines it, and the assembler, which bound it by name at its import.  The
# assembler also bound `MLATokenToKVPoolHost`, which it reads at every call.
_BUILDER_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
)
# Where SGLang binds DSAIndexerPoolHost: its DSA strategy's builder and the assembler's
# draft indexer both read it from this module at each call.
_DSA_MODULE = "sglang.srt.mem_cache.pool_host.dsa"
# The host pools SGLang 0.5.23 builds that stay its own whatever the arguments, and why.
SGLANG_ONLY_POOLS = {
    "DeepSeekV4PagedHostPool and its compressed/indexer/state side pools (DeepSeek-V4)":
        "pages of several compression ratios and states in one paged envelope; portable_kv's pools hold one row geometry each",
    "QSAIndexerPoolHost (QSA sparse-attention index keys)": "compressed index pages with their own page mapping",
    "MHATokenToKVPoolHostMXFP8 (MXFP8 KV with per-token scales)": "portable_kv moves K and V without scales",
    "PageUnifiedHostPool and UnifiedPageEnvelopeHostPool (page_unified layout, --enable-unified-memory)":
        "several pools' pages share one host arena; portable_kv holds one pool per geometry",
}
# SGLang's own functions and classes that install() replaced, to give back on uninstall().
_originals: dict[str, Any] = {}
# The release of SGLang whose pool assembler, controller and host pools this module drives.
SGLANG_VERSION = "0.5.23"
# SGLangMLAHostPool loads on first use (module __getattr__ below).
__all__ = ["SGLANG_IO_CHOICES", "SGLANG_VERSION", "SGLangHostPool", "install", "io_mapping", "plugin", "uninstall", "unsupported_reason"]


def __getattr__(name: str) -> Any:
    # SGLangMLAHostPool subclasses SGLang's own MLA pool, so its module imports sglang.
    if name == "SGLangMLAHostPool":
        from .mla import SGLangMLAHostPool

        return SGLangMLAHostPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unsupported_reason(buffer_info: Any) -> str | None:
    """Why SGLang's device buffers described by `buffer_info` cannot get a portable_kv pool, or None."""
    name = type(buffer_info).__name__
    if name != "MHABufferInfo":
        return f"{name}: SGLangHostPool holds MHA K/V pages (SGLang builds MLA pools by another name: SGLangMLAHostPool)"
    if buffer_info.scales is not None:
        return "per-token KV scales (MXFP8): portable_kv moves K and V only"
    if buffer_info.transfer_buffers is not None:
        return "relocatable device buffers (transfer_buffers): portable_kv binds per-layer tensors"
    return None


class SGLangHostPool(SGLangPool, AsymmetricHostPool):
    """An AsymmetricHostPool built from SGLang's MHA host-pool constructor arguments.

    Sized as SGLang sizes its pool (``int(device_capacity_tokens * ratio)``
    tokens, or `host_size` GB, plus one page), so the radix tree sees the same
    capacity; ``host_token_capacity`` fixes the size exactly.  The device
    buffers of `buffer_info` give the geometry; transfers then take SGLang's
    device pool as given on each call (see SGLangSurface), and MTP drafts are
    packed after the target's layers (SGLangPool).
    """

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
        check_layer_bounds(start_layer, end_layer)
        self._init_from_sglang(
            DeviceKVPool.from_buffers(buffer_info.buffers.k, buffer_info.buffers.v, page_size),
            [(info.buffers.k, info.buffers.v) for info in draft_buffer_infos],
            host_to_device_ratio=host_to_device_ratio, host_size=host_size, page_size=page_size, layout=layout, pin_memory=pin_memory,
            device_capacity_tokens=device_capacity_tokens, start_layer=start_layer, end_layer=end_layer, pool_label=pool_label,
            allocator_type=allocator_type, host_token_capacity=host_token_capacity, io_backend=io_backend)


def install() -> None:
    """Make SGLang's HiCache build portable_kv host pools for MHA and MLA models (idempotent).

    Replaces `get_mha_host_pool_cls` where SGLang defines it and where its
    pool assembler bound it, whichever was imported first, and the assembler's
    `MLATokenToKVPoolHost`: every MHA and MLA host pool SGLang's assembler
    builds is then portable_kv's, the plain pool, the full and SWA pools of a
    hybrid sliding-window stack, MLA pools (DSA's latent pool among them) and
    the pools MTP drafts are packed into.  What portable_kv does not hold
    (MXFP8 scales, relocatable pools: `unsupported_reason`; FP4 MLA, decode
    context parallelism, layer-sharded MLA pools:
    `mla.mla_unsupported_reason`) still gets SGLang's own class, with a
    log line saying why; so does `--enable-unified-memory`'s shared full/SWA arena.
    SGLang's Mamba state pool (`mamba.SGLangStateHostPool`) and DSA indexer pool
    (`dsa.SGLangDSAIndexerHostPool`) are portable_kv's too, where their reasons
    (`state_unsupported_reason`, `indexer_unsupported_reason`) name nothing;
    the pool kinds of `SGLANG_ONLY_POOLS` stay SGLang's, one log line each.
    """
    config.check_all()  # a malformed PORTABLE_KV_* setting fails here, not when SGLang builds its first pool
    modules = _sglang_modules()
    from . import dsa as sglang_dsa
    from . import mamba as sglang_mamba
    from . import mla as sglang_mla

    dsa_module = importlib.import_module(_DSA_MODULE)
    if not _originals:
        _originals["builder"] = modules[0].get_mha_host_pool_cls
        _originals["envelope"] = modules[1]._uses_unified_page_envelope_host
        _originals["mla"] = modules[1].MLATokenToKVPoolHost
        _originals["mamba"] = modules[1].MambaPoolHost
        _originals["dsa_indexer"] = dsa_module.DSAIndexerPoolHost
    original, envelope = _originals["builder"], _originals["envelope"]

    def get_mha_host_pool_cls(buffer_info: Any) -> type:
        reason = unsupported_reason(buffer_info) or _sglang_only_layout()
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
    modules[1].MLATokenToKVPoolHost = sglang_mla.host_pool_builder(_originals["mla"])
    modules[1].MambaPoolHost = sglang_mamba.host_pool_builder(_originals["mamba"])
    dsa_module.DSAIndexerPoolHost = sglang_dsa.host_pool_builder(_originals["dsa_indexer"])
    logger.info("portable_kv: SGLang's HiCache builds portable_kv host pools for MHA and MLA models, Mamba states and DSA index keys")
    for kind, reason in SGLANG_ONLY_POOLS.items():
        logger.info("portable_kv: SGLang's own %s (%s)", kind, reason)


def _sglang_only_layout() -> str | None:
    """Why the host layout SGLang's assembler passes its MHA pools keeps SGLang's own pool, or None."""
    from sglang.srt.runtime_context import get_memory

    layout = get_memory().hicache_mem_layout
    if layout == "page_unified":
        return "layout: 'page_unified' interleaves K and V in head-group blocks that only SGLang's kernels move"
    return None


def plugin() -> None:
    """SGLang's general-plugin hook (entry point group ``sglang.srt.plugins``).

    SGLang calls it early in every server process, the spawned schedulers
    included, where a call to `install()` in the launcher would not reach.
    It installs only where PORTABLE_KV_SGLANG=1.  A PORTABLE_KV_* setting that
    cannot be used stops the process with SystemExit and one line naming it:
    SGLang's loader logs an Exception from a plugin and serves on with its own
    host pools, which would leave a server started with the tier running without it.
    """
    try:
        if config.SGLANG.flag():
            install()
    except config.ConfigError as exc:
        raise SystemExit(f"portable_kv: {exc}") from None


def uninstall() -> None:
    """Give SGLang its own host-pool builder and MLA host-pool class back."""
    if not _originals:
        return
    modules = _sglang_modules()
    for module in modules:
        module.get_mha_host_pool_cls = _originals["builder"]
    modules[1]._uses_unified_page_envelope_host = _originals["envelope"]
    modules[1].MLATokenToKVPoolHost = _originals["mla"]
    modules[1].MambaPoolHost = _originals["mamba"]
    importlib.import_module(_DSA_MODULE).DSAIndexerPoolHost = _originals["dsa_indexer"]
    _originals.clear()


def _sglang_modules() -> list[Any]:
    """SGLang's modules `install()` patches, or one line saying which SGLang this release drives."""
    try:
        modules = [importlib.import_module(name) for name in _BUILDER_MODULES]
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "sglang":
            raise
        raise ImportError(f"portable_kv.engines.sglang drives SGLang {SGLANG_VERSION}'s HiCache, which is not installed here: "
                          f"pip install sglang=={SGLANG_VERSION} (docs/API.md, \"The SGLang host-pool surface\")", name="sglang") from None
    version = getattr(importlib.import_module("sglang"), "__version__", None)
    if version != SGLANG_VERSION:
        logger.warning("portable_kv: drives SGLang %s's HiCache, found %s; its pool assembler may call the host pool differently",
                       SGLANG_VERSION, version)
    return modules
