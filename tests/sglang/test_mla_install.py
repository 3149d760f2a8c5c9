"""install() and SGLang's MLA host-pool name: what is served, what is refused and why, what stays SGLang's own."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from mlakit import KV_CACHE_DIM, KV_LORA_RANK, LAYERS, PAGE, QK_ROPE_HEAD_DIM, device_pool, plain_controller, same, write_free_load
from sglangkit import SKIP_REASON, record_io_paths

pytest.importorskip("sglang.srt.mem_cache.pool_host.mla", reason=SKIP_REASON)
import msgspec  # noqa: E402  (one of SGLang's dependencies)
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost  # noqa: E402

import portable_kv.engines.sglang as pk_sglang  # noqa: E402
from portable_kv.engines.sglang.mla import SGLangMLAHostPool  # noqa: E402


def target_info(dev):
    return dev.get_device_pool_infos()[0].buffer_info


def sglang_arguments(dev, **overrides) -> dict:
    """The keyword arguments SGLang's assembler passes an MLA host pool (`build_kv_host_pool`), with overrides."""
    return dict(override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                end_layer=dev.end_layer, draft_buffer_infos=(), layer_shard_enabled=False, target_layer_num=dev.layer_num) | overrides


def test_install_binds_the_assemblers_mla_name_and_uninstall_gives_sglangs_class_back():
    original = hybrid_pool_assembler.MLATokenToKVPoolHost
    assert original is MLATokenToKVPoolHost
    pk_sglang.install()
    try:
        pk_sglang.install()  # idempotent
        assert hybrid_pool_assembler.MLATokenToKVPoolHost is not original
        assert hybrid_pool_assembler.MLATokenToKVPoolHost.sglang_class is original
        assert pk_sglang.SGLangMLAHostPool is SGLangMLAHostPool
    finally:
        pk_sglang.uninstall()
    assert hybrid_pool_assembler.MLATokenToKVPoolHost is original


