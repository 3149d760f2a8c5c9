"""The io path of each direction of the spec's transfers, per vendor.

`portable_kv_io` in kv_connector_extra_config names one io path for stores
and loads, or one per direction (`store=direct,load=kernel`).  Without it:
`auto` on NVIDIA (per call: the kernel for small transfers, the copy engines
where the blocks run long on both sides, staging for long backups), `kernel`
on AMD.  On AMD `hipMemcpyBatchAsync` is a loop of single copies up to ROCm
7.2, and `direct`, `staged` and `auto` can reach it (direct always, staged
and auto for rows of 1 MiB and more, as cross-layer blocks are), so there only
the paths that never call it are accepted.
"""

from __future__ import annotations

from typing import Any

from .host_tier import OWN_SPEC, NotServed

DIRECTIONS = ("store", "load")
# The io paths that may issue batched memcpys on the copy engines.
BATCHED_COPY_PATHS = ("direct", "staged", "auto")
DEFAULT_IO = {"nvidia": "auto", "amd": "kernel", "cpu": "kernel"}


def choose_io(backend: Any, requested: Any) -> dict[str, str]:
    """{"store": io, "load": io} for `backend`, from `portable_kv_io` (None: the vendor's default)."""
    offered = tuple(backend.io_backends)
    if requested is None:
        chosen = dict.fromkeys(DIRECTIONS, DEFAULT_IO.get(backend.vendor, "kernel"))
    elif isinstance(requested, str) and "=" not in requested:
        chosen = dict.fromkeys(DIRECTIONS, requested.strip())
    elif isinstance(requested, str):
        chosen = {}
        for part in requested.split(","):
            direction, _, io = part.partition("=")
            if direction.strip() not in DIRECTIONS or not io.strip():
                raise ValueError(f"portable_kv_io: expected one io path or store=IO,load=IO, got {requested!r}")
            chosen[direction.strip()] = io.strip()
        if set(chosen) != set(DIRECTIONS):
            raise ValueError(f"portable_kv_io: name both store and load, got {requested!r}")
    else:
        raise ValueError(f"portable_kv_io: expected a string, got {requested!r}")
    for direction, io in chosen.items():
        if io not in offered:
            raise ValueError(f"portable_kv_io: {direction} io {io!r} is not offered by backend {backend.name!r} "
                             f"(it offers {', '.join(offered)})")
        if backend.vendor == "amd" and io in BATCHED_COPY_PATHS:
            raise NotServed(f"portable_kv_io: {direction} io {io!r} on AMD can issue hipMemcpyBatchAsync, a loop of single "
                            f"copies up to ROCm 7.2; use kernel{' or bulk' if 'bulk' in offered else ''}, or {OWN_SPEC}")
    return chosen
