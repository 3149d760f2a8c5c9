"""SGLang's own JIT HiCache kernels as peers: the per-layer loads SGLang 0.5.23's host pools
issue with `--hicache-io-backend kernel`, through `sglang.kernels.ops.kvcache.hicache`.

Two kernels: SGLang's default, as its host pools call it (its TMA kernel at 4 CTAs where
the row and the page fit it on sm_90+, else its register kernel; SGLang decides, and
the row says which), and its register kernel at its default quota of 2 blocks.  A pool
whose K and V rows are as wide (SGLang's MHA pool) loads a layer in one call; K and V
of different head dims (MiMo's K 192 / V 128) as two MLA-shaped calls, K then V; an MLA
latent in one MLA call.  The kernels read a layer's host rows as one 2-D view, which a
`layer_first` host pool (SGLang's default layout) has, and take indices on the device.

SGLang compiles these kernels with nvcc on first use (ninja, apache-tvm-ffi): `kernels()`
compiles every one a table needs at once, on threads, before anything is timed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

OPS = "sglang.kernels.ops.kvcache.hicache"
KERNELS = ("default", "register")
REGISTER_QUOTA = 2  # SGLang's DEFAULT_BLOCK_QUOTA on CUDA
Load = Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor], None]


def ops() -> tuple[Any, str]:
    """SGLang's hicache ops module and its version, or None and the one-line reason it cannot run here."""
    if importlib.util.find_spec("sglang") is None:
        return None, "SGLang is not installed here (tools/fetch_gpu_wheels.sh --sglang carries it to a GPU host)"
    if not torch.cuda.is_available() or torch.version.hip:
        return None, "SGLang's JIT HiCache kernels are measured on NVIDIA GPUs only"
    try:
        module = importlib.import_module(OPS)
        version = getattr(importlib.import_module("sglang"), "__version__", "?")
    except Exception as exc:  # noqa: BLE001 -- any failure to import is the row's reason
        return None, f"{OPS} does not import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return module, version


def row_bytes(buffer: torch.Tensor) -> int:
    """Bytes of one token's row of a layer's buffer (tokens, heads, dim)."""
    return buffer[0].numel() * buffer.element_size()


class SGLangKernels:
    """SGLang's kernels for one pool geometry and page size: `load(kernel)` is a per-layer load
    taking (device buffers, host buffers, device indices, host indices) of one layer."""

    def __init__(self, module: Any, version: str, rows: list[int], page_size: int) -> None:
        self.ops, self.version, self.rows, self.page_size = module, version, rows, page_size
        self.split = len(rows) == 2 and rows[0] != rows[1]  # K and V as two MLA-shaped calls
        self.modules: dict[int, Any] = {}  # row bytes -> the register kernel's module (compile())

    def took(self, kernel: str) -> str:
        """Which of SGLang's kernels `kernel` runs, per call (K, V) where the rows differ."""
        if kernel == "register":
            return f"register, {REGISTER_QUOTA} blocks"
        quota = self.ops.TMA_BLOCK_QUOTA
        names = [f"TMA, {quota} CTAs" if self.ops.use_hicache_tma_kernel(element_size=b, block_quota=quota, page_size=self.page_size)
                 else f"register, {self.ops.DEFAULT_BLOCK_QUOTA} blocks" for b in self.calls()]
        return names[0] if len(set(names)) == 1 else f"K {names[0]}, V {names[1]}"

    def calls(self) -> list[int]:
        """The row bytes of each call of a layer's load."""
        return self.rows if self.split else self.rows[:1]

    def compile(self) -> str:
        """Compile every kernel these loads use, on threads; "" or the one-line reason they failed."""
        def register(element_size: int) -> Any:
            return self.ops._jit_hicache_module(  # noqa: SLF001 -- SGLang's register kernel at a quota of our choice
                element_size=element_size, unroll=self.ops._default_unroll(element_size), block_quota=REGISTER_QUOTA)  # noqa: SLF001

        def default(element_size: int) -> bool:
            return self.ops.can_use_hicache_jit_kernel(element_size=element_size, page_size=self.page_size)

        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                for ok in list(pool.map(default, self.calls())):
                    if not ok:
                        return "SGLang's own check refuses its JIT kernel for these rows (can_use_hicache_jit_kernel)"
                self.modules = dict(zip(self.calls(), pool.map(register, self.calls())))
        except Exception as exc:  # noqa: BLE001 -- a failed compile is the row's reason
            return f"SGLang's JIT compile failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return ""

    def load(self, kernel: str) -> Load:
        ops, page = self.ops, self.page_size

        def default(dst: list[torch.Tensor], src: list[torch.Tensor], dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
            if len(dst) == 2 and not self.split:
                ops.transfer_hicache_one_layer(dst[0], dst[1], dst_idx, src[0], src[1], src_idx,
                                               element_dim=dst[0][0].numel(), page_size=page)
                return
            for d, s in zip(dst, src):
                ops.transfer_hicache_one_layer_mla(d, dst_idx, s, src_idx, element_dim=d[0].numel(), page_size=page)

        def register(dst: list[torch.Tensor], src: list[torch.Tensor], dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
            flat = [[t.view(t.shape[0], -1) for t in ts] for ts in (dst, src)]
            if len(dst) == 2 and not self.split:
                self.modules[self.rows[0]].launch_one(flat[0][0], flat[0][1], dst_idx, flat[1][0], flat[1][1], src_idx)
                return
            for d, s, nbytes in zip(*flat, self.calls()):
                self.modules[nbytes].launch_one_mla(d, dst_idx, s, src_idx)

        return default if kernel == "default" else register


def kernels(buffers: list[torch.Tensor], page_size: int) -> tuple[SGLangKernels | None, str]:
    """SGLang's kernels for pools whose layer buffers are like `buffers` (one layer's device
    buffers: K and V, or the latent), compiled; or None and the one-line reason they cannot run."""
    module, version = ops()
    if module is None:
        return None, version
    found = SGLangKernels(module, version, [row_bytes(b) for b in buffers], page_size)
    reason = found.compile()
    return (None, reason) if reason else (found, "")
