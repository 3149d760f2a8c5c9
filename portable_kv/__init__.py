"""portable_kv: the host tier of a KV cache for asymmetric K/V, on NVIDIA and AMD alike."""

from . import backends
from .layout import LAYOUTS
from .pool import AsymmetricHostPool, DeviceKVPool

__version__ = "0.1.0"

backends.current()  # detection happens once, here (API.md "Detection")

__all__ = ["LAYOUTS", "AsymmetricHostPool", "DeviceKVPool", "backends", "__version__"]
