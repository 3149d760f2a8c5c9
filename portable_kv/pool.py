"""AsymmetricHostPool (docs/API.md): a host pool's construction, checks and transfers.

A transfer call checks everything before a byte moves (the device pool's
geometry, the layer, the indices: validation.py), then hands one `Transfer`
to the pool's mover for that io path, resolved once per pool from the bound
backend.  The memory lives in host_memory.py; page access for storage tiers
in pages.py; the SGLang host-pool surface in sglang_surface.py.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from . import backends
from .backends.base import Backend
from .device_pool import DeviceGeometry, DeviceKVPool, device_geometry, positive_int
from .host_memory import HOST_MEMORY, HostMemory, check_available
from .io.mover import IO_PATHS, Mover
from .layout import LAYOUTS, check_layout, host_shape
from .numa import Placement, placement
from .pages import PageAccess
from .sglang_surface import SGLangSurface
from .transfer import TensorPair, Transfer, tensor_pair
from .validation import IndexValidator

# Registered host memory is split into pieces of whole pages: a page-major layout
# keeps every copy inside one page, so inside one registration.
REGISTERED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
# io paths on which GPU threads may read host memory: kernel, and the two that fall back to it.
SM_READS_HOST = ("kernel", "staged", "auto")


class Binding(NamedTuple):
    """The device pool an engine passes every call, checked once, with the K and V tensor pairs."""

    device_pool: Any
    geometry: DeviceGeometry
    pairs: tuple[TensorPair, TensorPair]


class AsymmetricHostPool(PageAccess, SGLangSurface):
    """The host tier: K and V pages in page-locked host memory, in one of four layouts."""

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        layout: str = "page_first_direct",
        io_backend: str = "kernel",
        pin_memory: bool = True,
        validate: bool = True,
        host_memory: str = "pinned",
        numa_node: int | str | None = None,
    ) -> None:
        self.backend: Backend = backends.current()
        self.layout = check_layout(layout)
        self.io_backend = self._check_io(io_backend)
        geometry = device_geometry(device_pool)
        self._geometry = geometry
        self.page_size = positive_int("device_pool.page_size", getattr(device_pool, "page_size", 0))
        self.layer_num, self.dtype = geometry.layers, geometry.dtype
        self.backend.check_dtype(self.dtype)
        self.validate = bool(validate)
        token_bytes = self.layer_num * (geometry.k_heads * geometry.k_dim + geometry.v_heads * geometry.v_dim) * self.dtype.itemsize
        tokens = _host_tokens(host_to_device_ratio, host_size_gb, geometry.tokens, token_bytes)
        self.page_num = max(1, -(-tokens // self.page_size))
        self.size = self.page_num * self.page_size
        self.pin_memory = bool(pin_memory) and self.backend.pins_memory
        self.host_memory = self._check_host_memory_kind(host_memory)
        self._memory: HostMemory | None = None
        self._check_reads(self.io_backend)
        check_available(self.size * token_bytes)
        self.placement: Placement = placement(self.backend.device, numa_node)
        shapes = tuple(host_shape(layout, self.layer_num, self.page_num, self.page_size, heads, dim)
                       for heads, dim in ((geometry.k_heads, geometry.k_dim), (geometry.v_heads, geometry.v_dim)))
        self._memory = HostMemory(self.backend, self.host_memory, shapes, self.dtype, self.page_num, self.page_size,
                                  self.pin_memory, self.placement.node)
        try:
            self._check_reads(self.io_backend)
        except ValueError:
            self._memory.release()
            raise
        self.k_buffer, self.v_buffer = self._memory.k, self._memory.v
        self.closed = False
        self._validator = IndexValidator(self.size, self.page_size, self.layout, self.validate)
        self._binding: Binding | None = None
        self._movers: dict[str, Mover] = {}
        self._host_writes = 0  # backups issued so far (Transfer.host_writes)
        self._mover(self.io_backend)
        self._init_allocator()

    def _check_io(self, io_backend: str) -> str:
        if not isinstance(io_backend, str) or io_backend not in IO_PATHS:
            raise ValueError(f"io_backend: expected one of {', '.join(IO_PATHS)}, got {io_backend!r}")
        if io_backend not in self.backend.io_backends:
            raise ValueError(f"io_backend: backend {self.backend.name!r} offers {', '.join(self.backend.io_backends)}, got {io_backend!r}")
        return io_backend

    def _check_host_memory_kind(self, host_memory: str) -> str:
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory: expected one of {', '.join(HOST_MEMORY)}, got {host_memory!r}")
        if host_memory == "registered" and self.layout not in REGISTERED_LAYOUTS:
            raise ValueError(f"host_memory='registered': expected a page-major layout ({', '.join(REGISTERED_LAYOUTS)}), got {self.layout!r}")
        return host_memory

    def _check_reads(self, io: str) -> None:
        """Refuse an io path whose GPU threads would read host memory they cannot: at
        construction, and for a per-call `io_backend=` the first time it is used."""
        if io not in SM_READS_HOST:
            return
        if self.backend.device.type != "cpu" and not self.pin_memory:
            raise ValueError(f"io_backend={io!r}: GPU threads read host memory directly (staged and auto fall back to that), which needs pin_memory=True")
        if self.host_memory == "registered" and not self.backend.kernel_reads_registered_memory:
            raise ValueError(f"io_backend={io!r} with host_memory='registered' on backend {self.backend.name!r}: use io_backend='direct' (its kernels need page-locked allocations)")
        if self._memory is not None and self._memory.device_addresses_differ:
            raise ValueError(f"io_backend={io!r} with host_memory='registered': this GPU maps registered memory at another address; use io_backend='direct'")

    def _mover(self, io: str) -> Mover:
        """This pool's mover for an io path: made once, owning the pool's launch caches."""
        mover = self._movers.get(io)
        if mover is None:
            mover = self._movers[io] = self.backend.mover(io)
        return mover

    # -- transfers (docs/API.md) ---------------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = None, is_draft: bool = False) -> None:
        """H2D, one layer: K and V of token `host_indices[i]` to slot `device_indices[i]` of layer `layer_id`.

        Asynchronous on the current stream.  `is_draft` is SGLang's flag for a
        speculative draft model's layers; a host pool holds one model, so it
        changes nothing here.
        """
        self._transfer(device_pool, host_indices, device_indices, self._layer(layer_id), True, io_backend)

    def load_to_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        """H2D, every layer, in one call (one kernel launch on `kernel` io)."""
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), True, io_backend)

    def backup_from_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                     io_backend: str | None = None) -> None:
        """D2H, one layer: slot `device_indices[i]` of layer `layer_id` to host token `host_indices[i]`."""
        self._transfer(device_pool, host_indices, device_indices, self._layer(layer_id), False, io_backend)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str | None = None) -> None:
        """D2H, every layer, in one call."""
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), False, io_backend)

    def _transfer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layers: range, to_device: bool, io_backend: str | None) -> None:
        if self.closed:
            raise ValueError("host pool: the pool is closed")
        io = self.io_backend if io_backend is None else io_backend
        mover = self._movers.get(io) if type(io) is str else None
        if mover is None:
            self._check_reads(self._check_io(io_backend))
            mover = self._mover(io_backend)
        binding = self._bind(device_pool, layers)
        indices = self._validator(host_indices, device_indices, binding.geometry.tokens, to_device)
        if indices.tokens:
            if not to_device:
                self._host_writes += 1
            mover.move(Transfer(to_device, binding.pairs, indices, layers, self.page_size, self._host_writes))

    def _bind(self, device_pool: Any, layers: range) -> Binding:
        """The device pool's checked geometry and K/V tensor pairs, kept for the pool an engine passes every call.

        The check is by identity of the per-layer tensors that the call moves:
        an engine that swaps a buffer gets it (and the whole pool) checked again
        when that layer next moves.  A per-layer call checks two tensors, not
        all of them: it is on the per-call host-time budget.
        """
        k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
        bound = self._binding
        if bound is not None:
            bk, bv = bound.pairs[0].device, bound.pairs[1].device
            if bound.device_pool is device_pool and type(k) is list and type(v) is list and len(k) == len(bk) and len(v) == len(bv):
                if len(layers) == 1:
                    if k[layers.start] is bk[layers.start] and v[layers.start] is bv[layers.start]:
                        return bound
                elif all(map(operator.is_, k[layers.start:layers.stop], bk[layers.start:layers.stop])) and \
                        all(map(operator.is_, v[layers.start:layers.stop], bv[layers.start:layers.stop])):
                    return bound
            elif _same_tensors(k, bk) and _same_tensors(v, bv):
                return bound
        geometry = self._check_device_pool(device_pool)
        k_tokens, v_tokens = self._memory.registration_tokens
        pairs = (
            tensor_pair(self.k_buffer, list(device_pool.k_buffer), self.layout, self.page_size, k_tokens),
            tensor_pair(self.v_buffer, list(device_pool.v_buffer), self.layout, self.page_size, v_tokens),
        )
        self._binding = Binding(device_pool, geometry, pairs)
        return self._binding

    # -- checks ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("host pool: the pool is closed")

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
        want = self.backend.device
        # The GPU too, not only its kind: a kernel on one GPU given another's addresses faults.
        if g.device.type != want.type or (want.index is not None and g.device.index is not None and g.device.index != want.index):
            raise ValueError(f"device_pool: expected buffers on {want} (backend {self.backend.name!r}), got {g.device}")
        return g

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the host memory, after every transfer already enqueued has finished.

        Registered memory is unregistered now; page-locked memory is freed when
        the last tensor viewing it goes (a caller still holding `k_buffer` keeps
        it).  A pool dropped without `close()` cleans up the same way.
        """
        if self.closed:
            return
        self.backend.synchronize()
        for mover in self._movers.values():
            mover.close()
        self._movers.clear()
        self._memory.release()
        self.closed = True
        self.k_buffer = self.v_buffer = None
        self._validator.clear()
        self._binding = None

    def __enter__(self) -> AsymmetricHostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AsymmetricHostPool(layout={self.layout!r}, io_backend={self.io_backend!r}, backend={self.backend.name!r}, "
            f"tokens={self.size}, page_size={self.page_size}, layers={self.layer_num}, dtype={self.dtype})"
        )


