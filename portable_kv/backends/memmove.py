"""The host's copier: memmove on the CPU, where every copy is done when its call returns,
so the direct and staged paths' descriptors and schedules run in CI exactly as on a GPU."""

from __future__ import annotations

import ctypes

import torch

from ..io.copier import Copier
from ..io.direct import DirectMover
from ..io.mover import Mover
from ..io.streams import InlineStreams, Streams


class Memmove(Copier):
    """memmove, one stream, nothing to order and nothing to page-lock."""

    device = torch.device("cpu")
    dma_streams = 1

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def memcpy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        for row in range(height):
            self.memcpy(dst + row * dst_pitch, src + row * src_pitch, width, stream)

    def current_stream(self) -> int:
        return 0

    def streams(self) -> Streams:
        return InlineStreams(self.current_stream)

    def register_host(self, address: int, nbytes: int) -> int:
        return address  # the CPU reads host memory as it is

    def unregister_host(self, address: int) -> None:
        return None

    def direct_mover(self) -> Mover:
        return DirectMover(self)
