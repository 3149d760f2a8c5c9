"""Host pools (docs/API.md): construction, checks and transfers, for either kind of pool.

`HostPool` is the machinery; `AsymmetricHostPool` holds an MHA pool's K and V,
`MLAHostPool` (mla.py) an MLA pool's latent buffer.  A transfer call checks the
device pool and the layer, finds the plan of its index tensors in the pool's one
memo (or makes it: plan.py, which validates and owns the indices and launches),
and calls it.  The pool's io paths share one io context (io/context.py).  The
memory lives in host_memory.py; page access for storage tiers in pages.py;
SGLang's names for it in engines/sglang/.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from . import backends
from .backends.base import Backend
from .device_pool import MHA, DeviceGeometry, DeviceKVPool, PoolKind, device_geometry, positive_int
from .host_memory import HOST_MEMORY, HostMemory, check_available, host_tokens
from .io.context import IoContext
from .io.mover import IO_PATHS
from .layout import LAYOUTS, check_layout, host_shape
from .log import package_logger, pool_line
from .numa import Placement, placement
from .pages import PageAccess
from .plan import Binding, PlanMemo, TransferPlan
from .transfer import tensor_pair
from .validation import IndexValidator, index_tensor, owned_int64

# Registered host memory is split into pieces of whole pages: a page-major layout
# keeps every copy inside one page, so inside one registration.
REGISTERED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
# io paths on which GPU threads may read host memory: kernel, and the two that fall back to it.
SM_READS_HOST = ("kernel", "staged", "auto")


class HostPool(PageAccess):
    """The host tier of one kind of pool: its buffers' pages in page-locked host memory.

    `kind` names the buffers (device_pool.py), which become attributes of the
    same names here, each one host tensor in the layout's shape."""

    kind: PoolKind
    layouts: tuple[str, ...] = LAYOUTS  # the layouts this kind of pool offers

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
        self.layout = self._check_layout(layout)
        self.io_backend = self._check_io(io_backend)
        geometry = device_geometry(device_pool, self.kind)
        self._geometry = geometry
        self._describe_rows(device_pool, geometry)
        self.page_size = positive_int("device_pool.page_size", getattr(device_pool, "page_size", 0))
        self.layer_num, self.dtype = geometry.layers, geometry.dtype
        self.backend.check_dtype(self.dtype)
        self.validate = _flag("validate", validate)
        token_bytes = self.layer_num * geometry.token_elements * self.dtype.itemsize
        tokens = host_tokens(host_to_device_ratio, host_size_gb, geometry.tokens, token_bytes, "+".join(self.kind.labels))
        self.page_num = max(1, -(-tokens // self.page_size))
        self.size = self.page_num * self.page_size
        self.pin_memory = bool(pin_memory) and self.backend.pins_memory
        self.host_memory = self._check_host_memory_kind(host_memory)
        self._memory: HostMemory | None = None
        self._check_reads(self.io_backend)
        check_available(self.size * token_bytes)
        self.placement: Placement = placement(self.backend.device, numa_node)
        shapes = tuple(host_shape(layout, self.layer_num, self.page_num, self.page_size, heads, dim) for heads, dim in geometry.shapes)
        self._memory = HostMemory(self.backend, self.host_memory, shapes, self.dtype, self.page_num, self.page_size,
                                  self.pin_memory, self.placement.node)
        try:
            self._check_reads(self.io_backend)
        except ValueError:
            self._memory.release()
            raise
        for name, buffer in zip(self.kind.buffers, self._memory.buffers):
            setattr(self, name, buffer)
        self.closed = False
        self._validator = IndexValidator(self.size, self.page_size, self.layout, self.validate)
        self._binding: Binding | None = None
        self._io_context = IoContext(self.backend.device, self.backend.mover, self.backend.copier.streams())
        self._plans = PlanMemo()
        self._layer_ranges = [range(layer, layer + 1) for layer in range(self.layer_num)]
        self._io_context.mover(self.io_backend)
        logger = package_logger()
        if logger.isEnabledFor(logging.INFO):
            logger.info(pool_line(self))

    def _check_layout(self, layout: str) -> str:
        return check_layout(layout, self.layouts)

    def _describe_rows(self, device_pool: Any, geometry: DeviceGeometry) -> None:
        """What a kind of pool reads and checks of its rows before any memory is allocated."""

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of every buffer over all layers."""
        return self.layer_num * self._geometry.token_elements * self.dtype.itemsize

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The host buffers in page order (K, V; or the latent); empty once closed."""
        return () if self.closed else tuple(getattr(self, name) for name in self.kind.buffers)

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

    def stats(self) -> dict[str, Any]:
        """What this pool did (docs/API.md): per direction and io path, calls, bytes, the caller's
        seconds in them and the device's seconds of those read back; the path each delegating
        io path took, how often and why; the last error a transfer call raised."""
        self._io_context.in_flight.read_back()
        return self._io_context.stats.as_dict()

    def prepare(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                io_backend: str | None = None, background: bool = False) -> TransferPlan:
        """A transfer of these indices between this pool and `device_pool`, checked once and
        launched per call: `plan.load(layer_id)`, `plan.load_all()`, `plan.backup(layer_id=None)`,
        `plan.ready(layer_id)` (plan.py).  Raises as the transfer calls do, before anything
        moves.  `background`: the transfer is off the caller's critical path (a backup during
        decode, a prefetch): `auto` prefers the copy engines."""
        try:
            self._check_open()
            io = self._io_path(io_backend)
            binding = self._bind(device_pool, range(self.layer_num))
            return TransferPlan(self, io, host_indices, device_indices, binding, background=_flag("background", background))
        except (ValueError, TypeError) as exc:
            self._io_context.stats.error(exc)
            raise

    def _io_path(self, io_backend: str | None) -> str:
        """The io path a call asks for (None: the pool's), checked at its first use."""
        io = self.io_backend if io_backend is None else io_backend
        if type(io) is not str or io not in self._io_context.movers:
            self._check_reads(self._check_io(io))
            self._io_context.mover(io)
        return io

    def _submission_plan(self, host_indices: Any, device_indices: Any, io_backend: str | None) -> TransferPlan:
        """A plan over the pool's own copies of `host_indices` and `device_indices`, found again
        by the per-call API through those copies alone (an engine's submission passes them to
        every call and writes them never): SGLang's `prepare_transfer_indices`."""
        self._check_open()
        try:
            io = self._io_path(io_backend)
            host = owned_int64(index_tensor("host_indices", host_indices))
            dev = owned_int64(index_tensor("device_indices", device_indices))
            plan = TransferPlan(self, io, host, dev, None, fixed=False, owned=True)
        except (ValueError, TypeError) as exc:
            self._io_context.stats.error(exc)
            raise
        self._plans.keep(host, dev, plan)
        return plan

    # -- transfers (docs/API.md) ---------------------------------------------------------

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                 io_backend: str | None = None, is_draft: bool = False, background: bool = False) -> None:
        """H2D, one layer: every buffer of token `host_indices[i]` to slot `device_indices[i]` of layer `layer_id`.

        Asynchronous on the current stream.  `is_draft` is SGLang's flag for a
        speculative draft model's layers; a host pool holds one model, so it
        changes nothing here.
        """
        layers = self._layer_ranges[layer_id] if type(layer_id) is int and 0 <= layer_id < self.layer_num else self._layer(layer_id)
        self._transfer(device_pool, host_indices, device_indices, layers, True, io_backend, background)

    def load_to_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                 io_backend: str | None = None, background: bool = False) -> None:
        """H2D, every layer, in one call (one kernel launch on `kernel` io)."""
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), True, io_backend, background)

    def backup_from_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                                     io_backend: str | None = None, background: bool = False) -> None:
        """D2H, one layer: slot `device_indices[i]` of layer `layer_id` to host token `host_indices[i]`."""
        self._transfer(device_pool, host_indices, device_indices, self._layer(layer_id), False, io_backend, background)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                     io_backend: str | None = None, background: bool = False) -> None:
        """D2H, every layer, in one call."""
        self._transfer(device_pool, host_indices, device_indices, range(self.layer_num), False, io_backend, background)

    def _transfer(self, device_pool: Any, host_indices: Any, device_indices: Any, layers: range, to_device: bool,
                  io_backend: str | None, background: bool) -> None:
        """A per-call transfer: the plan of the caller's tensors, found in the pool's one memo
        (plan.py's holds(): identity, version counters, CPU values), or made now."""
        if self.closed:
            raise ValueError("host pool: the pool is closed")
        try:
            io = self.io_backend if io_backend is None else io_backend
            if type(io) is not str or io not in self._io_context.movers:
                io = self._io_path(io_backend)
            binding = self._bind(device_pool, layers)
            plan = self._plans.find(host_indices, device_indices, io, background)
            if plan is None:
                plan = TransferPlan(self, io, host_indices, device_indices, binding, fixed=False, background=_flag("background", background))
                self._plans.keep(host_indices, device_indices, plan)
            elif plan.binding is not binding:
                plan.rebind(binding)
        except (ValueError, TypeError) as exc:
            self._io_context.stats.error(exc)
            raise
        plan._call(to_device, layers)

    def _bind(self, device_pool: Any, layers: range) -> Binding:
        """The device pool's checked geometry and tensor pairs, kept for the pool an engine passes
        every call; one whose tensors the call moves were swapped (Binding.replaced) is checked
        again, the whole pool."""
        bound = self._binding
        if bound is not None and bound.replaced(device_pool, layers) is None:
            return bound
        geometry = self._check_device_pool(device_pool)
        given = [list(getattr(device_pool, name)) for name in self.kind.buffers]
        tables = self.backend.device if self.backend.reads_layer_tables else None
        pairs = tuple(tensor_pair(host, device, self.layout, self.page_size, tokens, tables)
                      for host, device, tokens in zip(self.buffers, given, self._memory.registration_tokens))
        self._binding = Binding(device_pool, geometry, pairs, tuple(zip(self.kind.buffers, given)))
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
        g, mine = device_geometry(device_pool, self.kind), self._geometry
        if (g.layers, g.shapes) != (mine.layers, mine.shapes):
            raise ValueError(f"device_pool: expected {mine.describe()} (this host pool's), got {g.describe()}")
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
        the last tensor viewing it goes (a caller still holding a buffer keeps
        it).  A pool dropped without `close()` cleans up the same way.
        """
        if self.closed:
            return
        self.backend.synchronize()
        self._io_context.close()
        self._memory.release()
        self.closed = True
        for name in self.kind.buffers:
            setattr(self, name, None)
        self._plans.clear()
        self._binding = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layout={self.layout!r}, io_backend={self.io_backend!r}, backend={self.backend.name!r}, "
            f"tokens={self.size}, page_size={self.page_size}, layers={self.layer_num}, dtype={self.dtype})"
        )


class AsymmetricHostPool(HostPool):
    """The host tier of an MHA pool: K and V pages in page-locked host memory, in one of four layouts.

    K and V are two tensors because they may differ in head_dim and head count (MiMo-V2: K 192, V 128)."""

    kind = MHA
    k_buffer: torch.Tensor | None
    v_buffer: torch.Tensor | None

    @property
    def kv_buffer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_buffer, v_buffer)``, as SGLang's asymmetric pool has it; None once closed."""
        return None if self.k_buffer is None else (self.k_buffer, self.v_buffer)


def _flag(name: str, value: Any) -> bool:
    """A yes/no argument: a bool (numpy's too), never a string, whose truth would be its length."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


__all__ = ["LAYOUTS", "AsymmetricHostPool", "DeviceKVPool", "HostPool"]
