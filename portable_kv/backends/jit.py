"""Kernel code objects: a KernelSpec names everything that changes the binary (sources,
arch, compiler and its version, defines); its hash is the cache key; a code object is
taken from a prebuilt directory if one was built for the same sources and arch, else
from the on-disk cache, else compiled once and cached; then the runtime loads it.
A compile holds a lock file beside its cache entry, so processes starting
together (tensor-parallel ranks of one node) compile once and read the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import config

PACKAGE_DIR = Path(__file__).resolve().parent.parent
COMMON_KERNEL_DIR = PACKAGE_DIR / "kernels_common"
COMMON_HEADER = COMMON_KERNEL_DIR / "kv_copy.h"
BULK_HEADER = COMMON_KERNEL_DIR / "kv_bulk.h"  # the bulk io path's plan walk, in the same code object
COMMON_HEADERS = (COMMON_HEADER, BULK_HEADER)
# How long a process waits for another one's compile of the same kernel: far above a cold
# NVRTC or hiprtc build, short of a job that never starts.
LOCK_WAIT_S = 600.0
LOCK_POLL_S = 0.05


@dataclass(frozen=True)
class KernelSpec:
    """One kernel build: the vendor source first, then the headers it includes."""

    sources: tuple[Path, ...]
    arch: str  # "sm_90", "gfx942:sramecc+:xnack-"
    compiler: str  # run-time compiler and version, "nvrtc 13.0"
    suffix: str  # "cubin" | "hsaco"
    defines: tuple[str, ...] = ()  # "-D" definitions, for measuring a kernel variant

    @classmethod
    def for_source(cls, vendor_source: Path, arch: str, compiler: str, suffix: str, defines: tuple[str, ...] = ()) -> KernelSpec:
        return cls((vendor_source, *COMMON_HEADERS), arch, compiler, suffix, defines)

    @property
    def source(self) -> Path:
        """The vendor file the compiler is given; it includes the others."""
        return self.sources[0]

    def source_hash(self) -> str:
        digest = hashlib.sha256()
        for path in self.sources:
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def prebuilt_name(self) -> str:
        """An ahead-of-time build's file name: nvcc and clang builds differ from run-time
        builds only in the compiler, so sources and arch name them."""
        return f"kv_copy-{self.source_hash()}.{self.arch}.{self.suffix}"

    def cache_path(self) -> Path:
        key = hashlib.sha256(f"{self.compiler}|{','.join(self.defines)}".encode()).hexdigest()[:8]
        return config.cache_dir() / f"{Path(self.prebuilt_name()).stem}-{key}.{self.suffix}"

    def prebuilt_path(self) -> Path | None:
        """The first ahead-of-time build for these sources and arch; none for a variant with defines."""
        if self.defines:
            return None
        for directory in prebuilt_dirs():
            path = directory / self.prebuilt_name()
            if path.is_file():
                return path
        return None

    def build(self, compile: Callable[[KernelSpec], bytes]) -> bytes:
        """The code object: prebuilt, else cached, else compiled now and cached."""
        prebuilt = self.prebuilt_path()
        if prebuilt is not None:
            return prebuilt.read_bytes()
        cached = self.cache_path()
        if cached.is_file():
            return cached.read_bytes()
        with file_lock(cached.with_name(f".{cached.name}.lock")):
            if cached.is_file():  # another process compiled it while this one waited
                return cached.read_bytes()
            image = compile(self)
            write_atomic(cached, image)
        return image


def prebuilt_dirs() -> list[Path]:
    """Where ahead-of-time builds are looked for: $PORTABLE_KV_PREBUILT, then
    `portable-kv build`'s default output in the kernel cache, then the package's own."""
    extra = config.PREBUILT.raw()
    return ([Path(extra)] if extra else []) + [config.cache_dir() / "prebuilt", PACKAGE_DIR / "prebuilt"]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path`, waiting up to LOCK_WAIT_S; the kernel drops it if the holder dies,
    so a lock file left behind blocks nobody."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:  # append: never truncates a file another process holds
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"kernel cache: waited {LOCK_WAIT_S:g} s for the lock file {path}, held by a process compiling the same "
                                       f"kernel; if none runs, set {config.CACHE.name} to a local directory (a network file system may not "
                                       "release locks)") from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
