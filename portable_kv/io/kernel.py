"""The `kernel` io path: the C copy kernel (kernels_cuda | kernels_hip over
kernels_common) launched through the vendor runtime.

GPU threads read and write page-locked host memory over PCIe: a load scatters host
tokens into the KV buffers, a backup gathers them back; one launch moves every buffer
(K and V, or MLA's latent) of a layer, or of all layers.  The staged path runs the
same kernel between a staging slot in device memory and the KV buffers (io/staged.py).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from ..cache import IdentityCache
from ..transfer import TensorPair, Transfer
from .kernel_args import BLOCK, JobTemplate, LayerTables, PreparedLaunch
from .mover import Mover

PREPARED_KEPT = 4  # kernel io, per thread: a load and a backup interleaved, and a spare
TEMPLATES_KEPT = 16  # job templates kept per mover: one per device pool (its tensor pairs) it moves to


class Runtime(Protocol):
    """The vendor runtime calls a launch needs (backends/runtime.py)."""

    def bind_thread(self) -> None: ...
    def current_stream(self) -> int: ...
    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int) -> None: ...


class Launcher(Protocol):
    """A GPU backend as the kernel mover launches through it (backends/gpu.py)."""

    device: torch.device
    block_quota: int
    runtime: Runtime
    layer_tables: LayerTables

    def kernels(self) -> dict[int, int]: ...


class KernelMover(Mover):
    """The copy kernel for one host pool, in either direction.

    An engine loads layer after layer with the same pools and indices, and interleaves
    backups of other pages: a prepared launch per (pools, indices, direction, layer
    count, block quota, stream, stream_device) is kept, per thread, since a call sets its
    layer in the launch's arguments; a call then sets the layer and launches."""

    io = "kernel"

    def __init__(self, backend: Launcher, block_quota: int | None = None, stream_device: bool = False,
                 kept: int = PREPARED_KEPT) -> None:
        """`block_quota`: fixed, or None for the backend's, read each call (it may change between
        calls); `stream_device`: stream the device-side writes (kv_copy.h); `kept`: launches
        kept per thread."""
        super().__init__(backend.device)
        self.backend = backend
        self.block_quota = block_quota
        self.stream_device = stream_device
        self.kept = kept
        self._templates: IdentityCache[JobTemplate] = IdentityCache(TEMPLATES_KEPT)
        # Per thread: .prepared, the launches by key, oldest first; .last, the latest one.
        self._local = threading.local()

    def move(self, transfer: Transfer) -> None:
        self.bad_index.check()
        backend, runtime, local = self.backend, self.backend.runtime, self._local
        prepared: dict[tuple, PreparedLaunch] | None = getattr(local, "prepared", None)
        if prepared is None:
            runtime.bind_thread()
            prepared = local.prepared = {}
            local.last = None
        stream = runtime.current_stream()
        quota = self.block_quota or backend.block_quota
        setting = (transfer.to_device, len(transfer.layers), quota, stream, self.stream_device)
        launch = local.last
        # The latest launch first: per-layer calls repeat it, and a call's host time is the budget.
        if launch is None or launch.setting != setting or not launch.made_for(transfer):
            launch = self._launch(prepared, transfer, setting)
            local.last = launch
        launch.args.layer_begin = transfer.layers.start
        runtime.launch(launch.kernel, launch.grid, BLOCK, launch.params, stream)

    def _launch(self, prepared: dict[tuple, PreparedLaunch], transfer: Transfer, setting: tuple) -> PreparedLaunch:
        """The kept launch for `transfer` at `setting`, or a new one kept in place of the oldest."""
        key = (id(transfer.indices), *map(id, transfer.pairs), *setting)
        launch = prepared.get(key)
        if launch is None or not launch.made_for(transfer):
            _, _, quota, stream, stream_device = setting
            launch = PreparedLaunch(transfer, self._template(transfer.pairs), self.bad_index.address, quota, stream, stream_device)
            launch.kernel, launch.setting = self.backend.kernels()[launch.width], setting
            prepared.pop(key, None)
            prepared[key] = launch
            while len(prepared) > self.kept:
                del prepared[next(iter(prepared))]
        return launch

    def _template(self, pairs: tuple[TensorPair, ...]) -> JobTemplate:
        return self._templates.get(pairs, lambda: JobTemplate(pairs, [self.backend.layer_tables.of(p.device) for p in pairs]))

    def close(self) -> None:
        self._templates.clear()
        self._local = threading.local()  # every thread's prepared launches go with the old one