def test_uninstalled_sglang_builds_its_own_mla_pool(topology, monkeypatch):
    from sglang.srt.mem_cache.pool_host import common

    # SGLang pins its pool by registering it with the CUDA driver, which a CPU run lacks.
    monkeypatch.setattr(common, "_cuda_host_register", lambda buffer, registration_granularity_bytes=None: None)
    topology(hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, _ = device_pool(torch.bfloat16)
    assert type(build_kv_host_pool(kv_pool=dev, page_size=PAGE)) is MLATokenToKVPoolHost


@pytest.mark.parametrize(("layout", "overrides", "reason"), [
    ("page_first", dict(dcp_size=2, dcp_rank=1), "dcp_size: decode context parallelism (dcp_size=2)"),
    ("page_first", dict(layer_shard_enabled=True), "layer_shard_enabled: a layer-sharded device pool"),
    ("page_unified", {}, "layout: 'page_unified' is SGLang's own"),
    ("page_first_kv_split", {}, "layout: 'page_first_kv_split' is SGLang's own"),
])
def test_what_portable_kv_does_not_hold_is_refused_by_name_and_left_to_sglang_when_installed(topology, installed, caplog, layout, overrides, reason):
    topology()
    dev, _ = device_pool(torch.bfloat16)
    arguments = sglang_arguments(dev, **overrides)
    with pytest.raises(NotImplementedError, match=f"^{re.escape(reason)}"):
        SGLangMLAHostPool(target_info(dev), 2.0, 0, PAGE, layout, **arguments)
    if layout == "page_first_kv_split":
        return  # SGLang's own pool builds that layout on Ascend NPUs only
    caplog.set_level(logging.INFO, logger="portable_kv")
    host = hybrid_pool_assembler.MLATokenToKVPoolHost(target_info(dev), 2.0, 0, PAGE, layout, pin_memory=False, **arguments)
    assert type(host) is MLATokenToKVPoolHost
    assert any(r.getMessage().startswith(f"portable_kv: SGLang's own MLA host pool ({reason}") for r in caplog.records)
    host.destroy()


def test_an_allocator_only_mla_geometry_and_fp4_scales_are_refused_by_name(topology):
    topology()
    dev, _ = device_pool(torch.bfloat16)
    geometry = MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, kv_cache_dim=KV_CACHE_DIM,
                                 size_per_token=LAYERS * KV_CACHE_DIM * 2)
    with pytest.raises(NotImplementedError, match="^buffer_info: an allocator-only MLAHostAllocation"):
        SGLangMLAHostPool(geometry, 2.0, 0, PAGE, "page_first", **sglang_arguments(dev))
    scaled = msgspec.structs.replace(target_info(dev), scales=tuple(torch.zeros(dev.size, 1) for _ in range(LAYERS)))
    with pytest.raises(NotImplementedError, match="^buffer_info: FP4 KV with separate block scales"):
        SGLangMLAHostPool(scaled, 2.0, 0, PAGE, "page_first", **sglang_arguments(dev))
    with pytest.raises(NotImplementedError, match=r"^buffer_info: expected SGLang's MLABufferInfo, got MHABufferInfo"):
        from sglangkit import device_pool as mha_device_pool

        mha = mha_device_pool(16, 16)[0]
        SGLangMLAHostPool(mha.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first", **sglang_arguments(dev))
    with pytest.raises(NotImplementedError, match="SGLangMLAHostPool"):
        pk_sglang.SGLangHostPool(target_info(dev), 2.0, 0, PAGE, "page_first", device_capacity_tokens=dev.size)


@pytest.mark.parametrize(("layout", "overrides", "error", "message"), [
    ("page_head", {}, ValueError, r"^layout: 'page_head' orders a page by head"),
    ("page_first", dict(override_kv_cache_dim=KV_CACHE_DIM + 8), ValueError, rf"^override_kv_cache_dim: expected the device rows' width {KV_CACHE_DIM}, got {KV_CACHE_DIM + 8}"),
    ("page_first", dict(target_layer_num=LAYERS - 1), ValueError, rf"^target_layer_num: expected the device pool's {LAYERS} layers, got {LAYERS - 1}"),
    ("page_first", dict(host_token_capacity=PAGE + 1), ValueError, r"^host_token_capacity: expected a positive multiple of page_size=4"),
    ("page_first", dict(start_layer=0.5), TypeError, r"^start_layer: expected an int"),
])
def test_arguments_unlike_sglangs_own_are_named(topology, layout, overrides, error, message):
    topology()
    dev, _ = device_pool(torch.bfloat16)
    with pytest.raises(error, match=message):
        SGLangMLAHostPool(target_info(dev), 2.0, 0, PAGE, layout, **sglang_arguments(dev, **overrides))


def test_sglangs_call_shapes_are_accepted_and_sized_as_sglang_sizes_them(topology):
    topology()
    dev, _ = device_pool(torch.bfloat16)
    info = target_info(dev)
    # The assembler's draft sidecar call: everything by keyword, an exact token capacity.
    sidecar = SGLangMLAHostPool(info, host_to_device_ratio=1.0, host_size=0, page_size=PAGE, layout="page_first_direct", allocator_type="default",
                                pool_label="draft", host_token_capacity=10 * PAGE, device_capacity_tokens=dev.size, start_layer=0,
                                end_layer=LAYERS, target_layer_num=LAYERS, override_kv_cache_dim=KV_CACHE_DIM)
    assert (sidecar.size, sidecar.page_num, sidecar.pool_label) == (10 * PAGE, 10, "draft")
    # HiSparse's call: layer_first, the device pool's own page size; and host_size in GB.
    by_size = SGLangMLAHostPool(info, 0, 1e-4, PAGE, "layer_first", device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1,
                                target_layer_num=LAYERS)
    assert by_size.size == (int(1e-4 * 1e9 // (LAYERS * KV_CACHE_DIM * 2)) // PAGE + 1) * PAGE
    assert (by_size.start_layer, by_size.end_layer, by_size.override_kv_cache_dim) == (0, LAYERS - 1, None)
    for pool in (sidecar, by_size):
        pool.destroy()


@pytest.mark.parametrize(("setting", "sglang_io", "path"), [("staged", "kernel", "staged"), ("kernel=auto,direct=staged", "direct", "staged")])
def test_the_sglang_io_setting_maps_an_mla_pools_io_as_an_mha_pools(topology, installed, monkeypatch, setting, sglang_io, path):
    monkeypatch.setenv("PORTABLE_KV_SGLANG_IO", setting)
    layout = "page_first_direct" if sglang_io == "direct" else "page_first"
    topology(hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=sglang_io)
    dev, allocator = device_pool(torch.bfloat16)
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    used = record_io_paths(host)
    controller = plain_controller(allocator, host, sglang_io)
    write_free_load(controller, dev, allocator, allocator.alloc(2 * PAGE), torch.Generator().manual_seed(3))
    assert used and set(used) == {path}
    host.destroy()


def test_page_interleave_wraps_the_pool_as_sglangs_own(topology):
    """--enable-kv-cache-sharding: SGLang's assembler wraps whichever MLA host pool it built in a
    PageInterleaveHostPool, which owns the slots and hands this rank's local rows to the pool."""
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    topology()
    dev, _ = device_pool(torch.bfloat16)
    host = SGLangMLAHostPool(target_info(dev), 2.0, 0, PAGE, "page_first", **sglang_arguments(dev))
    placement = PageInterleavePlacement(PageShardSpec(shard_rank=0, shard_size=2, page_size=PAGE, max_prefix_tokens=PAGE, chunk_tokens=PAGE))
    sharded = PageInterleaveHostPool(host, placement)
    assert sharded.logical_size == 2 * host.size and sharded.kv_buffer is host.kv_buffer
    free = sharded.available_size()
    logical = sharded.alloc(4 * PAGE, start_owner=0)  # pages owned by ranks 0, 1, 0, 1
    device_logical = torch.arange(4 * PAGE, 8 * PAGE)  # device pages of the same owners
    rows, device_rows = sharded.owned_rows(logical, device_logical)
    assert len(rows) == len(device_rows) == 2 * PAGE  # this rank's two pages, as local rows
    sharded.backup_from_device_all_layer(dev, rows, device_rows, "kernel")
    targets = torch.arange(12 * PAGE, 14 * PAGE)
    for layer in range(LAYERS):
        sharded.load_to_device_per_layer(dev, rows, targets, layer, "kernel")
        assert same(dev.kv_buffer[layer][targets], dev.kv_buffer[layer][device_rows])
    assert sharded.free(logical) == 4 * PAGE and sharded.available_size() == free
    host.destroy()