def _same_tensors(given: Any, bound: Sequence[torch.Tensor]) -> bool:
    # type() first: isinstance against the Sequence ABC costs a microsecond a call.
    return (type(given) in (list, tuple) or isinstance(given, Sequence)) and len(given) == len(bound) and all(map(operator.is_, given, bound))


def _host_tokens(ratio: Any, host_size_gb: Any, device_tokens: int, token_bytes: int) -> int:
    """Host tokens from host_size_gb when it is > 0, else from the ratio to the device pool."""
    for name, value in (("host_to_device_ratio", ratio), ("host_size_gb", host_size_gb)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if host_size_gb < 0:
        raise ValueError(f"host_size_gb: expected >= 0 (0: size from host_to_device_ratio), got {host_size_gb}")
    if host_size_gb > 0:
        tokens = int(host_size_gb * 1e9 // token_bytes)
        if tokens < 1:
            raise ValueError(f"host_size_gb: {host_size_gb} GB holds no token of {token_bytes} bytes (K+V, all layers)")
        return tokens
    if ratio <= 0:
        raise ValueError(f"host_to_device_ratio: expected > 0 (or host_size_gb > 0), got {ratio}")
    return int(math.ceil(ratio * device_tokens))


__all__ = ["LAYOUTS", "AsymmetricHostPool", "DeviceKVPool"]
