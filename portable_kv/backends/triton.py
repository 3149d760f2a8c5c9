"""Triton: one kernel source for NVIDIA and AMD; on a machine without a GPU it runs
under Triton's interpreter (TRITON_INTERPRET=1), so CI executes the kernel logic.

The kernel is the algorithm of kernels_common/kv_copy.h in Triton's terms:
a program takes ITEMS chunks (token, layer, head group) at a time, computes
both addresses from the indices and the layout strides, and copies the chunk's
words.  Its copier (direct and staged io, host registration) is the vendor
runtime's on a GPU (cuda.py | rocm.py), memmove under the interpreter (memmove.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .. import config
from ..io.copier import Copier
from ..io.kernel_args import WORD_DTYPES, pair_width
from ..io.mover import Launch, Mover
from ..io.streams import MadeOn
from ..transfer import TensorPair, Transfer
from .base import Backend
from .cuda import CudaRuntime
from .memmove import Memmove
from .rocm import HipRuntime
from .runtime import DeviceRuntime

TILE_WORDS = 4096  # words a program moves per step: enough in flight to cover PCIe latency


def interpreted() -> bool:
    return config.TRITON_INTERPRET.flag()


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kv_copy(host, layer_bases, host_indices, device_indices, error_flag,
                items, tokens, layer_begin, groups, chunk_words, page_size,
                host_page, host_token, host_layer, host_group, device_token, device_group,
                host_tokens, device_tokens,
                TO_DEVICE: tl.constexpr, ITEMS: tl.constexpr, WORDS: tl.constexpr):
        word = tl.arange(0, WORDS)
        in_chunk = word < chunk_words
        for start in range(tl.program_id(0) * ITEMS, items, tl.num_programs(0) * ITEMS):
            # 64-bit before any product: Triton types a small integer argument as
            # int32, and a pool's offsets pass 2^31 words (layer * host_layer).
            item = tl.arange(0, ITEMS).to(tl.int64) + start
            live = item < items
            group = item % groups
            token = (item // groups) % tokens
            layer = layer_begin + item // groups // tokens
            ht = tl.load(host_indices + token, mask=live, other=0)
            dt = tl.load(device_indices + token, mask=live, other=0)
            valid = (ht >= 0) & (ht < host_tokens) & (dt >= 0) & (dt < device_tokens)
            tl.store(error_flag + item * 0, 1, mask=live & ~valid)  # the C kernels' bad-index flag
            live = live & valid
            host_off = (ht // page_size) * host_page + (ht % page_size) * host_token + layer * host_layer + group * host_group
            device_base = tl.load(layer_bases + layer, mask=live, other=0).to(host.dtype)
            host_ptr = host + host_off[:, None] + word[None, :]
            device_ptr = device_base[:, None] + (dt * device_token + group * device_group)[:, None] + word[None, :]
            mask = live[:, None] & in_chunk[None, :]
            if TO_DEVICE:
                tl.store(device_ptr, tl.load(host_ptr, mask=mask), mask=mask)
            else:
                tl.store(host_ptr, tl.load(device_ptr, mask=mask), mask=mask)

    return kv_copy


_KERNEL = None


def kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    return _KERNEL


def tile(chunk_words: int) -> tuple[int, int]:
    """(ITEMS, WORDS): WORDS covers one chunk, ITEMS chunks fill a tile."""
    words = 1 << max(0, (chunk_words - 1).bit_length())
    return max(1, TILE_WORDS // words), words


class TritonLaunch(Launch):
    """The Triton kernel's arguments for one transfer, one launch per tensor (K, V)."""

    path = "kernel"

    def __init__(self, mover: TritonMover, transfer: Transfer, stream: int | None) -> None:
        self.backend, self.transfer = mover.backend, transfer
        # Indices on the device, copied on the stream of the call that builds the launch.
        self.indices = transfer.indices.on(self.backend.device)
        self.made = MadeOn(mover.streams, stream)

    def run(self, layers: range, stream: int | None) -> None:
        self.made.order(stream)
        for pair in self.transfer.pairs:
            self._launch(pair, layers)

    def _launch(self, pair: TensorPair, layers: range) -> None:
        transfer, (host_indices, device_indices) = self.transfer, self.indices
        s, c = pair.strides, pair.chunks
        table = pair.layer_table
        word = min(8, pair_width(pair, table))  # Triton's widest integer is 8 bytes
        items = transfer.tokens * len(layers) * c.groups
        ITEMS, WORDS = tile(c.chunk_bytes // word)
        grid = (max(1, min(self.backend.block_quota * 4, -(-items // ITEMS))),)
        kernel()[grid](
            pair.host.view(-1).view(WORD_DTYPES[word]), table.addresses, host_indices, device_indices, transfer.flag.tensor,
            items, transfer.tokens, layers.start, c.groups, c.chunk_bytes // word, transfer.page_size,
            s.page // word, s.token // word, s.layer // word, c.host_group // word,
            pair.device_token_bytes // word, c.device_group // word, s.tokens, pair.device[0].shape[0],
            TO_DEVICE=transfer.to_device, ITEMS=ITEMS, WORDS=WORDS, num_warps=8,
        )


class TritonMover(Mover):
    """The Triton kernel for one host pool."""

    io = "kernel"

    def __init__(self, backend: TritonBackend) -> None:
        self.backend = backend
        self.streams = backend.copier.streams()

    def build(self, transfer: Transfer) -> Launch:
        return TritonLaunch(self, transfer, self.streams.current())


class TritonBackend(Backend):
    name = "triton"
    # Triton's launcher refuses registered (mmap) host pointers (seen on the H200).
    kernel_reads_registered_memory = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'portable-kv[triton]')"
        if not torch.cuda.is_available() and not interpreted():
            return "no GPU is visible (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
        return None

    def __init__(self) -> None:
        super().__init__()
        self.vendor = "cpu" if self.device.type == "cpu" else ("amd" if getattr(torch.version, "hip", None) else "nvidia")
        self.block_quota: int = config.block_quota(self.vendor)
        # What Triton does not do, copies by the copy engines and page-locking: the GPU's
        # own runtime's, or under the interpreter the host's.
        self.runtime: DeviceRuntime | None = vendor_runtime(self.vendor, self.device)
        self.copier: Copier = self.runtime or Memmove()

    def _device(self) -> torch.device:
        if torch.cuda.is_available() and not interpreted():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def kernel_mover(self) -> Mover:
        return TritonMover(self)

    def staging_mover(self, blocks: int) -> Mover:
        return TritonMover(self)

    def describe(self) -> dict[str, str]:
        import triton

        return {"triton": triton.__version__, "interpreter": str(interpreted()), "block_quota": str(self.block_quota)}


def vendor_runtime(vendor: str, device: torch.device) -> DeviceRuntime | None:
    """The vendor runtime of `device`; None on the CPU."""
    if vendor == "nvidia":
        return CudaRuntime(device.index)
    if vendor == "amd":
        return HipRuntime(device.index)
    return None


def compile_ahead(target: Any, to_device: bool = True, chunk_words: int = 192) -> dict[str, bytes]:
    """Compile the kernel for a GPUTarget without a GPU (CI proves both vendors' builds this way)."""
    import triton
    from triton.compiler import ASTSource

    fn = kernel()
    pointers = {"host": "*i64", "layer_bases": "*i64", "host_indices": "*i64", "device_indices": "*i64", "error_flag": "*i32"}
    items, words = tile(chunk_words)
    constexprs = {"TO_DEVICE": to_device, "ITEMS": items, "WORDS": words}
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i64") for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=target).asm
