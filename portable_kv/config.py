"""Every setting portable_kv reads from the environment, in one place.

Each `PORTABLE_KV_*` variable is read here and nowhere else, when it is asked
for (tests and `portable-kv` set them per run); docs/API.md lists them in one
table.  A malformed value raises `ConfigError` naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A PORTABLE_KV_* variable holds a value that cannot be used."""


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None
    meaning: str

    def raw(self) -> str | None:
        value = os.environ.get(self.name, "").strip()
        return value or self.default

    def integer(self, minimum: int = 0) -> int | None:
        value = self.raw()
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{self.name}: expected an integer, got {value!r}") from None
        if number < minimum:
            raise ConfigError(f"{self.name}: expected an integer >= {minimum}, got {number}")
        return number

    def flag(self) -> bool:
        return (self.raw() or "0") not in ("0", "false", "no", "off")


BACKEND = Setting("PORTABLE_KV_BACKEND", None, "backend to bind at first use: cuda, rocm, triton or cpu (default: detected)")
BLOCKS = Setting("PORTABLE_KV_BLOCKS", None, "block quota of the kernel io path (default: 16 on NVIDIA, 32 on AMD)")
DMA_STREAMS = Setting("PORTABLE_KV_DMA_STREAMS", "4", "streams one direct-io transfer is spread over, one copy engine each")
CACHE = Setting("PORTABLE_KV_CACHE", None, "directory of compiled kernels (default: $XDG_CACHE_HOME/portable_kv or ~/.cache/portable_kv)")
PREBUILT = Setting("PORTABLE_KV_PREBUILT", None, "extra directory searched first for ahead-of-time code objects")
HOST_RESERVE = Setting("PORTABLE_KV_HOST_RESERVE", str(2 << 30), "bytes of host memory a new pool leaves free for the OS and the engine")
CLANG = Setting("PORTABLE_KV_CLANG", None, "clang++ used to build HIP code objects ahead of time (default: clang++-19 or clang++ on PATH)")
HIP_BITCODE = Setting("PORTABLE_KV_HIP_BITCODE", None, "directory of the AMD device bitcode (ockl.bc) for clang builds")
STAGING_BYTES = Setting("PORTABLE_KV_STAGING_BYTES", str(64 << 20),
                        "device memory of one pool's staged io path per direction, two halves that alternate chunks")
STAGING_BLOCKS = Setting("PORTABLE_KV_STAGING_BLOCKS", "8",
                         "block quota of the staged io path's kernel between staging and the KV buffers")
SGLANG = Setting("PORTABLE_KV_SGLANG", "0",
                 "1: SGLang's plugin loader calls portable_kv.sglang.install() in every server process (HiCache on portable_kv)")
SGLANG_IO = Setting("PORTABLE_KV_SGLANG_IO", None,
                    "io path of portable_kv pools under SGLang: one of kernel, direct, staged, auto for every call, "
                    "or pairs kernel=...,direct=... (default: SGLang's --hicache-io-backend as passed)")
DEBUG = Setting("PORTABLE_KV_DEBUG", "0", "1: the command line shows full tracebacks, and Mooncake its full logs")

SETTINGS = (BACKEND, BLOCKS, DMA_STREAMS, STAGING_BYTES, STAGING_BLOCKS, CACHE, PREBUILT, HOST_RESERVE, CLANG, HIP_BITCODE, SGLANG, SGLANG_IO, DEBUG)
# Triton's own switch (Triton reads it too): it decides whether the triton backend
# runs on the CPU; not a PORTABLE_KV_* setting, so not in SETTINGS' table.
TRITON_INTERPRET = Setting("TRITON_INTERPRET", "0", "1: Triton kernels run on the CPU under Triton's interpreter")


def block_quota(vendor: str) -> int:
    """Blocks (workgroups) a kernel-io transfer may occupy.  16 saturate PCIe Gen5 on
    the H200 (docs/PERFORMANCE.md); 32 on AMD follows published CDNA figures, not ours."""
    configured = BLOCKS.integer(minimum=1)
    if configured is not None:
        return configured
    return 32 if vendor == "amd" else 16


def cache_dir() -> Path:
    configured = CACHE.raw()
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "portable_kv"


def table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of every setting, for docs and `portable-kv info`."""
    return [(s.name, s.default or "-", s.meaning) for s in SETTINGS]
