"""SGLang's HiCacheController on the MLA host pool that SGLang's own builder makes with portable_kv installed,
checked byte for byte against SGLang's own MLATokenToKVPoolHost driven the same way, layout by layout, in bf16 and fp8."""

from __future__ import annotations

import contextlib
import ctypes
import threading

import pytest
import torch
from mlakit import (
    DTYPES,
    KV_CACHE_DIM,
    LAYERS,
    MLA_CASES,
    PAGE,
    CpuMlaKvcacheio,
    device_pool,
    draft_pools,
    plain_controller,
    same,
    sglang_host_pool,
    wait,
    write_free_load,
)
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.pool_host.mla", reason=SKIP_REASON)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from portable_kv.engines.sglang.mla import SGLangMLAHostPool  # noqa: E402

# The attributes SGLang's controllers, storage backends and anchored pools read of an MLA host pool.
SGLANG_ATTRIBUTES = ("size", "page_num", "page_size", "layer_num", "target_layer_num", "layout", "dtype", "kv_lora_rank", "qk_rope_head_dim",
                     "kv_cache_dim", "override_kv_cache_dim", "token_stride_size", "layout_dim", "size_per_token", "logical_size",
                     "logical_page_size", "dcp_size", "dcp_rank", "start_layer", "end_layer", "pool_label", "storage_format_tag",
                     "stores_page_envelope", "shared_allocation_domain", "can_use_write_back_jit", "device_capacity_tokens",
                     "dsa_kv_cache_store_fp8", "device")


@pytest.fixture
def kvcacheio():
    """SGLang's own MLA pool's copy ops, for the reference pool; tensors are registered as pools appear."""
    with contextlib.ExitStack() as stack:
        yield CpuMlaKvcacheio().bind(stack)


def page_bytes(meta) -> list[bytes]:
    return [ctypes.string_at(pointer, size) for pointer, size in zip(*meta)]


def relative(meta, base: int) -> tuple[list[int], list[int]]:
    pointers, sizes = meta
    return [p - base for p in pointers], sizes


def whole_pages(host_indices: torch.Tensor, pages: list[int]) -> torch.Tensor:
    firsts = host_indices[::PAGE]
    return torch.cat([torch.arange(int(firsts[p]), int(firsts[p]) + PAGE) for p in pages])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("io", "layout"), MLA_CASES)
def test_write_free_load_evict_is_bit_exact_and_pages_match_sglangs_own_pool(topology, installed, kvcacheio, io, layout, dtype):
    topology(hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=io)
    dev, allocator = device_pool(DTYPES[dtype])
    ours = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    theirs = sglang_host_pool(dev, layout)
    assert type(ours) is SGLangMLAHostPool and isinstance(ours, MLATokenToKVPoolHost) and type(theirs) is MLATokenToKVPoolHost
    kvcacheio.register(*dev.kv_buffer, *theirs.data_refs)
    for name in SGLANG_ATTRIBUTES:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.kv_buffer.shape == theirs.kv_buffer.shape and ours.kv_buffer.dtype == theirs.kv_buffer.dtype
    assert ours.size == (2 * dev.size // PAGE + 1) * PAGE and ours.dtype == dev.store_dtype  # fp8: uint8 rows
    assert ours.get_size_per_token() == theirs.get_size_per_token() and ours.get_ksize_per_token() == theirs.get_ksize_per_token()

    # The same device rows through SGLang's controller into both pools: the same pages, byte for byte.
    written = allocator.alloc(5 * PAGE)
    reference = plain_controller(allocator, theirs, io)
    host_theirs = reference.write(written)
    wait(reference.ack_write_queue.pop())
    controller = plain_controller(allocator, ours, io)
    free_before = ours.available_size()
    host_ours = write_free_load(controller, dev, allocator, written, torch.Generator().manual_seed(11))
    assert ours.available_size() == free_before - 5 * PAGE
    # The cycle scribbled over the device rows after the write: both pools hold what was written.
    for page in range(5):
        a, b = int(host_ours[page * PAGE]), int(host_theirs[page * PAGE])
        assert same(ours.get_data_page(a), theirs.get_data_page(b)), f"flat page {page}"
        assert same(ours.get_data_page(a, flat=False), theirs.get_data_page(b, flat=False)), f"page view {page}"
    assert page_bytes(ours.get_page_buffer_meta(host_ours)) == page_bytes(theirs.get_page_buffer_meta(host_theirs))
    some = whole_pages(torch.arange(ours.size), [3, 0, 7])
    assert relative(ours.get_page_buffer_meta(some), ours.kv_buffer.data_ptr()) == relative(theirs.get_page_buffer_meta(some), theirs.kv_buffer.data_ptr())
    assert ours.get_page_buffer_element_size() == theirs.get_page_buffer_element_size()
    dummy, their_dummy = ours.get_dummy_flat_data_page(), theirs.get_dummy_flat_data_page()
    assert (dummy.shape, dummy.dtype) == (their_dummy.shape, their_dummy.dtype) and not dummy.any()
    assert relative(ours.get_contiguous_buf_infos()[:2], ours.kv_buffer.data_ptr()) == relative(theirs.get_contiguous_buf_infos()[:2], theirs.kv_buffer.data_ptr())
    assert ours.get_contiguous_buf_infos()[2] == theirs.get_contiguous_buf_infos()[2]
    # A page SGLang's pool flattened, written back into portable_kv's, reads back as SGLang's.
    ours.set_from_flat_data_page(int(host_ours[0]), theirs.get_data_page(int(host_theirs[PAGE])))
    assert same(ours.get_data_page(int(host_ours[0])), theirs.get_data_page(int(host_theirs[PAGE])))

    assert controller.evict_host(host_ours) == 5 * PAGE and ours.available_size() == free_before
    with pytest.raises(ValueError, match="not allocated"):
        controller.evict_host(host_ours)
    ours.destroy()
    assert ours.kv_buffer is None


@pytest.mark.parametrize(("io", "layout"), [MLA_CASES[1], MLA_CASES[3]])
def test_packed_drafts_load_into_their_own_pools_through_sglangs_hybrid_controller(topology, installed, io, layout):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack

    topology(hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=io, hicache_write_policy="write_through")
    dev, allocator = device_pool(torch.bfloat16)
    drafts = draft_pools(torch.bfloat16)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=PAGE, mtp_draft_device_pools=drafts)
    group, controller = build_kv_only_stack(params=params, kv_pool=dev, full_layer_mapping={i: i for i in range(LAYERS)},
                                            load_cache_event=threading.Event(), storage_backend=None, use_mla=True)
    host = group.anchor_entry.host_pool
    assert type(host) is SGLangMLAHostPool and type(controller).__name__ == "HybridCacheController"
    theirs = sglang_host_pool(dev, layout, drafts)
    assert (host.target_layer_num, host.layer_num) == (theirs.target_layer_num, theirs.layer_num) == (LAYERS, LAYERS + 2)
    assert host.kv_buffer.shape == theirs.kv_buffer.shape and host.get_size_per_token() == theirs.get_size_per_token()
    host_indices = write_free_load(controller, dev, allocator, allocator.alloc(3 * PAGE), torch.Generator().manual_seed(5), drafts)
    assert controller.evict_host(host_indices) == 3 * PAGE
    host.destroy()


