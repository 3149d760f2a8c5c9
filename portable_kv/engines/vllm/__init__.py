"""portable_kv as the host tier of vLLM 0.33.0's KV offloading (docs/API.md, "vLLM offloading spec").

vLLM's `OffloadingConnector` loads an offloading spec by name from
kv_connector_extra_config: `"spec_name": "PortableKVOffloadingSpec",
"spec_module_path": "portable_kv.engines.vllm"`.  The spec keeps vLLM's
scheduler side whole and moves the KV blocks with portable_kv's host pools
and io paths.  `PortableKVLayerwiseConnector` (connector.py) is the
OffloadingConnector with same-step cache hits loaded layer by layer.  vllm is
imported only when one of those classes is asked for, and its absence is then
an ImportError that names the release to install; `HostTier` (the block
layout and moves, host_tier.py) needs no vllm.
"""

from __future__ import annotations

import importlib
from typing import Any

from .host_tier import OWN_SPEC, HostTier, NotServed, check_served
from .io_paths import choose_io

# The release of vLLM whose offloading connector, spec and worker contract this module follows.
VLLM_VERSION = "0.33.0"
__all__ = ["OWN_SPEC", "VLLM_VERSION", "HostTier", "NotServed", "PortableKVLayerwiseConnector", "PortableKVOffloadingSpec",
           "PortableKVOffloadingWorker", "check_served", "choose_io"]


# Loaded on first use (__getattr__): each subclasses vLLM's own classes, so its module imports vllm.
_VLLM_CLASSES = {"PortableKVOffloadingSpec": "spec", "PortableKVOffloadingWorker": "worker", "PortableKVLayerwiseConnector": "connector"}


def __getattr__(name: str) -> Any:
    if name not in _VLLM_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{_VLLM_CLASSES[name]}")
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "vllm":
            raise
        raise ImportError(f"portable_kv.engines.vllm.{name} runs inside vLLM {VLLM_VERSION}, which is not installed here: "
                          f"pip install \"portable_kv[vllm]\" (or pip install vllm=={VLLM_VERSION}); docs/API.md, "
                          f"\"vLLM offloading spec\"", name="vllm") from None
    return getattr(module, name)
