"""Storage tiers (L3) beyond the host pool: an engine's pages by key, in a directory or a Mooncake cluster.

`LocalStore(host, path)` needs nothing else; `MooncakeStore(host, master=...)`
needs the `mooncake` extra and a running `mooncake_master`
(`storage.master.MooncakeMaster` starts one on loopback for tests and
benchmarks).  Both follow `PageStore`: `exists`, `put`, `get`, `close`.
"""

from .base import PageStore
from .local import LocalStore
from .mooncake import MooncakeStore

__all__ = ["LocalStore", "MooncakeStore", "PageStore"]
