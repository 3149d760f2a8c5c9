"""What the MLA tests share: SGLang's MLA device pools on the CPU, SGLang's own MLA host pool beside
portable_kv's, the copy ops SGLang's own pool calls (sgl_kernel's, absent on the CPU), and the
write -> free -> load -> per-layer wait cycle through SGLang's controllers.

Random bits are written and compared as bytes: bf16 bits include NaNs, fp8 caches are stored
as uint8 (SGLang's `store_dtype`), and either compares equal only byte for byte.
"""

from __future__ import annotations

import contextlib
import threading

import torch

PAGE = 4
LAYERS = 3
DEVICE_TOKENS = 64
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 32, 16
KV_CACHE_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# The (io backend, layout) pairs SGLang moves for an MLA pool: its controller refuses direct io
# with page_first (`move_indices`), and its MLA pool kernel io with page_first_direct (which
# SGLang's argument hook rewrites to direct io for MLA models).
MLA_CASES = [("kernel", "layer_first"), ("kernel", "page_first"), ("direct", "layer_first"), ("direct", "page_first_direct")]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(raw(a), raw(b))


def fill(buffer: torch.Tensor, generator: torch.Generator, rows: torch.Tensor | None = None) -> None:
    """Random bytes into `rows` of a device layer buffer (every row if None)."""
    view = buffer.view(torch.uint8)
    if rows is None:
        view.copy_(torch.randint(0, 256, view.shape, generator=generator, dtype=torch.uint8))
    else:
        view[rows] = torch.randint(0, 256, (len(rows), *view.shape[1:]), generator=generator, dtype=torch.uint8)


def device_pool(dtype: torch.dtype, layers: int = LAYERS, *, rope: int = QK_ROPE_HEAD_DIM, seed: int = 7):
    """SGLang's MLA device pool and its paged allocator, on the CPU, filled with random bytes."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, KV_LORA_RANK, rope, layers, "cpu", False, start_layer=0, end_layer=layers)
    generator = torch.Generator().manual_seed(seed)
    for buffer in pool.kv_buffer:
        fill(buffer, generator)
    return pool, PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, dtype, "cpu", pool, need_sort=False)


def draft_pools(dtype: torch.dtype, count: int = 2, *, layers: int = 1, rope: int = QK_ROPE_HEAD_DIM) -> tuple:
    """One-layer MLA device pools, as SGLang's NextN MTP draft runners build them."""
    return tuple(device_pool(dtype, layers, rope=rope, seed=100 + depth)[0] for depth in range(count))


def sglang_host_pool(dev, layout: str, drafts: tuple = ()):
    """SGLang's own MLA host pool over `dev`, with the arguments SGLang's assembler passes.

    Not page-locked: pinning registers memory with a CUDA driver, and changes no byte."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = dev.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, override_kv_cache_dim=dev.kv_cache_dim,
                                draft_buffer_infos=tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts),
                                device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num)


class CpuMlaKvcacheio:
    """sgl_kernel's MLA copy ops that SGLang's own MLA host pool calls, in torch, for CPU runs.

    SGLang imports them from sgl_kernel only on CUDA and ROCm, so on the CPU its own pool, the
    reference portable_kv's is checked against, could not move a byte.  These follow the kernels'
    contracts: row `src_indices[i]` (an item: whatever follows the indexed dims) lands on row
    `dst_indices[i]`; page_first hosts are (row, layer, ...), page_first_direct hosts (page, layer,
    row in page, ...).  The all-layer ops
    address layers through tables of data pointers (the device pool's `data_ptrs`, the host pool's
    `data_ptrs` over its `data_refs`), resolved through the tensors registered here.
    """

    OPS = ("transfer_kv_per_layer_mla", "transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla_lf_pf",
           "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")

    def __init__(self, *tensors: torch.Tensor):
        self.by_pointer: dict[int, torch.Tensor] = {}
        self.register(*tensors)

    def register(self, *tensors: torch.Tensor) -> None:
        self.by_pointer.update({t.data_ptr(): t for t in tensors})

    def _layers(self, pointers: torch.Tensor, count: int) -> list[torch.Tensor]:
        return [self.by_pointer[p] for p in pointers.tolist()[:count]]

    @staticmethod
    def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, **_):
        rows(dst, 1)[dst_indices] = rows(src, 1)[src_indices]

    def transfer_kv_all_layer_mla(self, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_):
        for src, dst in zip(self._layers(src_layers, num_layers), self._layers(dst_layers, num_layers), strict=True):
            rows(dst, 1)[dst_indices] = rows(src, 1)[src_indices]

    @staticmethod
    def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, **_):
        rows(dst, 1)[dst_indices] = rows(src, 2)[src_indices, layer_id]

    def transfer_kv_all_layer_mla_lf_pf(self, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, **_):
        for layer, src in enumerate(self._layers(src_layers, num_layers)):
            rows(dst, 2)[dst_indices, layer] = rows(src, 1)[src_indices]

    @staticmethod
    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers, strict=True):
            rows(dst, 1)[dst_indices] = rows(src, 1)[src_indices]

    @staticmethod
    def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
            rows(dst, 1)[dst_indices] = rows(src, 3)[src_indices // page_size, layer_id, src_indices % page_size]

    @staticmethod
    def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
        (dst,) = dst_ptrs
        for layer, src in enumerate(src_ptrs):
            rows(dst, 3)[dst_indices // page_size, layer, dst_indices % page_size] = rows(src, 1)[src_indices]

    def bind(self, exit_stack: contextlib.ExitStack, module: str = "mla") -> CpuMlaKvcacheio:
        """Give one of SGLang's host-pool modules (`mla`; `dsa` for DSA's indexer pools, which call the
        same ops) the ops it lacks, until `exit_stack` closes."""
        import importlib

        host_module = importlib.import_module(f"sglang.srt.mem_cache.pool_host.{module}")
        for name in self.OPS:
            if not hasattr(host_module, name):
                setattr(host_module, name, getattr(self, name))
                exit_stack.callback(delattr, host_module, name)
        return self


def rows(buffer: torch.Tensor, lead: int) -> torch.Tensor:
    """A view of `buffer` keeping its `lead` leading dims and one row of the rest: an op's item."""
    return buffer.view(*buffer.shape[:lead], -1)


