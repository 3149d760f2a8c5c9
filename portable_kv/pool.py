"""DeviceKVPool and AsymmetricHostPool (API.md): allocation, validation, dispatch.

Every public transfer validates all of its input before a byte moves, then
hands one `Transfer` to the bound backend.  Validation results are cached
for the index tensors an engine passes to every per-layer call, so a model's
48 per-layer loads validate their indices once.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import backends
from .backends.base import IO_BACKENDS, Backend
from .device_pool import DeviceGeometry, DeviceKVPool, device_geometry, positive_int
from .layout import LAYOUTS, PAGE_LAYOUTS, check_layout, host_shape
from .pages import PageAccess
from .plan import IndexPair, TensorPair, Transfer, tensor_pair
from .sglang_surface import SGLangSurface

INDEX_DTYPES = (torch.int64, torch.int32)
HOST_MEMORY = ("pinned", "registered")
VALIDATED_KEPT = 4  # index pairs whose validation is remembered
# Registered host memory is split into pieces of whole pages: a page-major layout
# keeps every copy inside one page, so inside one registration.
REGISTERED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
REGISTRATION_BYTES = 1 << 30


class AsymmetricHostPool(PageAccess, SGLangSurface):
    """The host tier: K and V pages in (page-locked) host memory, in one of four layouts."""

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        layout: str = "page_first_direct",
        io_backend: str = "direct",
        pin_memory: bool = True,
        validate: bool = True,
        host_memory: str = "pinned",
    ) -> None:
        self.backend: Backend = backends.current()
        self.layout = check_layout(layout)
        self.io_backend = self._check_io(io_backend)
        geometry = device_geometry(device_pool)
        self._geometry = geometry
        self.page_size = positive_int("device_pool.page_size", getattr(device_pool, "page_size", 0))
        self.layer_num, self.dtype = geometry.layers, geometry.dtype
        self.validate = validate
        token_bytes = self.layer_num * (geometry.k_heads * geometry.k_dim + geometry.v_heads * geometry.v_dim) * _itemsize(self.dtype)
        if host_size_gb and host_size_gb > 0:
            tokens = int(host_size_gb * 1e9 // token_bytes)
        else:
            if not host_to_device_ratio or host_to_device_ratio <= 0:
                raise ValueError(f"host_to_device_ratio: expected > 0 (or host_size_gb > 0), got {host_to_device_ratio}")
            tokens = int(math.ceil(host_to_device_ratio * geometry.tokens))
        self.page_num = max(1, -(-tokens // self.page_size))
        self.size = self.page_num * self.page_size
        self.pin_memory = bool(pin_memory) and self.backend.pins_memory
        if self.io_backend == "kernel" and self.backend.device.type != "cpu" and not self.pin_memory:
            raise ValueError("io_backend='kernel': GPU threads read host memory directly, which needs pin_memory=True")
        self.host_memory = self._check_host_memory_kind(host_memory)
        _check_host_memory(self.size * token_bytes)
        shape_k = host_shape(layout, self.layer_num, self.page_num, self.page_size, geometry.k_heads, geometry.k_dim)
        shape_v = host_shape(layout, self.layer_num, self.page_num, self.page_size, geometry.v_heads, geometry.v_dim)
        self._registrations: list[int] = []
        self._registration_tokens = 0
        if self.host_memory == "registered":
            self.k_buffer, self.v_buffer = self._allocate_registered(shape_k), self._allocate_registered(shape_v)
        else:
            self.k_buffer = self._allocate(shape_k)
            self.v_buffer = self._allocate(shape_v)
        self.closed = False
        # The last few validated index pairs: an engine interleaves per-layer loads of
        # one set of pages with backups of another, each set reused call after call.
        self._validated: list[tuple] = []
        self._bound: tuple | None = None

    # -- allocation -----------------------------------------------------------------

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        try:
            return self.backend.allocate_host(shape, self.dtype, self.pin_memory)
        except RuntimeError as exc:
            nbytes = math.prod(shape) * _itemsize(self.dtype)
            raise MemoryError(
                f"host pool: page-locking {nbytes / 1e9:.2f} GB was refused ({exc}); lower host_size_gb or "
                "host_to_device_ratio, raise the locked-memory limit (ulimit -l), or pass pin_memory=False with io_backend='direct'"
            ) from exc

    def _check_host_memory_kind(self, host_memory: str) -> str:
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory: expected one of {', '.join(HOST_MEMORY)}, got {host_memory!r}")
        if host_memory == "registered":
            if self.layout not in REGISTERED_LAYOUTS:
                raise ValueError(f"host_memory='registered': expected a page-major layout ({', '.join(REGISTERED_LAYOUTS)}), got {self.layout!r}")
            if self.io_backend == "kernel" and not self.backend.kernel_reads_registered_memory:
                raise ValueError(f"host_memory='registered' with backend {self.backend.name!r}: use io_backend='direct' (its kernels need page-locked allocations)")
        return host_memory

    def _allocate_registered(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Anonymous mmap, page-locked in pieces of whole KV pages, so that no copy spans two
        registrations (one huge registration can take minutes or fail on large pools)."""
        nbytes = math.prod(shape) * _itemsize(self.dtype)
        page_bytes = nbytes // self.page_num
        pages_per_piece = max(1, REGISTRATION_BYTES // page_bytes)
        memory = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # 2 MiB pages keep the page tables of a very large pool small; on the
            # H200 they did not change bandwidth (NOTES.md, v3).
            memory.madvise(mmap.MADV_HUGEPAGE)
        buffer = torch.frombuffer(memory, dtype=torch.uint8).view(self.dtype).view(shape)
        base = buffer.data_ptr()
        for offset in range(0, nbytes, pages_per_piece * page_bytes):
            size = min(pages_per_piece * page_bytes, nbytes - offset)
            try:
                device_address = self.backend.register_host(base + offset, size)
            except RuntimeError as exc:
                self._unregister()
                raise MemoryError(f"host pool: registering {size / 1e9:.2f} GB at offset {offset} was refused ({exc}); raise the locked-memory limit (ulimit -l) or use host_memory='pinned'") from exc
            self._registrations.append(base + offset)
            if device_address != base + offset and self.io_backend == "kernel":
                self._unregister()
                raise ValueError("host_memory='registered': this GPU maps registered memory at another address; use io_backend='direct'")
        self._registration_tokens = pages_per_piece * self.page_size
        return buffer

    def _unregister(self) -> None:
        for address in self._registrations:
            self.backend.unregister_host(address)
        self._registrations = []

    # -- transfers (API.md) ------------------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int, io_backend: str | None = None) -> None:
        self._transfer(device_pool, host_indices, device_indices, self._layer(layer_id), True, io_backend)

    def load_to_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), True, io_backend)

    def backup_from_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int, io_backend: str | None = None) -> None:
        self._transfer(device_pool, host_indices, device_indices, self._layer(layer_id), False, io_backend)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), False, io_backend)

    def _transfer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layers: range, to_device: bool, io_backend: str | None) -> None:
        if self.closed:
            raise ValueError("host pool: the pool is closed")
        io = self.io_backend if io_backend is None else self._check_io(io_backend)
        geometry, pairs = self._bind(device_pool, layers)
        indices = self._indices(host_indices, device_indices, geometry.tokens, to_device)
        if indices.tokens:
            self.backend.transfer(Transfer(to_device, pairs, indices, layers, self.page_size), io)

    def _bind(self, device_pool: Any, layers: range) -> tuple[DeviceGeometry, tuple[TensorPair, TensorPair]]:
        """The device pool's checked geometry and the K/V tensor pairs, kept for the pool an engine passes every call.

        The check is by identity of the per-layer tensors that the call moves:
        an engine that swaps a buffer gets it (and the whole pool) checked again
        when that layer next moves.  A per-layer call checks two tensors, not
        all of them: it is on the per-call host-time budget.
        """
        k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
        bound = self._bound
        if bound is not None:
            bk, bv = bound[2][0].device, bound[2][1].device
            if bound[0] is device_pool and type(k) is list and type(v) is list and len(k) == len(bk) and len(v) == len(bv):
                if len(layers) == 1:
                    if k[layers.start] is bk[layers.start] and v[layers.start] is bv[layers.start]:
                        return bound[1], bound[2]
                elif all(map(operator.is_, k[layers.start:layers.stop], bk[layers.start:layers.stop])) and \
                        all(map(operator.is_, v[layers.start:layers.stop], bv[layers.start:layers.stop])):
                    return bound[1], bound[2]
            elif _same_tensors(k, bk) and _same_tensors(v, bv):
                return bound[1], bound[2]
        geometry = self._check_device_pool(device_pool)
        pairs = (
            tensor_pair(self.k_buffer, list(device_pool.k_buffer), self.layout, self.page_size, self._registration_tokens),
            tensor_pair(self.v_buffer, list(device_pool.v_buffer), self.layout, self.page_size, self._registration_tokens),
        )
        self._bound = (device_pool, geometry, pairs)
        return geometry, pairs

    # -- validation --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("host pool: the pool is closed")

    def _check_io(self, io_backend: str) -> str:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend: expected one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
        if io_backend not in self.backend.io_backends:
            raise ValueError(f"io_backend: backend {self.backend.name!r} offers {', '.join(self.backend.io_backends)}, got {io_backend!r}")
        return io_backend

    def _layer(self, layer_id: int) -> range:
        if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)):
            raise TypeError(f"layer_id: expected an int, got {type(layer_id).__name__}")
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id: expected 0 <= layer_id < {self.layer_num}, got {layer_id}")
        return range(int(layer_id), int(layer_id) + 1)

    def _check_device_pool(self, device_pool: Any) -> DeviceGeometry:
        g, mine = device_geometry(device_pool), self._geometry
        if (g.layers, g.k_heads, g.k_dim, g.v_heads, g.v_dim) != (mine.layers, mine.k_heads, mine.k_dim, mine.v_heads, mine.v_dim):
            raise ValueError(
                "device_pool: expected "
                f"{mine.layers} layers, K {mine.k_heads}x{mine.k_dim}, V {mine.v_heads}x{mine.v_dim} (this host pool's), got "
                f"{g.layers} layers, K {g.k_heads}x{g.k_dim}, V {g.v_heads}x{g.v_dim}"
            )
        if g.dtype != self.dtype:
            raise TypeError(f"device_pool: expected dtype {self.dtype} (this host pool's), got {g.dtype}")
        if g.device.type != self.backend.device.type:
            raise ValueError(f"device_pool: expected buffers on {self.backend.device.type} (backend {self.backend.name!r}), got {g.device}")
        return g

    def _indices(self, host_indices: torch.Tensor, device_indices: torch.Tensor, device_tokens: int, to_device: bool) -> IndexPair:
        for cached in self._validated:
            if host_indices is cached[0] and device_indices is cached[1] and \
                    cached[2] == (host_indices._version, device_indices._version, device_tokens, to_device):
                return cached[3]  # the same, unchanged index tensors as an earlier call
        host = _index_tensor("host_indices", host_indices)
        dev = _index_tensor("device_indices", device_indices)
        if host.numel() != dev.numel():
            raise ValueError(f"device_indices: expected the length of host_indices ({host.numel()}), got {dev.numel()}")
        key = (host._version, dev._version, device_tokens, to_device)
        if host.device != dev.device:
            dev = dev.to(host.device)
        pair = IndexPair(host.long(), dev.long())
        if self.validate:
            host_np, dev_np = pair.numpy()  # GPU-resident indices: one copy, which synchronises
            _check_range("host_indices", host_np, self.size)
            _check_range("device_indices", dev_np, device_tokens)
            if self.layout in PAGE_LAYOUTS:
                _check_whole_pages("host_indices", host_np, self.page_size, self.layout)
                _check_whole_pages("device_indices", dev_np, self.page_size, self.layout)
            # Two writes to one slot would race on a GPU: the result would depend on timing.
            _check_unique("device_indices" if to_device else "host_indices", dev_np if to_device else host_np)
        # The caller's tensors, before any conversion, are the key.
        self._validated = [(host_indices, device_indices, key, pair)] + self._validated[:VALIDATED_KEPT - 1]
        return pair

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Release the host memory, after every transfer already enqueued has finished."""
        if self.closed:
            return
        self.backend.synchronize()
        self._unregister()
        self.closed = True
        self.k_buffer = self.v_buffer = None
        self._validated, self._bound = [], None

    def __enter__(self) -> AsymmetricHostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AsymmetricHostPool(layout={self.layout!r}, io_backend={self.io_backend!r}, backend={self.backend.name!r}, "
            f"tokens={self.size}, page_size={self.page_size}, layers={self.layer_num}, dtype={self.dtype})"
        )


# -- helpers -------------------------------------------------------------------------


def _same_tensors(given: Any, bound: Sequence[torch.Tensor]) -> bool:
    # type() first: isinstance against the Sequence ABC costs a microsecond a call.
    return (type(given) in (list, tuple) or isinstance(given, Sequence)) and len(given) == len(bound) and all(map(operator.is_, given, bound))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _index_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D torch.Tensor of int64 or int32, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int64 or int32, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    return value


def _check_range(name: str, values: np.ndarray, limit: int) -> None:
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0:
        raise ValueError(f"{name}: expected indices >= 0, got {low}")
    if high >= limit:
        raise ValueError(f"{name}: expected indices < {limit} (the pool's tokens), got {high}")


def _check_whole_pages(name: str, values: np.ndarray, page_size: int, layout: str) -> None:
    if values.size % page_size:
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: expected a length divisible by page_size={page_size}, got {values.size}")
    pages = values.reshape(-1, page_size)
    if (pages[:, 0] % page_size).any():
        bad = int(pages[(pages[:, 0] % page_size) != 0][0, 0])
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: each run of {page_size} must start at a multiple of {page_size}, got {bad}")
    if page_size > 1 and (np.diff(pages, axis=1) != 1).any():
        row = int(np.flatnonzero((np.diff(pages, axis=1) != 1).any(axis=1))[0])
        raise ValueError(f"{name}: layout {layout!r} moves whole pages: run {row} is not {page_size} consecutive tokens")


def _check_unique(name: str, values: np.ndarray) -> None:
    if np.unique(values).size != values.size:
        raise ValueError(f"{name}: expected distinct destination slots, got duplicates (two writes to one slot race)")


HOST_MEMORY_RESERVE = 2 << 30  # left to the OS and the engine, as engines do before pinning


def _check_host_memory(nbytes: int) -> None:
    available = _available_host_memory()
    reserve = int(os.environ.get("PORTABLE_KV_HOST_RESERVE", HOST_MEMORY_RESERVE))
    if available is not None and nbytes > available - reserve:
        raise MemoryError(
            f"host pool: {nbytes / 1e9:.2f} GB requested but {available / 1e9:.2f} GB available "
            f"with {reserve / 1e9:.2f} GB kept in reserve; lower host_size_gb or host_to_device_ratio"
        )


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


__all__ = ["AsymmetricHostPool", "DeviceKVPool", "LAYOUTS"]
