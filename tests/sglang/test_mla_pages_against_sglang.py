"""MLAHostPool against SGLang's own MLATokenToKVPoolHost holding the same data: buffer shapes,
flat pages, views, dummy pages, page addresses and sizes, layout by layout, over SGLang's own
device pool (taken as it is: a `kv_buffer` list)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from sglangkit import DEVICE_TOKENS, LAYERS, PAGE, SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.pool_host.mla", reason=SKIP_REASON)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

import portable_kv as pk  # noqa: E402
from portable_kv.engines.sglang.surface import with_sglang_names  # noqa: E402

MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 32, 8


def pool_pair(layout: str, dtype: torch.dtype):
    """SGLang's MLA host pool and a portable_kv one of the same size over SGLang's device pool, holding the same random bytes."""
    dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, KV_LORA_RANK, QK_ROPE_HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    info = dev.get_device_pool_infos()[0].buffer_info
    theirs = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device_capacity_tokens=dev.size,
                                  start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    # SGLang's device buffers hold a padding page; half a token under SGLang's size rounds up to it.
    ours = with_sglang_names(pk.MLAHostPool)(dev, host_to_device_ratio=(theirs.size - 0.5) / dev.kv_buffer[0].shape[0], layout=layout)
    assert (ours.size, ours.page_num, ours.layer_num) == (theirs.size, theirs.page_num, theirs.layer_num)
    assert ours.kv_buffer.shape == theirs.kv_buffer.shape and ours.dtype == theirs.dtype
    generator = torch.Generator().manual_seed(13)
    theirs.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, theirs.kv_buffer.view(torch.uint8).shape, generator=generator, dtype=torch.uint8))
    ours.kv_buffer.copy_(theirs.kv_buffer)
    return theirs, ours


def meta_bytes(meta):
    ptrs, sizes = meta
    return [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes)], sizes


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_pages_and_meta_match_sglangs_mla_pool(topology, layout, dtype):
    topology()
    theirs, ours = pool_pair(layout, dtype)
    for first in range(0, ours.size, PAGE):
        assert same(ours.get_data_page(first), theirs.get_data_page(first)), f"page at {first}"
        assert same(ours.get_data_page(first, flat=False), theirs.get_data_page(first, flat=False))
    tokens = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (3, 0, 7)])
    assert meta_bytes(ours.get_page_buffer_meta(tokens)) == meta_bytes(theirs.get_page_buffer_meta(tokens))
    assert ours.get_page_buffer_element_size() == theirs.get_page_buffer_element_size()
    assert ours.get_dummy_flat_data_page().shape == theirs.get_dummy_flat_data_page().shape
    assert ours.is_stride_page_aligned(64) == theirs.is_stride_page_aligned(64)
    # A page SGLang flattened, written back by portable_kv, lands where SGLang's own write puts it.
    page = theirs.get_data_page(5 * PAGE)
    ours.set_from_flat_data_page(2 * PAGE, page)
    theirs.set_from_flat_data_page(2 * PAGE, page)
    assert same(ours.kv_buffer, theirs.kv_buffer)
    for name in ("kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "token_stride_size", "layout_dim", "size_per_token",
                 "logical_size", "logical_page_size", "dcp_size", "start_layer", "end_layer", "storage_format_tag"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.get_size_per_token() == theirs.get_size_per_token() and ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    ours.destroy()


def test_page_head_is_refused_as_sglang_refuses_it(topology):
    topology()
    dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, KV_LORA_RANK, QK_ROPE_HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    with pytest.raises(ValueError, match="page_head"):
        MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_head", pin_memory=False,
                             device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    with pytest.raises(ValueError, match="layout: 'page_head'"):
        pk.MLAHostPool(dev, layout="page_head")
