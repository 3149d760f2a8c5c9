"""The C copy kernels (kernels_cuda | kernels_hip over kernels_common) as a backend:
what CudaBackend and RocmBackend share, given their vendor's DeviceRuntime."""

from __future__ import annotations

import re
import threading

import torch

from .. import config
from ..io.bulk import BulkMover
from ..io.kernel import KernelMover
from ..io.mover import Mover
from .base import Backend, BackendUnavailable
from .runtime import DeviceRuntime


class GpuBackend(Backend):
    """A vendor backend: the C kernels and the copy engines of one GPU's runtime."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        super().__init__()
        self.block_quota: int = config.block_quota(self.vendor)
        self._kernels: dict[int, int] | None = None
        self._bulk: int | None = None
        self._bulk_shared = 0  # dynamic shared memory the bulk kernel was allowed so far
        self._load_lock = threading.Lock()

    @property
    def copier(self) -> DeviceRuntime:
        return self.runtime

    def _device(self) -> torch.device:
        return self.runtime.device

    def kernel_mover(self) -> Mover:
        return KernelMover(self)

    @property
    def bulk_copies(self) -> bool:
        """Whether the bulk kernel moves stages with bulk asynchronous copies (sm_90 and later);
        elsewhere it walks its plan with vector copies (kv_bulk.h)."""
        found = re.match(r"sm_(\d+)", self.runtime.arch()) if self.vendor == "nvidia" else None
        return found is not None and int(found.group(1)) >= 90

    @property
    def offers_bulk(self) -> bool:
        # NVIDIA before sm_90 has no bulk copies, and a few blocks of vector copies there are the
        # kernel path at a smaller quota: no bulk path.
        return self.vendor == "amd" or self.bulk_copies

    @property
    def bulk_threads(self) -> int:
        return self.runtime.bulk_threads

    def bulk_mover(self, fallback: Mover) -> Mover:
        return BulkMover(self, fallback, blocks=self.runtime.bulk_blocks)

    def staging_mover(self, blocks: int) -> Mover:
        # Its device-side writes streamed: cached ones slowed the copy engine's next writes
        # into staging (kv_copy.h, `stream_device`).
        return KernelMover(self, blocks, stream_device=True)

    def kernels(self) -> dict[int, int]:
        """The copy kernel's entry point per access width, built or found once."""
        if self._kernels is None:
            with self._load_lock:
                if self._kernels is None:
                    self.runtime.bind_thread()
                    self._kernels = self.runtime.load(self.runtime.code_object())
        return self._kernels

    def bulk_kernel(self, shared_bytes: int) -> int:
        """The bulk kernel's entry point, allowed `shared_bytes` of dynamic shared memory."""
        if self._bulk is None:
            self.kernels()
            self._bulk = self.runtime.function("pkv_bulk")
        if shared_bytes > self._bulk_shared:
            self.runtime.allow_shared(self._bulk, shared_bytes)
            self._bulk_shared = shared_bytes
        return self._bulk

    @property
    def dma_streams(self) -> int:
        """Streams (copy engines) one direct-io transfer is spread over; settable between calls."""
        return self.runtime.dma_streams

    @dma_streams.setter
    def dma_streams(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"dma_streams: expected an int >= 1, got {value!r}")
        self.runtime.dma_streams = value

    def describe(self) -> dict[str, str]:
        facts = {"arch": self.runtime.arch(), "compiler": self.runtime.compiler(), "block_quota": str(self.block_quota)}
        try:
            self.kernels()
            facts["kernels"] = "loaded"
        except BackendUnavailable as exc:
            facts["kernels"] = f"unavailable: {exc}"
        return facts | self.runtime.describe()
