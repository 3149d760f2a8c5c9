"""--section vllm: stores and loads of vLLM-shaped KV blocks through the vLLM spec's host tier.

vLLM 0.33.0 offloads 16-token blocks as rows of block tensors: one tensor a
layer (a block's page of that layer) or one cross-layer tensor (a block's
pages of every layer, back to back), into host chunks of `blocks_per_chunk`
blocks.  Per model geometry (Llama-3-8B's K/V, DeepSeek-V3's MLA latent), tensor
kind and blocks per chunk, one store (D2H) and one load (H2D) of the same
blocks at random places in the device cache, through
`portable_kv.engines.vllm.HostTier` (what the spec's worker calls) on each io
path the backend offers, and beside it what vLLM does: one batched memcpy with
a descriptor per block and tensor (`swap_blocks_batch`, cuMemcpyBatchAsync),
and for loads vLLM's Triton swap kernel where vllm imports; on a GPU also a
store and a load of other blocks at once, on two streams, each path and the
memcpy (against the both-ways ceiling); against the ceiling of the same run.  On the cpu backend the sizes are tiny and the rows a
smoke test.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .. import backends
from ..engines.vllm import HostTier
from ..io.copier import CopyBatch
from .context import Context
from .measure import gbps
from .rows import Row
from .sections import percent, timed_pair

BLOCK_TOKENS = 16
# (name, layers, bytes of one layer's page of a 16-token block): K and V of 8 heads x 128 in bf16;
# DeepSeek-V3's 576-element latent in bf16.
MODELS = (("Llama-3-8B", 32, 2 * BLOCK_TOKENS * 8 * 128 * 2), ("DeepSeek-V3", 61, BLOCK_TOKENS * 576 * 2))
CHUNK_BLOCKS = (1, 16)


def measure(ctx: Context) -> list[Row]:
    backend = backends.current()
    # A transfer of 128 blocks (Llama-3-8B: 256 MiB) from a cache of 4x as many; tiny on the CPU.
    blocks, layers_cap = (128, None) if ctx.gpu else (32, 2)
    rows: list[Row] = []
    ctx.progress.expect(len(MODELS) * 2 * len(CHUNK_BLOCKS))
    for model, layers, page in MODELS:
        layers = min(layers, layers_cap or layers)
        for kind in ("per-layer", "cross-layer"):
            pages = [page] * layers if kind == "per-layer" else [page * layers]
            for per_chunk in CHUNK_BLOCKS:
                rows += _case(ctx, backend, f"{model} {kind} x{per_chunk}", pages, per_chunk, blocks)
                ctx.progress.done(f"vllm: {model} {kind} tensors, {per_chunk} blocks a chunk, {blocks} blocks a transfer")
    return rows


def _case(ctx: Context, backend: Any, label: str, pages: list[int], per_chunk: int, blocks: int) -> list[Row]:
    device = backend.device
    num_blocks = 4 * blocks
    tensors = [torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, device=device) for p in pages]
    kv = SimpleNamespace(tensors=[SimpleNamespace(tensor=t, page_size_bytes=p) for t, p in zip(tensors, pages)],
                         group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=p, mapping=None) for i, p in enumerate(pages)]])
    rng = np.random.default_rng(0)
    order = rng.permutation(num_blocks).astype(np.int64)
    gpu_blocks, other_blocks = order[:blocks], order[blocks : 2 * blocks]  # the store's; a load's at the same time
    chunk_order = rng.permutation(2 * blocks // per_chunk).astype(np.int64)
    chunks, other_chunks = chunk_order[: blocks // per_chunk], chunk_order[blocks // per_chunk :]
    nbytes = blocks * sum(pages)
    extra = {"blocks_per_chunk": per_chunk, "tensors": len(pages), "block_bytes": sum(pages)}
    rows: list[Row] = []

    def row(name: str, direction: str, seconds: float, host_s: float, **more: Any) -> Row:
        rate = gbps(nbytes, seconds)
        return Row("vllm", f"{label} {name}", direction, BLOCK_TOKENS, rate, percent(rate, ctx.ceil, direction), host_s * 1e6,
                   extra={**extra, **more})

    ios = [io for io in backend.io_backends if not (backend.vendor == "amd" and io in ("direct", "staged", "auto"))]
    tier = HostTier(kv, per_chunk, 2 * blocks // per_chunk, {"store": ios[0], "load": ios[0]})
    try:
        moves = tier.plan(gpu_blocks, [blocks], [0], chunks)
        for io in ios:
            for to_device, direction in ((False, "d2h"), (True, "h2d")):
                seconds, host_s = ctx.clock.time(lambda t=to_device, i=io: tier.move(moves, t, i), ctx.reps)
                rows.append(row(f"portable_kv {io}", direction, seconds, host_s, io=io))
        views = [tier.chunk_view(t) for t in range(len(tensors))]
        rows += _peers(ctx, backend, tensors, views, gpu_blocks, chunks, per_chunk, pages, row)
        if ctx.gpu:
            # A store and a load of other blocks at once, each on a stream of its own (as vLLM's worker runs them).
            load_moves = tier.plan(other_blocks, [blocks], [0], other_chunks)
            store_batch = _descriptors(tensors, views, gpu_blocks, chunks, per_chunk, pages, False)
            load_batch = _descriptors(tensors, views, other_blocks, other_chunks, per_chunk, pages, True)
            pairs = {f"portable_kv {io}": (lambda i=io: tier.move(load_moves, True, i), lambda i=io: tier.move(moves, False, i)) for io in ios}
            pairs["peer: batched memcpy, a descriptor a block"] = (
                lambda: backend.copier.memcpy_batch(load_batch, backend.copier.current_stream()),
                lambda: backend.copier.memcpy_batch(store_batch, backend.copier.current_stream()))
            for name, (load, store) in pairs.items():
                up, down, span = timed_pair(load, store, ctx.reps)
                rows.append(row(f"{name} store + load at once", "both", span / 2, 0.0, h2d_gbps=gbps(nbytes, up), d2h_gbps=gbps(nbytes, down)))
    finally:
        tier.close()
    return rows


def _descriptors(tensors: list[torch.Tensor], views: list[torch.Tensor], gpu_blocks: np.ndarray, chunks: np.ndarray, per_chunk: int,
                 pages: list[int], to_device: bool) -> CopyBatch:
    """vLLM's descriptors: one per block and tensor, as its handler's compute_sub_block_ptrs makes them."""
    tokens = (chunks[:, None] * per_chunk + np.arange(per_chunk)).ravel()[: len(gpu_blocks)].astype(np.uint64)
    dev, host, sizes = [], [], []
    for tensor, view, page in zip(tensors, views, pages):
        dev.append(tensor.data_ptr() + gpu_blocks.astype(np.uint64) * np.uint64(page))
        host.append(view.data_ptr() + tokens * np.uint64(page))
        sizes.append(np.full(len(gpu_blocks), page, np.uint64))
    dev_a, host_a, size_a = (np.concatenate(a).astype(np.uint64) for a in (dev, host, sizes))
    return CopyBatch(dev_a, host_a, size_a) if to_device else CopyBatch(host_a, dev_a, size_a)


def _peers(ctx: Context, backend: Any, tensors, views, gpu_blocks, chunks, per_chunk, pages, row) -> list[Row]:
    rows = []
    engine = backend.copier
    for to_device, direction in ((False, "d2h"), (True, "h2d")):
        batch = _descriptors(tensors, views, gpu_blocks, chunks, per_chunk, pages, to_device)
        seconds, host_s = ctx.clock.time(lambda b=batch: engine.memcpy_batch(b, engine.current_stream()), ctx.reps)
        rows.append(row("peer: batched memcpy, a descriptor a block", direction, seconds, host_s, descriptors=len(batch)))
    swap = _vllm_triton_swap() if ctx.gpu and backend.vendor == "nvidia" else None
    if isinstance(swap, str):
        rows.append(Row("vllm", "peer: vLLM's Triton swap kernel", "-", extra={"skipped": swap}))
    elif swap is not None and all(p % 8 == 0 for p in pages):
        kernel, threshold = swap
        batch = _descriptors(tensors, views, gpu_blocks, chunks, per_chunk, pages, True)
        src, dst, sizes = (torch.from_numpy(a.view(np.int64)).pin_memory() for a in (batch.src, batch.dst, batch.sizes))
        chunk = min(1 << (max(pages) - 1).bit_length(), 8192)
        seconds, host_s = ctx.clock.time(lambda: kernel(src, dst, sizes, bytes_per_chunk=chunk), ctx.reps)
        rows.append(row("peer: vLLM's Triton swap kernel", "h2d", seconds, host_s, vllm_uses_it=max(pages) < threshold))
    return rows


def _vllm_triton_swap() -> tuple[Any, int] | str:
    """vLLM's Triton `swap_blocks_batch` and the page size under which vLLM picks it, or why it does not import here."""
    try:
        from vllm.v1.kv_offload.cpu.swap_blocks_triton import THRESHOLD_BYTES, swap_blocks_batch
    except Exception as exc:  # noqa: BLE001 -- vllm absent or its compiled ops missing: a row says so
        return f"vllm.v1.kv_offload.cpu.swap_blocks_triton does not import here: {type(exc).__name__}: {exc}"
    return swap_blocks_batch, THRESHOLD_BYTES
