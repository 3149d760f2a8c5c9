"""The interface every backend implements, and the errors they share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..plan import Transfer

IO_BACKENDS = ("kernel", "direct")


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message names the cause and the fix."""


class BadIndexFlag:
    """The flag the copy kernels set when they skip an index outside its pool.

    It lives in page-locked, mapped host memory on a GPU, so the host reads it
    without synchronising; the next call (or check()) turns it into an error.
    """

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
        self._view = self.tensor.numpy()

    def check(self) -> None:
        if self._view[0]:
            self._view[0] = 0
            raise RuntimeError(
                "portable_kv: an earlier transfer met token indices outside the pools and skipped them "
                "(nothing outside the pools was written); validate indices, or keep validate=True"
            )


class Backend(ABC):
    name: str
    vendor: str  # "nvidia" | "amd" | "cpu"
    io_backends: tuple[str, ...] = IO_BACKENDS
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

    @abstractmethod
    def transfer(self, transfer: Transfer, io_backend: str) -> None:
        """Enqueue one validated transfer on the current stream of self.device."""

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict[str, str]:
        """Facts for `portable-kv info`: compilers, runtime versions."""
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
