"""portable_kv pages against SGLang's own MHA host pool holding the same data, and through SGLang's HiCacheFile L3 tier."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from sglangkit import PAGE, SKIP_REASON, device_pool

pytest.importorskip("sglang.srt.managers.cache_controller", reason=SKIP_REASON)
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost  # noqa: E402

from portable_kv.engines.sglang import SGLangHostPool  # noqa: E402

SYMMETRIC_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
ASYMMETRIC_LAYOUTS = ("page_first", "page_first_direct")  # all SGLang's asymmetric pool has


def pool_pair(cls, layout, k_dim, v_dim):
    """SGLang's host pool and a portable_kv one from the same constructor arguments, holding the same random bits."""
    dev, _ = device_pool(k_dim, v_dim)
    info = dev.get_device_pool_infos()[0].buffer_info
    args = (info, 2.0, 0, PAGE, layout)
    kwargs = dict(device_capacity_tokens=dev.size, start_layer=0, end_layer=dev.layer_num)
    theirs = cls(*args, pin_memory=False, **kwargs)
    ours = SGLangHostPool(*args, pin_memory=False, **kwargs)
    assert ours.size == theirs.size and ours.page_num == theirs.page_num
    generator = torch.Generator().manual_seed(11)
    for mine, their in zip((ours.k_buffer, ours.v_buffer), (theirs.k_buffer, theirs.v_buffer)):
        assert mine.shape == their.shape
        their.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, their.shape, generator=generator, dtype=torch.int16))
        mine.copy_(their)
    return theirs, ours


def meta_bytes(meta):
    ptrs, sizes = meta
    return [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes)], sizes


@pytest.mark.parametrize("layout", SYMMETRIC_LAYOUTS)
def test_flat_pages_and_meta_match_sglangs_mha_pool(topology, layout):
    topology()
    theirs, ours = pool_pair(MHATokenToKVPoolHost, layout, 16, 16)
    for first in range(0, ours.size, PAGE):
        assert torch.equal(ours.get_data_page(first).view(torch.int16), theirs.get_data_page(first).view(torch.int16)), f"page at {first}"
        their_view = theirs.get_data_page(first, flat=False)
        for mine, their in zip(ours.get_data_page(first, flat=False), (their_view[0], their_view[1])):
            assert mine.shape == their.shape and torch.equal(mine.view(torch.int16), their.view(torch.int16))
    tokens = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (3, 0, 7)])
    assert meta_bytes(ours.get_page_buffer_meta(tokens)) == meta_bytes(theirs.get_page_buffer_meta(tokens))
    assert ours.get_page_buffer_element_size() == theirs.get_page_buffer_element_size()
    if layout == "page_head":
        assert meta_bytes(ours.get_split_heads_page_buffer_meta(tokens, 2)) == meta_bytes(theirs.get_split_heads_page_buffer_meta(tokens, 2))
    # A page SGLang flattened, written back by portable_kv, lands where SGLang's own write puts it.
    page = theirs.get_data_page(5 * PAGE)
    ours.set_from_flat_data_page(2 * PAGE, page)
    theirs.set_from_flat_data_page(2 * PAGE, page)
    assert torch.equal(ours.k_buffer.view(torch.int16), theirs.k_buffer.view(torch.int16))
    assert torch.equal(ours.v_buffer.view(torch.int16), theirs.v_buffer.view(torch.int16))
    assert ours.get_size_per_token() == theirs.get_size_per_token() and ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    ours.destroy()


@pytest.mark.parametrize("layout", ASYMMETRIC_LAYOUTS)
def test_meta_matches_sglangs_asymmetric_pool(topology, layout):
    topology()
    theirs, ours = pool_pair(AsymmetricMHATokenToKVPoolHost, layout, 24, 16)
    tokens = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (1, 6)])
    assert meta_bytes(ours.get_page_buffer_meta(tokens)) == meta_bytes(theirs.get_page_buffer_meta(tokens))
    assert ours.is_stride_page_aligned(64) == theirs.is_stride_page_aligned(64)
    assert ours.get_size_per_token() == theirs.get_size_per_token() and ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    ours.destroy()


@pytest.mark.parametrize("layout", SYMMETRIC_LAYOUTS)
def test_hicache_file_pages_put_by_sglang_are_read_by_portable_kv(topology, tmp_path, layout):
    """SGLang's pool puts pages in its file L3 tier; the controller's page get reads them into a portable_kv pool, and back."""
    topology()
    theirs, ours = pool_pair(MHATokenToKVPoolHost, layout, 16, 16)
    ours.k_buffer.zero_()
    ours.v_buffer.zero_()
    dev, allocator = device_pool(16, 16)
    controller = HiCacheController(
        allocator, ours, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend="kernel",
        write_policy="write_through", storage_backend="file", storage_backend_extra_config={"file_storage_path": str(tmp_path)},
    )
    try:
        keys = [f"page-{n}" for n in range(3)]
        their_slots = torch.arange(4 * PAGE, 7 * PAGE)
        assert controller.storage_backend.batch_set(keys, [theirs.get_data_page(int(their_slots[n * PAGE])) for n in range(3)])
        our_slots = ours.alloc(3 * PAGE)
        assert controller.page_get_func(PrefetchOperation("request", list(range(3 * PAGE))), keys, our_slots) == 3
        for n in range(3):
            assert torch.equal(ours.get_data_page(our_slots[n * PAGE]).view(torch.int16), theirs.get_data_page(int(their_slots[n * PAGE])).view(torch.int16))
        # ... and pages portable_kv puts through the controller read back in SGLang's pool.
        back = [f"back-{n}" for n in range(3)]
        assert controller.page_set_func(back, our_slots)
        for n, key in enumerate(back):
            page = controller.storage_backend.get(key, theirs.get_dummy_flat_data_page())
            theirs.set_from_flat_data_page(n * PAGE, page)
            assert torch.equal(theirs.get_data_page(n * PAGE).view(torch.int16), ours.get_data_page(our_slots[n * PAGE]).view(torch.int16))
    finally:
        controller.detach_storage_backend()
        ours.destroy()
