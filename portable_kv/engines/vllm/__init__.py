"""portable_kv as the host tier of vLLM 0.33.0's KV offloading (docs/API.md, "vLLM offloading spec").

vLLM's `OffloadingConnector` loads an offloading spec by name from
kv_connector_extra_config: `"spec_name": "PortableKVOffloadingSpec",
"spec_module_path": "portable_kv.engines.vllm"`.  The spec keeps vLLM's
scheduler side whole and moves the KV blocks with portable_kv's host pools
and io paths.  vllm is imported only when the spec or its worker is asked for;
`HostTier` (the block layout and moves, host_tier.py) needs no vllm.
"""

from __future__ import annotations

from typing import Any

from .host_tier import OWN_SPEC, HostTier, NotServed, check_served
from .io_paths import choose_io

# The release of vLLM whose offloading connector, spec and worker contract this module follows.
VLLM_VERSION = "0.33.0"
# PortableKVOffloadingSpec and PortableKVOffloadingWorker load on first use (module __getattr__ below).
__all__ = ["OWN_SPEC", "VLLM_VERSION", "HostTier", "NotServed", "PortableKVOffloadingSpec", "PortableKVOffloadingWorker",
           "check_served", "choose_io"]


def __getattr__(name: str) -> Any:
    # Both subclass vLLM's own classes, so their modules import vllm.
    if name == "PortableKVOffloadingSpec":
        from .spec import PortableKVOffloadingSpec

        return PortableKVOffloadingSpec
    if name == "PortableKVOffloadingWorker":
        from .worker import PortableKVOffloadingWorker

        return PortableKVOffloadingWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
