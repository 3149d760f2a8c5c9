"""The C copy kernels (kernels_cuda | kernels_hip over kernels_common) as a backend:
what CudaBackend and RocmBackend share, given their vendor's DeviceRuntime.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .. import config
from ..cache import IdentityCache
from ..plan import TensorPair, Transfer
from .base import Backend, BackendUnavailable, Mover, MoverFactory
from .kernel_args import BLOCK, JobTemplate, LayerTable, PreparedLaunch
from .runtime import DeviceRuntime
from .staged import KernelGather, staged_movers

PREPARED_KEPT = 4  # prepared launches kept per thread (a load and a backup interleaved, and a spare)
TEMPLATES_KEPT = 16  # job templates kept per pool: one per device pool (K/V pair) it moves to
LAYER_TABLES_KEPT = 64  # device address tables kept per backend: a few device pools, each pair of K/V


class KernelMover(Mover):
    """The C kernel, launched through the vendor runtime, for one host pool.

    An engine loads layer after layer with the same pools and indices, and
    interleaves backups of other pages: a prepared launch per (pools, indices,
    direction, layer count) is kept, and a call sets its layer and launches."""

    io = "kernel"

    def __init__(self, backend: GpuBackend) -> None:
        super().__init__(backend.device)
        self.backend = backend
        self._templates: IdentityCache[JobTemplate] = IdentityCache(TEMPLATES_KEPT)
        self._local = threading.local()  # .prepared: list[PreparedLaunch], mutated per call

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        backend = self.backend
        prepared = getattr(self._local, "prepared", None)
        if prepared is None:
            backend.runtime.bind_thread()
            prepared = self._local.prepared = []
        stream = backend.runtime.current_stream()
        for launch in prepared:
            if launch.matches(transfer, backend.block_quota, stream):
                break
        else:
            launch = PreparedLaunch(transfer, self._template(transfer.pairs), self.bad_index.address, backend.block_quota, stream)
            launch.kernel = backend.kernels()[launch.width]
            prepared.insert(0, launch)
            del prepared[PREPARED_KEPT:]
        launch.args.layer_begin = transfer.layers.start
        backend.runtime.launch(launch.kernel, launch.grid, BLOCK, launch.params, stream)

    def _template(self, pairs: tuple[TensorPair, TensorPair]) -> JobTemplate:
        return self._templates.get(pairs, lambda: JobTemplate(pairs, [self.backend.layer_table(p.device) for p in pairs]))

    def close(self) -> None:
        self._templates.clear()
        self._local = threading.local()  # every thread's prepared launches go with the old one


class GpuBackend(Backend):
    """A vendor backend: the C kernels and the copy engines of one GPU's runtime."""

    runtime: DeviceRuntime

    def __init__(self, runtime: DeviceRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.block_quota: int = config.block_quota(self.vendor)
        self._kernels: dict[int, int] | None = None
        self._load_lock = threading.Lock()
        # Device addresses of an engine's layers: no host memory, so kept per backend.
        self._tables: IdentityCache[LayerTable] = IdentityCache(LAYER_TABLES_KEPT)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def movers(self) -> dict[str, MoverFactory]:
        def kernel() -> KernelMover:
            return KernelMover(self)

        return {"kernel": kernel, "direct": self.runtime.direct_mover,
                **staged_movers(self.device, kernel, self.runtime.direct_mover, lambda: KernelGather(self), self.runtime.memcpy_2d,
                                self.runtime.memcpy_batch, self.runtime.current_stream, runtime=self.runtime)}

    def kernels(self) -> dict[int, int]:
        """The copy kernel's entry point per access width, built or found once."""
        if self._kernels is None:
            with self._load_lock:
                if self._kernels is None:
                    self.runtime.bind_thread()
                    self._kernels = self.runtime.load(self.runtime.code_object())
        return self._kernels

    def layer_table(self, buffers: Sequence[torch.Tensor]) -> LayerTable:
        return self._tables.get(buffers, lambda: LayerTable(buffers, self.device))

    @property
    def dma_streams(self) -> int:
        """Streams (copy engines) one direct-io transfer is spread over; settable between calls."""
        return self.runtime.dma_streams

    @dma_streams.setter
    def dma_streams(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"dma_streams: expected an int >= 1, got {value!r}")
        self.runtime.dma_streams = value

    def register_host(self, address: int, nbytes: int) -> int:
        return self.runtime.register_host(address, nbytes)

    def unregister_host(self, address: int) -> None:
        self.runtime.unregister_host(address)

    def describe(self) -> dict[str, str]:
        facts = {"arch": self.runtime.arch(), "compiler": self.runtime.compiler(), "block_quota": str(self.block_quota)}
        try:
            self.kernels()
            facts["kernels"] = "loaded"
        except BackendUnavailable as exc:
            facts["kernels"] = f"unavailable: {exc}"
        return facts | self.runtime.describe()

