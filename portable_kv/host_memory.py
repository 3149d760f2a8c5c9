"""The page-locked host memory behind one host pool's buffers (K and V, or MLA's latent), and its size in tokens.

Two kinds:
- `pinned`: page-locked allocations from torch (cudaHostAlloc / hipHostMalloc);
- `registered`: anonymous mmap, page-locked with cudaHostRegister /
  hipHostRegister in pieces of whole KV pages, so no copy spans two
  registrations (one huge registration can take minutes or fail on large pools).
Both are allocated inside a NUMA memory policy for the device's node
(numa.py), so the pages land in the memory of the GPU's own socket.

A registered range is unregistered exactly once, before its mapping goes:
by `release()` (the pool's `close()`), or by a finalizer when the last tensor
viewing it is dropped, so a pool that goes out of scope without `close()`
leaves no registration behind (the next registration at that address would
fail with "already registered").
"""

from __future__ import annotations

import ctypes
import math
import mmap
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import config
from .backends.base import Backend
from .numa import bind_allocations, release_cached_host_memory

HOST_MEMORY = ("pinned", "registered")
REGISTRATION_BYTES = 1 << 30


def check_available(nbytes: int) -> None:
    """Refuse a pool that would leave less than the reserve (PORTABLE_KV_HOST_RESERVE) to the OS and the engine."""
    available = _available_host_memory()
    reserve = config.HOST_RESERVE.integer(minimum=0) or 0
    if available is not None and nbytes > available - reserve:
        raise MemoryError(
            f"host pool: {nbytes / 1e9:.2f} GB requested but {available / 1e9:.2f} GB available "
            f"with {reserve / 1e9:.2f} GB kept in reserve; lower host_size_gb or host_to_device_ratio, "
            f"or the reserve ({config.HOST_RESERVE.name}, in bytes)"
        )


def host_tokens(ratio: Any, host_size_gb: Any, device_tokens: int, token_bytes: int, buffers: str) -> int:
    """Host tokens from host_size_gb when it is > 0, else from the ratio to the device pool."""
    for name, value in (("host_to_device_ratio", ratio), ("host_size_gb", host_size_gb)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if host_size_gb < 0:
        raise ValueError(f"host_size_gb: expected >= 0 (0: size from host_to_device_ratio), got {host_size_gb}")
    if host_size_gb > 0:
        tokens = int(host_size_gb * 1e9 // token_bytes)
        if tokens < 1:
            raise ValueError(f"host_size_gb: {host_size_gb} GB holds no token of {token_bytes} bytes ({buffers}, all layers)")
        return tokens
    if ratio <= 0:
        raise ValueError(f"host_to_device_ratio: expected > 0 (or host_size_gb > 0), got {ratio}")
    return int(math.ceil(ratio * device_tokens))


class _Registrations:
    """Registered pieces of one mapping; unregistered once, then the mapping may go."""

    def __init__(self, unregister: Callable[[int], None], synchronize: Callable[[], None], mapping: mmap.mmap) -> None:
        self.addresses: list[int] = []
        self._unregister, self._synchronize = unregister, synchronize
        self._mapping = mapping  # kept until the registrations are gone: munmap must come after unregister

    def release(self) -> None:
        if self.addresses:
            self._synchronize()  # a transfer still in flight may read or write the range
            for address in self.addresses:
                self._unregister(address)
            self.addresses = []


class HostMemory:
    """Host buffers of the given shapes (K and V, or one latent buffer), of one kind, on one NUMA node."""

    def __init__(self, backend: Backend, kind: str, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype,
                 page_num: int, page_size: int, pin: bool, numa_node: int | None) -> None:
        if kind not in HOST_MEMORY:
            raise ValueError(f"host_memory: expected one of {', '.join(HOST_MEMORY)}, got {kind!r}")
        self.kind, self.backend, self.dtype = kind, backend, dtype
        self.page_num, self.page_size = page_num, page_size
        # One per buffer: > 0, registered in pieces of this many tokens (K and V pages differ
        # in size, so their 1 GiB pieces hold different page counts)
        self.registration_tokens = (0,) * len(shapes)
        self.device_addresses_differ = False  # the GPU maps registered memory at another address (kernel io cannot use it)
        self._finalizers: list[weakref.finalize] = []
        # Ordinary tensors even when the pool is built under torch.inference_mode(): storage
        # threads and engines write pages outside it, which an inference tensor refuses.
        with bind_allocations(numa_node), torch.inference_mode(False):
            if kind == "registered":
                registered = [self._registered(shape) for shape in shapes]
                self.buffers: tuple[torch.Tensor, ...] = tuple(buffer for buffer, _ in registered)
                self.registration_tokens = tuple(tokens for _, tokens in registered)
            else:
                if numa_node is not None and pin:
                    # torch's pinned allocator reuses freed blocks (rounded up to powers of two),
                    # wherever they were placed: empty its cache so the pages are fresh.
                    release_cached_host_memory()
                self.buffers = tuple(self._pinned(shape, pin) for shape in shapes)

    def _pinned(self, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        try:
            return self.backend.allocate_host(shape, self.dtype, pin)
        except RuntimeError as exc:
            nbytes = math.prod(shape) * self.dtype.itemsize
            raise MemoryError(
                f"host pool: page-locking {nbytes / 1e9:.2f} GB was refused ({exc}); lower host_size_gb or "
                "host_to_device_ratio, raise the locked-memory limit (ulimit -l), or pass pin_memory=False with io_backend='direct'"
            ) from exc

    def _registered(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        """The buffer, and the tokens each registered piece of it holds."""
        nbytes = math.prod(shape) * self.dtype.itemsize
        page_bytes = nbytes // self.page_num
        pages_per_piece = max(1, REGISTRATION_BYTES // page_bytes)
        mapping = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # 2 MiB pages keep the page tables of a very large pool small; on the
            # H200 they did not change bandwidth (docs/PERFORMANCE.md).
            mapping.madvise(mmap.MADV_HUGEPAGE)
        registrations = _Registrations(self.backend.unregister_host, self.backend.synchronize, mapping)
        # The tensors view a ctypes array that owns the registrations: when the last
        # tensor goes, the array goes, the finalizer unregisters, then the mapping is unmapped.
        view = (ctypes.c_uint8 * nbytes).from_buffer(mapping)
        view.registrations = registrations  # type: ignore[attr-defined]  # a ctypes array takes attributes; its stubs do not say so
        self._finalizers.append(weakref.finalize(view, registrations.release))
        buffer = torch.frombuffer(view, dtype=torch.uint8).view(self.dtype).view(shape)
        base = buffer.data_ptr()
        for offset in range(0, nbytes, pages_per_piece * page_bytes):
            size = min(pages_per_piece * page_bytes, nbytes - offset)
            try:
                device_address = self.backend.register_host(base + offset, size)
            except RuntimeError as exc:
                self.release()
                registrations.release()
                raise MemoryError(f"host pool: registering {size / 1e9:.2f} GB at offset {offset} was refused ({exc}); "
                                  "raise the locked-memory limit (ulimit -l) or use host_memory='pinned'") from exc
            registrations.addresses.append(base + offset)
            if device_address != base + offset:
                self.device_addresses_differ = True
        return buffer, pages_per_piece * self.page_size

    def release(self) -> None:
        """Unregister now (after in-flight transfers) and let go of the buffers: the memory goes
        back to its allocator when the last tensor viewing it does, even while the pool
        object that owned this lives on (engines keep it referenced after `close()`)."""
        for finalizer in self._finalizers:
            finalizer()
        self._finalizers = []
        self.buffers = ()


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
