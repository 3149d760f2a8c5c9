"""The interfaces every backend implements (Backend, Mover), and what they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..plan import Transfer

IO_BACKENDS = ("kernel", "direct", "staged", "auto")
ELEMENT_SIZES = (1, 2, 4, 8)  # what the copy kernels' integer words cover


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message names the cause and the fix."""


class BadIndexFlag:
    """Set when a mover skips a token whose index is outside its pool.

    It lives in page-locked, mapped host memory on a GPU, so a kernel sets it and
    the host reads it without synchronising; the next call turns it into an error.
    """

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
        self._view = self.tensor.numpy()

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def set(self) -> None:
        self._view[0] = 1

    def check(self) -> None:
        if self._view[0]:
            self._view[0] = 0
            raise RuntimeError(
                "portable_kv: an earlier transfer met token indices outside the pools and skipped them "
                "(nothing outside the pools was written); validate indices, or keep validate=True"
            )


class Mover(ABC):
    """One io path of one host pool: enqueues validated transfers on the current stream.

    A mover is owned by one host pool; everything it keeps for that pool (prepared
    launches, job templates, index copies) goes with it, or with close()."""

    io: str  # one of IO_BACKENDS

    def __init__(self, device: torch.device) -> None:
        self.bad_index = BadIndexFlag(device)

    @abstractmethod
    def move(self, transfer: Transfer) -> None:
        """Enqueue one validated transfer; raises first if an earlier transfer skipped a bad index."""

    @abstractmethod
    def close(self) -> None:
        """Drop every per-pool cache (idempotent); the mover may be used again after."""


MoverFactory = Callable[[], Mover]


class Backend(ABC):
    name: str
    vendor: str  # "nvidia" | "amd" | "cpu"
    # Whether the `kernel` io backend can read host memory that was registered
    # (mmap + HostRegister) rather than allocated page-locked.
    kernel_reads_registered_memory: bool = True

    def __init__(self) -> None:
        self.device = self._device()

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run on this machine, else why not (cheap, no compilation)."""

    @abstractmethod
    def _device(self) -> torch.device: ...

    @abstractmethod
    def movers(self) -> dict[str, MoverFactory]:
        """io name -> a factory of new movers; a new io path is one more entry."""

    @property
    def io_backends(self) -> tuple[str, ...]:
        """The io paths this backend offers."""
        return tuple(self.movers())

    def mover(self, io: str) -> Mover:
        """A new mover for io path `io`, to be owned by one host pool."""
        factories = self.movers()
        if io not in factories:
            raise ValueError(f"io_backend: backend {self.name!r} offers {', '.join(factories)}, got {io!r}")
        return factories[io]()

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
        """Page-lock and map an existing host range; returns its device address (here: itself)."""
        return address

    def unregister_host(self, address: int) -> None:
        """Undo register_host."""
        return None

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict[str, str]:
        """Facts for `portable-kv info`: compilers, runtime versions."""
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