def test_a_draft_layer_moves_only_with_its_own_pool(topology, installed):
    topology(hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, _ = device_pool(torch.bfloat16)
    drafts = draft_pools(torch.bfloat16)
    infos = tuple(d.get_device_pool_infos()[0].buffer_info for d in drafts)
    host = SGLangMLAHostPool(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first", draft_buffer_infos=infos,
                             device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    slots, others = torch.arange(2 * PAGE), torch.arange(4 * PAGE, 6 * PAGE)
    host.backup_from_device_all_layer(dev, slots, slots, "kernel")
    host.load_to_device_per_layer(dev, slots, others, LAYERS, "kernel")  # a target call past the target's layers: nothing
    assert not any(same(d.kv_buffer[0][others], d.kv_buffer[0][slots]) for d in drafts)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, slots, others, layer, "kernel")
    for depth, draft in enumerate(drafts):
        host.load_to_device_per_layer(draft, slots, others, LAYERS + depth, "kernel", is_draft=True)
    for buffer in [*dev.kv_buffer, *(d.kv_buffer[0] for d in drafts)]:
        assert same(buffer[others], buffer[slots])
    with pytest.raises(ValueError, match=r"^layer_id: expected a packed draft layer in \[3, 5\)"):
        host.load_to_device_per_layer(drafts[0], slots, others, 0, "kernel", is_draft=True)
    with pytest.raises(ValueError, match="^device_pool: with is_draft=True, expected the one-layer device pool"):
        host.load_to_device_per_layer(dev, slots, others, LAYERS, "kernel", is_draft=True)
    with pytest.raises(ValueError, match="^device_pool: expected the target model's device pool of 3 layers"):
        host.backup_from_device_all_layer(drafts[0], slots, slots, "kernel")
    host.destroy()


@pytest.mark.parametrize(("rope", "layers", "message"), [
    (8, 1, r"^draft_buffer_infos\[1\]: expected latent rows like the target's"),
    (16, 2, r"^draft_buffer_infos\[1\]: expected one packed draft layer, got 2"),
])
def test_a_draft_unlike_the_target_is_named(topology, rope, layers, message):
    topology()
    dev, _ = device_pool(torch.bfloat16)
    good, bad = draft_pools(torch.bfloat16, 1)[0], draft_pools(torch.bfloat16, 1, layers=layers, rope=rope)[0]
    infos = tuple(pool.get_device_pool_infos()[0].buffer_info for pool in (good, bad))
    with pytest.raises(ValueError, match=message):
        SGLangMLAHostPool(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first", draft_buffer_infos=infos,
                          device_capacity_tokens=dev.size, target_layer_num=LAYERS)


def test_the_installed_pool_takes_sglangs_mla_branches_but_not_tensorcasts_exact_type_check(topology, installed):
    topology(hicache_mem_layout="page_first_direct", hicache_io_backend="direct")
    dev, _ = device_pool(torch.bfloat16)
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    # cache_controller's L3 checks and Mooncake's layout and keys test isinstance; TensorCast tests `type(pool) is`.
    assert isinstance(host, MLATokenToKVPoolHost) and isinstance(host, HostKVCache)
    assert type(host) is not MLATokenToKVPoolHost
    assert not SGLangMLAHostPool.__abstractmethods__
    assert host.kv_buffer.shape == (host.page_num, LAYERS, PAGE, 1, KV_CACHE_DIM)
    assert host.init_kv_buffer() is host.kv_buffer
    host.destroy()
