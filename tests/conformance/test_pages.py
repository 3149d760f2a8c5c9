"""Pages for storage tiers (docs/API.md): SGLang's byte order, views and page addresses, per pool kind and layout."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from kvspec import (
    LATENT_DIM,
    assert_same,
    bits,
    device_pool,
    host_buffers,
    host_row,
    kind_of,
    pool_layout_pairs,
    randomize,
    sglang_host_pool,
    snapshot,
)

P, L, K_HEADS, K_DIM, V_HEADS, V_DIM = 4, 3, 2, 24, 2, 16
PAGE_MAJOR = ("page_first", "page_first_direct", "page_head")
# (heads, head_dim) of each buffer of a page: K and V, or MLA's latent.
ROWS = {"MHA": ((K_HEADS, K_DIM), (V_HEADS, V_DIM)), "MLA": ((1, LATENT_DIM),)}
# A buffer's block of a flat page, as SGLang's host pools order it (MLA's the same, with one head): axes by name.
FLAT_ORDER = {
    "layer_first": "lphd",
    "page_first": "plhd",
    "page_first_direct": "lphd",
    "page_head": "hpld",
}


@pytest.fixture(params=pool_layout_pairs())
def pools(request, backend, gen):
    kind, layout = request.param
    dev = device_pool(kind, L, 64, P, torch.bfloat16, k_heads=K_HEADS, k_dim=K_DIM, v_heads=V_HEADS, v_dim=V_DIM)
    host = sglang_host_pool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=backend.io_backends[0])
    for t in host_buffers(host):
        randomize(t, gen)
    yield dev, host
    host.close()


def expected_block(buffer, layout, first):
    """One page's K (or V) block in the layout's flat order, built row by row from docs/API.md's shape table."""
    rows = torch.stack([torch.stack([host_row(buffer, layout, P, first + p, layer) for layer in range(L)]) for p in range(P)])
    return torch.einsum(f"plhd->{FLAT_ORDER[layout]}", rows).reshape(-1)  # rows: (page token, layer, head, dim)


def raw(ptr, nbytes):
    return ctypes.string_at(ptr, nbytes)


def test_flat_page_is_k_then_v_in_the_layouts_order(pools):
    _, host = pools
    flat = host.get_data_page(3 * P)
    expected = torch.cat([expected_block(buffer, host.layout, 3 * P) for buffer in host_buffers(host)])
    assert torch.equal(bits(flat), bits(expected))
    assert flat.numel() == host.flat_page_numel == host.get_dummy_flat_data_page().numel()


def test_set_from_flat_writes_one_page_only(pools):
    _, host = pools
    flat = host.get_data_page(3 * P)
    others = [bits(host.get_data_page(i * P)) for i in range(host.page_num) if i != 10]
    host.set_from_flat_data_page(10 * P, flat)
    assert torch.equal(bits(host.get_data_page(10 * P)), bits(flat))
    assert all(torch.equal(a, bits(host.get_data_page(i * P))) for a, i in zip(others, [i for i in range(host.page_num) if i != 10]))


def test_flat_false_gives_views_into_the_pool(pools):
    """(k, v) views of an MHA pool, the one latent view of an MLA pool, as SGLang's pools give them."""
    _, host = pools
    views = host.get_data_page(2 * P, flat=False)
    views = views if kind_of(host) == "MHA" else (views,)
    shape = {
        "layer_first": (L, P), "page_first": (P, L), "page_first_direct": (1, L, P), "page_head": (1, K_HEADS, P),
    }[host.layout]
    assert len(views) == len(ROWS[kind_of(host)]) and all(tuple(v.shape[: len(shape)]) == shape for v in views)
    for n, view in enumerate(views):
        view.fill_(1.5 - 3.5 * n)  # a storage tier reading a page writes straight into the pool
    flat, start = host.get_data_page(2 * P), 0
    for n, (heads, dim) in enumerate(ROWS[kind_of(host)]):
        assert bool((flat[start : start + L * P * heads * dim] == 1.5 - 3.5 * n).all())
        start += L * P * heads * dim
    assert start == flat.numel()


@pytest.mark.parametrize("as_", ["tensor", "list"])
def test_page_buffer_meta_takes_every_token_of_the_pages(pools, as_):
    _, host = pools
    pages = [5, 0, 9]
    tokens = [p * P + t for p in pages for t in range(P)]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(tokens) if as_ == "tensor" else tokens)
    buffers = len(ROWS[kind_of(host)])
    per_page = buffers if host.layout in PAGE_MAJOR else buffers * L
    assert len(ptrs) == len(sizes) == per_page * len(pages)
    for n, page in enumerate(pages):
        views = host.get_data_page(page * P, flat=False)
        views = views if buffers > 1 else (views,)
        if host.layout in PAGE_MAJOR:
            blocks = list(views)  # [k, v] (MLA: [kv]) per page, each the page's contiguous block
        else:
            blocks = [view[layer] for layer in range(L) for view in views]  # per page, per layer [k, v] (MLA: [kv])
        for j, block in enumerate(blocks):
            assert block.is_contiguous()
            i = n * per_page + j
            assert sizes[i] == block.numel() * block.element_size()
            assert raw(ptrs[i], sizes[i]) == block.view(torch.uint8).numpy().tobytes()


