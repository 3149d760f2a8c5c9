"""The interface every backend implements (Backend): a device, a copy kernel and a copier,
from which it builds a mover per io path."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..io.auto import AutoMover
from ..io.context import IoContext
from ..io.copier import Copier
from ..io.mover import Mover
from ..io.staged import StagedMover

ELEMENT_SIZES = (1, 2, 4, 8)  # what the copy kernels' integer words cover


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message names the cause and the fix."""


class Backend(ABC):
    name: str
    vendor: str  # "nvidia" | "amd" | "cpu"
    # Whether the `kernel` io path can read host memory that was registered
    # (mmap + HostRegister) rather than allocated page-locked.
    kernel_reads_registered_memory: bool = True

    copier: Copier  # what copies bytes for the direct and staged paths, and orders their streams
    # Whether the movers read the device buffers' per-layer addresses from a device-resident
    # table (the copy kernels); the CPU oracle indexes the tensors instead.
    reads_layer_tables: bool = True

    def __init__(self) -> None:
        self.device = self._device()

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run on this machine, else why not (cheap, no compilation)."""

    @abstractmethod
    def _device(self) -> torch.device: ...

    @abstractmethod
    def kernel_mover(self) -> Mover:
        """A new mover of the kernel io path: the backend's copy kernel at its block quota."""

    @property
    def offers_bulk(self) -> bool:
        """Whether this backend has the bulk io path (bulk_mover)."""
        return False

    def bulk_mover(self, fallback: Mover) -> Mover:
        """A new mover of the bulk io path (a few blocks walking a piece list made once per plan),
        which hands what its pieces cannot carry to `fallback`."""
        raise NotImplementedError(f"backend {self.name!r} has no bulk io path")

    @abstractmethod
    def staging_mover(self, blocks: int) -> Mover:
        """A new mover of the copy kernel between a staging slot and the KV buffers (staged io),
        at `blocks` blocks where the kernel has a quota."""

    @property
    def io_backends(self) -> tuple[str, ...]:
        """The io paths this backend offers."""
        return ("kernel", "direct", "staged", "auto", "bulk") if self.offers_bulk else ("kernel", "direct", "staged", "auto")

    def mover(self, io: str, context: IoContext) -> Mover:
        """A new mover of io path `io` for the host pool whose io context is `context`: a path
        that delegates is given the pool's own movers of the paths it hands transfers to (one
        staging allocation, one record of staged backups per pool)."""
        if io not in self.io_backends:
            raise ValueError(f"io_backend: backend {self.name!r} offers {', '.join(self.io_backends)}, got {io!r}")
        if io == "kernel":
            return self.kernel_mover()
        if io == "direct":
            return self.copier.direct_mover()
        if io == "bulk":
            return self.bulk_mover(context.mover("kernel"))
        if io == "staged":
            return StagedMover(self.copier, self.staging_mover(context.settings.staging_blocks), context.mover("kernel"), context)
        return AutoMover({path: context.mover(path) for path in self.io_backends if path != "auto"})

    def check_dtype(self, dtype: torch.dtype) -> None:
        """TypeError unless the movers can move `dtype` (integer words of 1, 2, 4 or 8 bytes)."""
        if dtype.is_complex or dtype.itemsize not in ELEMENT_SIZES:
            raise TypeError(
                f"dtype: backend {self.name!r} moves elements of {', '.join(map(str, ELEMENT_SIZES))} bytes and no complex dtype, "
                f"got {dtype}; store a complex cache as its real view (torch.view_as_real)"
            )

    @property
    def pins_memory(self) -> bool:
        """Whether host pools are page-locked (needed for zero-copy kernels and async DMA)."""
        return self.device.type != "cpu"

    def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin and self.pins_memory)

    def register_host(self, address: int, nbytes: int) -> int:
        """Page-lock and map an existing host range; returns its device address."""
        return self.copier.register_host(address, nbytes)

    def unregister_host(self, address: int) -> None:
        """Undo register_host."""
        self.copier.unregister_host(address)

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict[str, str]:
        """Facts for `portable-kv info`: compilers, runtime versions."""
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
