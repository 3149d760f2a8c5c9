"""What MLA pools add to the contract (docs/API.md, "MLA pools"): the device pool, the host
pool's shapes and SGLang attributes, the layouts it refuses, duck-typed engine pools, and
fp8 caches stored as bytes.  Transfers, pages and validation run in the rest of the suite
over both pool kinds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvspec import bits, page_tokens, randomize, sglang_host_pool

import portable_kv as pk

P, L = 4, 3
# Beside bf16 and fp16 (the rest of the suite): fp32, and fp8 stored as bytes, as SGLang keeps it.
WIDTHS = [torch.float32, torch.uint8] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def test_the_device_pool_is_sglangs_shape(backend):
    dev = pk.MLADevicePool(L, 32, P, 576, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    assert [tuple(t.shape) for t in dev.kv_buffer] == [(32, 1, 576)] * L
    assert (dev.layer_num, dev.size, dev.page_size, dev.dtype, dev.device) == (L, 32, P, torch.bfloat16, backend.device)
    assert (dev.kv_cache_dim, dev.kv_lora_rank, dev.qk_rope_head_dim) == (576, 512, 64)
    assert pk.MLADevicePool(1, 8, P, 40).kv_lora_rank == 40, "without a split the row is all latent"
    wrapped = pk.MLADevicePool.from_buffers(dev.kv_buffer, P, kv_lora_rank=512, qk_rope_head_dim=64)
    assert all(a is b for a, b in zip(wrapped.kv_buffer, dev.kv_buffer)) and wrapped.kv_cache_dim == 576


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_cache_dim=0), ValueError, "kv_cache_dim: expected a positive int"),
    (dict(qk_rope_head_dim=40), ValueError, r"qk_rope_head_dim: expected an int in \[0, 40\)"),
    (dict(kv_lora_rank=36, qk_rope_head_dim=8), ValueError, "kv_lora_rank: expected kv_lora_rank \\+ qk_rope_head_dim <= kv_cache_dim 40"),
    (dict(num_tokens=30), ValueError, "num_tokens: expected a multiple of page_size=4"),
    (dict(dtype=torch.complex64), TypeError, "dtype: .*complex"),
], ids=["dim", "rope", "rank", "tokens", "complex"])
def test_device_pool_arguments_are_checked_and_named(backend, kwargs, error, match):
    args = dict(num_layers=1, num_tokens=32, page_size=P, kv_cache_dim=40, dtype=torch.bfloat16) | kwargs
    with pytest.raises(error, match=match):
        pk.MLADevicePool(**args)


@pytest.mark.parametrize("layout, shape", [
    ("layer_first", (L, 72, 1, 40)), ("page_first", (72, L, 1, 40)), ("page_first_direct", (18, L, P, 1, 40)),
])
def test_host_buffer_shapes_and_sglang_attributes(backend, layout, shape):
    """SGLang 0.5.23's MLATokenToKVPoolHost: kv_buffer per layout, the row's geometry, sizes over all layers."""
    dev = pk.MLADevicePool(L, 32, P, 40, torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8)
    with sglang_host_pool(dev, host_to_device_ratio=2.2, layout=layout) as host:
        assert tuple(host.kv_buffer.shape) == shape and host.kv_buffer.dtype == torch.bfloat16
        assert (host.size, host.page_num, host.page_size, host.layer_num) == (72, 18, P, L)
        assert (host.kv_cache_dim, host.kv_lora_rank, host.qk_rope_head_dim) == (40, 32, 8)
        assert host.token_stride_size == 80 and host.layout_dim == 80 * L
        assert host.get_size_per_token() == host.get_ksize_per_token() == host.size_per_token == 80 * L
        assert host.flat_page_numel == host.get_dummy_flat_data_page().numel() == L * P * 40
        assert (host.start_layer, host.end_layer, host.io_backend) == (0, L, "direct")
        assert host.buffers == (host.kv_buffer,) and host.get_hybrid_pool_buffer() == [host.kv_buffer]
        assert host.get_data_page(P, flat=False).data_ptr() == host.get_page_buffer_meta(list(range(P, 2 * P)))[0][0]
    assert host.kv_buffer is None and host.buffers == ()


def test_page_head_is_refused_naming_the_layout(backend):
    dev = pk.MLADevicePool(1, 32, P, 40)
    with pytest.raises(ValueError, match="layout: 'page_head' .* MLA .* layer_first, page_first, page_first_direct"):
        pk.MLAHostPool(dev, layout="page_head")
    with pytest.raises(ValueError, match="layout: expected one of layer_first, page_first, page_first_direct, got 'page_tail'"):
        pk.MLAHostPool(dev, layout="page_tail")


def test_an_engines_own_pool_is_taken_as_it_is(backend, gen):
    """Any object with a `kv_buffer` list (SGLang's MLATokenToKVPool: size + page_size rows,
    kv_lora_rank and qk_rope_head_dim) is an MLA device pool."""
    rows = [torch.zeros(36, 1, 40, dtype=torch.bfloat16, device=backend.device) for _ in range(L)]
    engine = SimpleNamespace(kv_buffer=rows, page_size=P, kv_lora_rank=32, qk_rope_head_dim=8)
    host = pk.MLAHostPool(engine, layout="page_first")
    assert (host.kv_lora_rank, host.qk_rope_head_dim, host.size) == (32, 8, 72)
    for t in rows:
        randomize(t, gen)
    host.backup_from_device_all_layer(engine, torch.arange(8), torch.arange(8, 16).to(backend.device))
    host.load_to_device_per_layer(engine, torch.arange(8), torch.arange(28, 36).to(backend.device), 2)
    backend.synchronize()
    assert torch.equal(bits(rows[2][28:36]), bits(rows[2][8:16]))
    with pytest.raises(ValueError, match=r"device_pool.kv_buffer: expected \(tokens, 1, kv_cache_dim\)"):
        pk.MLAHostPool(SimpleNamespace(kv_buffer=[torch.zeros(36, 2, 20, device=backend.device)], page_size=P))
    with pytest.raises(TypeError, match="device_pool: expected kv_buffer, a list of per-layer tensors"):
        pk.MLAHostPool(pk.DeviceKVPool(1, 32, P, 1, 8, 8))
    with pytest.raises(TypeError, match="device_pool: expected k_buffer and v_buffer"):
        pk.AsymmetricHostPool(engine)
    with pytest.raises(ValueError, match=r"qk_rope_head_dim: expected an int in \[0, 40\)"):
        pk.MLAHostPool(SimpleNamespace(kv_buffer=rows, page_size=P, qk_rope_head_dim=64))


@pytest.mark.parametrize("dtype", WIDTHS, ids=str)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_fp32_and_fp8_caches_roundtrip(backend, layout, dtype, gen):
    """fp32 rows, and fp8 as SGLang keeps it: uint8 elements (a DSA row packs its scales: 656 of them)."""
    dev = pk.MLADevicePool(L, 32, P, 656, dtype, kv_lora_rank=512, qk_rope_head_dim=64)
    host = sglang_host_pool(dev, layout=layout, io_backend=backend.io_backends[0])
    for t in dev.kv_buffer:
        randomize(t, gen)
    src, slots, dst = page_tokens(torch.tensor([1, 6]), P), page_tokens(torch.tensor([9, 2]), P), page_tokens(torch.tensor([0, 7]), P)
    expected = [bits(t[src]) for t in dev.kv_buffer]
    host.backup_from_device_all_layer(dev, slots, src.to(dev.device))
    host.load_to_device_all_layer(dev, slots, dst.to(dev.device))
    backend.synchronize()
    assert all(torch.equal(bits(t[dst]), want) for t, want in zip(dev.kv_buffer, expected))
    assert host.token_stride_size == 656 * dtype.itemsize and host.get_data_page(9 * P).dtype == dtype
