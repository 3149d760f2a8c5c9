"""portable_kv: the host tier of a KV cache for asymmetric K/V and MLA, on NVIDIA and AMD alike.

Attributes load on first use (PEP 562), so `portable-kv --help` and
`portable-kv --version` start without importing torch; the backend is
detected and bound the first time a pool or `backends.current()` needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.4.0"

_LAZY = {
    "AsymmetricHostPool": ("portable_kv.pool", "AsymmetricHostPool"),
    "DeviceKVPool": ("portable_kv.device_pool", "DeviceKVPool"),
    "LAYOUTS": ("portable_kv.layout", "LAYOUTS"),
    "MLADevicePool": ("portable_kv.device_pool", "MLADevicePool"),
    "MLAHostPool": ("portable_kv.mla", "MLAHostPool"),
    "backends": ("portable_kv.backends", None),
    "storage": ("portable_kv.storage", None),
    "sglang": ("portable_kv.engines.sglang", None),
    "engines": ("portable_kv.engines", None),
}

if TYPE_CHECKING:
    from . import backends, sglang, storage
    from .device_pool import DeviceKVPool, MLADevicePool
    from .layout import LAYOUTS
    from .mla import MLAHostPool
    from .pool import AsymmetricHostPool


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'portable_kv' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["LAYOUTS", "AsymmetricHostPool", "DeviceKVPool", "MLADevicePool", "MLAHostPool", "backends", "storage", "sglang", "__version__"]