def wait(ack) -> None:
    ack.finish_event.synchronize()


def write_free_load(controller, dev, allocator, written: torch.Tensor, generator: torch.Generator, drafts: tuple = ()) -> torch.Tensor:
    """write `written` device rows -> free them -> `load_and_check`, through one of SGLang's controllers.

    Returns the host indices, still allocated."""
    originals = [b[written].clone() for b in device_buffers(dev, drafts)]
    host_indices = controller.write(written)
    assert host_indices is not None and len(host_indices) == len(written)
    wait(controller.ack_write_queue.pop())
    allocator.free(written)
    allocator.free(load_and_check(controller, dev, allocator, host_indices, originals, generator, drafts))
    return host_indices


def device_buffers(dev, drafts: tuple = ()) -> list[torch.Tensor]:
    return [*dev.kv_buffer, *(d.kv_buffer[0] for d in drafts)]


def load_and_check(controller, dev, allocator, host_indices: torch.Tensor, originals: list, generator: torch.Generator, drafts: tuple = ()) -> torch.Tensor:
    """load -> start_loading -> per-layer wait: `host_indices` back to new device rows, which must hold `originals`.

    Every device row is scribbled on first (freed rows go to other requests), so a load that
    moves nothing cannot pass.  Each target layer is checked once the forward pass's wait for it
    (`get_key_buffer`) returns; drafts, which run after the target's forward, after the load's
    ack.  Returns the loaded rows, still allocated; raises AssertionError naming the first layer
    that differs, or a row outside the loaded ones that changed.
    """
    buffers = device_buffers(dev, drafts)
    for buffer in buffers:
        fill(buffer, generator)
    before = [b.clone() for b in buffers]
    loaded = controller.load(host_indices)
    assert loaded is not None
    dev.register_layer_transfer_counter(controller.layer_done_counter)
    producer = controller.start_loading()
    assert producer >= 0
    controller.layer_done_counter.set_consumer(producer)
    for layer in range(dev.layer_num):
        dev.get_key_buffer(layer)  # an attention layer's read waits for its layer's load
        assert same(dev.kv_buffer[layer][loaded], originals[layer]), f"layer {layer}: loaded rows differ from the written ones"
    wait(controller.ack_load_queue.pop())
    for depth, draft in enumerate(drafts):
        assert same(draft.kv_buffer[0][loaded], originals[dev.layer_num + depth]), f"MTP draft {depth}: loaded rows differ"
    for index, (buffer, old, new) in enumerate(zip(buffers, before, originals)):
        expected = old.clone()
        expected[loaded] = new
        assert same(buffer, expected), f"buffer {index}: a row outside the loaded ones changed"
    return loaded


def plain_controller(allocator, host, io: str):
    """SGLang's plain HiCacheController over `host`, as the tests of both pools build it."""
    from sglang.srt.managers.cache_controller import HiCacheController

    return HiCacheController(allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend=io, write_policy="write_through")
