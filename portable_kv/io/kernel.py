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

from ..transfer import Transfer
from .kernel_args import BLOCK, KernelArgs, grid_size
from .mover import Launch, Mover
from .streams import MadeOn, Streams


class Runtime(Protocol):
    """The vendor runtime calls a launch needs (backends/runtime.py)."""

    def bind_thread(self) -> None: ...
    def launch(self, kernel: int, grid: int, block: int, params: int, stream: int) -> None: ...
    def streams(self) -> Streams: ...


class Launcher(Protocol):
    """A GPU backend as the kernel mover launches through it (backends/gpu.py)."""

    device: torch.device
    block_quota: int
    runtime: Runtime

    def kernels(self) -> dict[int, int]: ...


class KernelLaunch(Launch):
    """The copy kernel's arguments for one transfer: a call sets the layer and launches."""

    path = "kernel"

    def __init__(self, mover: KernelMover, transfer: Transfer, stream: int | None) -> None:
        backend = mover.backend
        self.runtime, self.backend, self.fixed_quota = backend.runtime, backend, mover.block_quota
        # Indices on the device, copied on the stream of the call that builds the launch;
        # a call on another stream waits for that copy once.
        self.made = MadeOn(mover.streams, stream)
        kernel_args = KernelArgs(transfer, transfer.indices.on(backend.device), transfer.flag.address)
        kernel_args.args.stream_device = mover.stream_device
        self.kernel_args, self.args, self.params = kernel_args, kernel_args.args, kernel_args.params
        self.kernel = backend.kernels()[kernel_args.width]
        self.quota, self.grid = 0, 1
        self.thread = threading.get_ident()  # build() bound it to the device
        # One struct per launch: a call on another thread must not set its layer between this
        # call's and the runtime's copy of the arguments at launch.
        self.lock = threading.Lock()

    def run(self, layers: range, stream: int | None) -> None:
        if threading.get_ident() != self.thread:
            self.runtime.bind_thread()
            self.thread = threading.get_ident()
        quota = self.fixed_quota or self.backend.block_quota  # assignable between calls
        if quota != self.quota:
            self.quota, self.grid = quota, grid_size(self.args.total_vecs, quota)
        if stream not in self.made.seen:
            self.made.order(stream)
        with self.lock:
            self.args.layer_begin = layers.start
            self.runtime.launch(self.kernel, self.grid, BLOCK, self.params, stream)


class KernelMover(Mover):
    """The copy kernel for one host pool, in either direction."""

    io = "kernel"

    def __init__(self, backend: Launcher, block_quota: int | None = None, stream_device: bool = False) -> None:
        """`block_quota`: fixed, or None for the backend's, read each call (it may change between
        calls); `stream_device`: stream the device-side writes (kv_copy.h)."""
        self.backend, self.block_quota, self.stream_device = backend, block_quota, stream_device
        self.streams = backend.runtime.streams()

    def build(self, transfer: Transfer) -> Launch:
        self.backend.runtime.bind_thread()
        return KernelLaunch(self, transfer, self.streams.current())