def test_page_buffer_meta_checks_whole_pages(pools):
    dev, host = pools
    before = snapshot(dev, host)
    with pytest.raises(ValueError, match="multiple of 4"):
        host.get_page_buffer_meta(torch.arange(P + 1))
    with pytest.raises(ValueError, match="one whole page"):
        host.get_page_buffer_meta(torch.arange(1, P + 1))
    with pytest.raises(ValueError, match="one whole page"):
        host.get_page_buffer_meta([0, 1, 3, 2])
    with pytest.raises(ValueError, match=r"in \[0, "):
        host.get_page_buffer_meta(torch.arange(host.size, host.size + P))
    with pytest.raises(TypeError, match="integer"):
        host.get_page_buffer_meta(torch.arange(P, dtype=torch.float32))
    with pytest.raises(TypeError, match="integer"):
        host.get_page_buffer_meta([0.0, 1, 2, 3])
    assert_same(before, snapshot(dev, host))
    assert host.get_page_buffer_meta([]) == ([], [])


@pytest.mark.parametrize("index", [8, np.int64(8), torch.tensor(8), torch.tensor(8, dtype=torch.int32)])
def test_page_index_kinds(pools, index):
    _, host = pools
    assert torch.equal(bits(host.get_data_page(index)), bits(host.get_data_page(2 * P)))


@pytest.mark.parametrize("index", [8.0, True, torch.tensor(8.0), torch.tensor([8]), "8", None])
def test_page_index_rejects_non_integers(pools, index):
    dev, host = pools
    before = snapshot(dev, host)
    with pytest.raises(TypeError, match="index"):
        host.get_data_page(index)
    with pytest.raises(TypeError, match="index"):
        host.set_from_flat_data_page(index, host.get_dummy_flat_data_page())
    assert_same(before, snapshot(dev, host))


def test_split_heads_meta_on_page_head(pools):
    _, host = pools
    if host.layout != "page_head":
        with pytest.raises(ValueError, match="page_head"):
            host.get_split_heads_page_buffer_meta(list(range(P)), 2)
        return
    ptrs, sizes = host.get_split_heads_page_buffer_meta(torch.arange(3 * P, 4 * P), 2)
    k, v = host.get_data_page(3 * P, flat=False)
    assert len(ptrs) == 4
    for group in range(2):
        for j, block in enumerate((k[0, group], v[0, group])):
            i = 2 * group + j
            assert sizes[i] == block.numel() * block.element_size()
            assert raw(ptrs[i], sizes[i]) == block.contiguous().view(torch.uint8).numpy().tobytes()
    assert host.get_page_buffer_element_size(2) == sizes[0]
    with pytest.raises(ValueError, match="split_factor"):
        host.get_split_heads_page_buffer_meta(list(range(P)), 3)


def test_sizes_and_buffers(pools):
    """SGLang's sizes: K per token and K+V per token over all layers; an MLA pool's are both its latent row's."""
    _, host = pools
    itemsize = host.dtype.itemsize
    rows = ROWS[kind_of(host)]
    assert host.get_ksize_per_token() == L * rows[0][0] * rows[0][1] * itemsize
    assert host.get_size_per_token() == host.size_per_token == L * sum(h * d for h, d in rows) * itemsize
    page_k = P * rows[0][0] * rows[0][1] * itemsize
    assert host.get_page_buffer_element_size() == (L * page_k if host.layout in PAGE_MAJOR else page_k)
    if kind_of(host) == "MHA":
        assert host.kv_buffer == (host.k_buffer, host.v_buffer)
    assert host.get_hybrid_pool_buffer() == host_buffers(host)
    assert host.storage_format_tag is None and host.dcp_size == 1
    assert host.logical_size == host.size and host.logical_page_size == P
    assert (host.start_layer, host.end_layer) == (0, L)


def test_stride_alignment(pools):
    _, host = pools
    # One K page is L*P*H*D*2 = 576 bytes, one V page 384, one latent page 960: multiples of 64, not of 4096.
    aligned = all(b.data_ptr() % 64 == 0 for b in host_buffers(host))
    assert host.is_stride_page_aligned(64) == (host.layout in PAGE_MAJOR and aligned)
    assert not host.is_stride_page_aligned(4096)


def test_closed_pool(pools):
    _, host = pools
    host.destroy()
    assert host.kv_buffer is None and host.buffers == ()
    with pytest.raises(ValueError, match="closed"):
        host.get_page_buffer_meta(list(range(P)))
    for call in (lambda: host.alloc(P), lambda: host.free(torch.arange(P)), host.available_size, host.clear):
        with pytest.raises(ValueError, match="closed"):
            call()
    host.destroy()


@pytest.mark.parametrize("call, name", [
    (lambda host, dev: host.get_page_buffer_meta(None), "indices"),
    (lambda host, dev: host.is_stride_page_aligned(0), "page_size_bytes"),
    (lambda host, dev: host.load_to_device_all_layer(dev, torch.arange(P), torch.arange(P).to(dev.device), io_backend=["kernel"]), "io_backend"),
    (lambda host, dev: host.load_to_device_all_layer(dev, torch.arange(P, device="meta"), torch.arange(P)), "host_indices"),
    (lambda host, dev: host.get_split_heads_page_buffer_meta(list(range(P)), 0), "split_factor|page_head"),
], ids=["meta-none", "alignment-0", "io-list", "meta-indices", "split-0"])
def test_odd_arguments_are_refused_naming_them(pools, call, name):
    dev, host = pools
    with pytest.raises((TypeError, ValueError), match=name):
        call(host, dev)
