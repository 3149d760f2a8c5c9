"""Triton: one kernel source for NVIDIA and AMD; on a machine without a GPU it runs
under Triton's interpreter (TRITON_INTERPRET=1), so CI executes the kernel logic.

The kernel is the algorithm of kernels_common/kv_copy.h in Triton's terms:
a program takes ITEMS chunks (token, layer, head group) at a time, computes
both addresses from the indices and the layout strides, and copies the chunk's
words.  `direct` reuses the vendor backend's batched DMA (the CPU plan under
the interpreter).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..cache import IdentityCache
from ..plan import TensorPair, Transfer
from .base import Backend, BadIndexFlag
from .gpu import LayerTable, access_width

WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
TILE_WORDS = 4096  # words a program moves per step: enough in flight to cover PCIe latency


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel():
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
            item = start + tl.arange(0, ITEMS)
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


def kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    return _KERNEL


def tile(chunk_words: int) -> tuple[int, int]:
    """(ITEMS, WORDS): WORDS covers one chunk, ITEMS chunks fill a tile."""
    words = 1 << max(0, (chunk_words - 1).bit_length())
    return max(1, TILE_WORDS // words), words


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
        self.block_quota = int(os.environ.get("PORTABLE_KV_BLOCKS", 32 if self.vendor == "amd" else 16))
        self._tables = IdentityCache(64)
        self.bad_index = BadIndexFlag(self.device)

    def _device(self) -> torch.device:
        if torch.cuda.is_available() and not interpreted():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _dma(self) -> Backend:
        from . import get

        if self.device.type == "cpu":
            return get("cpu")
        return get("rocm" if self.vendor == "amd" else "cuda")

    def transfer(self, transfer: Transfer, io_backend: str) -> None:
        self.bad_index.check()
        if io_backend == "direct":
            self._dma().transfer(transfer, "direct")
            return
        host_indices, device_indices = transfer.indices.on(self.device)
        for pair in transfer.pairs:
            self._launch(transfer, pair, host_indices, device_indices)

    def _launch(self, transfer: Transfer, pair: TensorPair, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        s, c = pair.strides, pair.chunks
        table = self._tables.get(pair.device, lambda: LayerTable(pair.device, self.device))
        word = min(8, access_width(pair.host.data_ptr(), table.alignment, s.page, s.token, s.layer, c.host_group,
                                   pair.device_token_bytes, c.device_group, c.chunk_bytes))
        items = transfer.tokens * len(transfer.layers) * c.groups
        ITEMS, WORDS = tile(c.chunk_bytes // word)
        grid = (max(1, min(self.block_quota * 4, -(-items // ITEMS))),)
        kernel()[grid](
            pair.host.view(-1).view(WORD_DTYPES[word]), table.addresses, host_indices, device_indices, self.bad_index.tensor,
            items, transfer.tokens, transfer.layers.start, c.groups, c.chunk_bytes // word, transfer.page_size,
            s.page // word, s.token // word, s.layer // word, c.host_group // word,
            pair.device_token_bytes // word, c.device_group // word, s.tokens, pair.device[0].shape[0],
            TO_DEVICE=transfer.to_device, ITEMS=ITEMS, WORDS=WORDS, num_warps=8,
        )

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict[str, str]:
        import triton

        return {"triton": triton.__version__, "interpreter": str(interpreted()), "block_quota": str(self.block_quota)}


def compile_ahead(target, to_device: bool = True, chunk_words: int = 192) -> dict[str, bytes]:
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
