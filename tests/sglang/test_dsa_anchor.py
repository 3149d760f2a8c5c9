"""DSA (DeepSeek-V3.2's sparse attention): install() serves its latent pool, the root of SGLang's DSA host
pool group, and its indexer pool (SGLangDSAIndexerHostPool), anchored on portable_kv's latent pool (it
takes its layout, page size and slots).  One write and load through SGLang's HybridCacheController, the
group built as SGLang's DSA strategy builds it, moves both, bit for bit, in bf16 and in fp8's packed rows;
the indexer pool matches SGLang's own DSAIndexerPoolHost byte for byte on the same device rows, with a
packed NextN draft and shared-top-k layers (no index keys) among the target's."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from mlakit import MLA_CASES, CpuMlaKvcacheio, fill, same, wait
from sglangkit import SKIP_REASON

import portable_kv.engines.sglang as pk_sglang

pytest.importorskip("sglang.srt.mem_cache.pool_host.dsa", reason=SKIP_REASON)
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_host_pool_group, prepare_host_pool_config  # noqa: E402
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from portable_kv.engines.sglang.dsa import SGLangDSAIndexerHostPool  # noqa: E402
from portable_kv.engines.sglang.mla import SGLangMLAHostPool  # noqa: E402

PAGE = 64  # DSA's indexer keeps 64-token pages
TOKENS, LAYERS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, INDEX_HEAD_DIM = 512, 2, 32, 16, 128
# fp8 DSA packs the latent, its scales and the bf16 rope into one wider uint8 row.
ROWS = {"bf16": (torch.bfloat16, KV_LORA_RANK + QK_ROPE_HEAD_DIM), "fp8": (torch.float8_e4m3fn, 56)}


@pytest.fixture
def dsa_topology(request):
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def publish_args(layout: str, io: str):
        reset_context()
        publish(ServerArgs(model_path="dummy", page_size=PAGE, hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=io,
                           hicache_write_policy="write_through"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))

    yield publish_args
    reset_context()


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(("io", "layout"), MLA_CASES)
def test_the_latent_pool_is_portable_kvs_and_sglangs_indexer_pool_moves_with_it(dsa_topology, installed, monkeypatch, io, layout, row):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host import common

    # SGLang pins its indexer pool by registering it with the CUDA driver, which a CPU run lacks.
    monkeypatch.setattr(common, "_cuda_host_register", lambda buffer, registration_granularity_bytes=None: None)
    dsa_topology(layout, io)
    dtype, width = ROWS[row]
    dev = DSATokenToKVPool(TOKENS, PAGE, KV_LORA_RANK, dtype, QK_ROPE_HEAD_DIM, LAYERS, "cpu", INDEX_HEAD_DIM, False, width, start_layer=0, end_layer=LAYERS)
    allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE, dtype, "cpu", dev, need_sort=False)
    # The DSA strategy's group: the latent pool as the root, the indexer pool anchored on it.
    config = prepare_host_pool_config(decls=dev.host_pool_decls(), full_layer_mapping={i: i for i in range(LAYERS)}, transfer_layer_id_max=LAYERS,
                                      transfer_page_size=PAGE, packed_draft_device_pools=())
    group = build_host_pool_group(config=config)
    root, indexer = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert type(root) is SGLangMLAHostPool and isinstance(root, MLATokenToKVPoolHost)
    assert type(indexer) is SGLangDSAIndexerHostPool and isinstance(indexer, DSAIndexerPoolHost)
    assert (root.kv_cache_dim, root.dtype, root.dsa_kv_cache_store_fp8) == (width, dev.store_dtype, row == "fp8")
    assert (indexer.layout, indexer.page_size, indexer.size, indexer.page_num) == (root.layout, root.page_size, root.size, root.page_num)

    with contextlib.ExitStack() as stack:
        # The indexer pool's copies are SGLang's; layer_first addresses its host layers by pointer.
        CpuMlaKvcacheio(*dev.index_k_with_scale_buffer, *getattr(indexer, "index_k_data_refs", ())).bind(stack, "dsa")
        controller = HybridCacheController(allocator, group, PAGE, None, load_cache_event=threading.Event(), write_policy="write_through",
                                           io_backend=io, transfer_layer_id_max=LAYERS)
        generator = torch.Generator().manual_seed(9)
        buffers = [*dev.kv_buffer, *dev.index_k_with_scale_buffer]
        for buffer in buffers:
            fill(buffer, generator)
        written = allocator.alloc(2 * PAGE)
        pages = written[::PAGE] // PAGE  # the indexer keeps one row per page
        latent, index = [b[written].clone() for b in dev.kv_buffer], [b[pages].clone() for b in dev.index_k_with_scale_buffer]
        host_indices = controller.write(written, extra_pools=[PoolTransfer(name=PoolName.INDEXER, device_indices=written, indices_from_pool=PoolName.KV)])
        wait(controller.ack_write_queue.pop())
        allocator.free(written)
        for buffer in buffers:
            fill(buffer, generator)
        loaded = controller.load(host_indices, extra_pools=[PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices, indices_from_pool=PoolName.KV)])
        controller.start_loading()
        wait(controller.ack_load_queue.pop())
    for layer in range(LAYERS):
        assert same(dev.kv_buffer[layer][loaded], latent[layer]), f"latent layer {layer}"
        assert same(dev.index_k_with_scale_buffer[layer][loaded[::PAGE] // PAGE], index[layer]), f"index layer {layer}"
    assert controller.evict_host(host_indices) == 2 * PAGE
    root.destroy()


def dsa_device_pool(dtype: torch.dtype, width: int, layers: int, skip: list | None = None, seed: int = 5):
    """SGLang's DSA device pool on the CPU, latent and index rows filled with random bytes."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    dev = DSATokenToKVPool(TOKENS, PAGE, KV_LORA_RANK, dtype, QK_ROPE_HEAD_DIM, layers, "cpu", INDEX_HEAD_DIM, False, width, start_layer=0,
                           end_layer=layers, skip_topk_layers=skip)
    generator = torch.Generator().manual_seed(seed)
    for buffer in [*dev.kv_buffer, *dev.index_k_with_scale_buffer]:
        if buffer.numel():
            fill(buffer, generator)
    return dev


def indexer_pool(dev, draft, *, portable: bool):
    """The indexer host pool SGLang's DSA strategy builds for `dev` with `draft` packed, portable_kv's or SGLang's own."""
    if portable:
        pk_sglang.install()
    try:
        config = prepare_host_pool_config(decls=dev.host_pool_decls(), full_layer_mapping={i: i for i in range(dev.layer_num)},
                                          transfer_layer_id_max=dev.layer_num, transfer_page_size=PAGE, packed_draft_device_pools=(draft,))
        group = build_host_pool_group(config=config)
    finally:
        if portable:
            pk_sglang.uninstall()
    return group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(("io", "layout"), [("kernel", "layer_first"), ("kernel", "page_first"), ("direct", "page_first_direct")])
def test_the_indexer_pool_matches_sglangs_byte_for_byte(dsa_topology, monkeypatch, io, layout, row):
    import ctypes

    from sglang.srt.mem_cache.pool_host import common

    monkeypatch.setattr(common, "_cuda_host_register", lambda buffer, registration_granularity_bytes=None: None)
    dsa_topology(layout, io)
    dtype, width = ROWS[row]
    dev, draft = dsa_device_pool(dtype, width, 3, skip=[False, True, False]), dsa_device_pool(dtype, width, 1, seed=6)
    with contextlib.ExitStack() as stack:
        ops = CpuMlaKvcacheio(*dev.kv_buffer, *draft.kv_buffer, *(b for b in (*dev.index_k_with_scale_buffer, *draft.index_k_with_scale_buffer) if b.numel()))
        ops.bind(stack, "dsa")
        ops.bind(stack, "mla")
        sglang_root, sglang = indexer_pool(dev, draft, portable=False)
        ops.register(*getattr(sglang, "index_k_data_refs", ()), *getattr(sglang_root, "data_refs", ()))
        _, mine = indexer_pool(dev, draft, portable=True)
        assert type(mine) is SGLangDSAIndexerHostPool and type(sglang) is DSAIndexerPoolHost
        for name in ("layout", "page_size", "size", "page_num", "layer_num", "target_layer_num", "indexer_page_stride_size", "indexer_layout_dim",
                     "indexer_page_num", "size_per_token", "dtype", "indexer_dtype", "start_layer", "end_layer", "can_use_write_back_jit"):
            assert getattr(mine, name) == getattr(sglang, name), name
        assert (mine.layer_num, mine.target_layer_num) == (3, 2), "the shared-top-k layer owns no host layer; the draft packs after"
        assert mine.index_k_with_scale_buffer.shape == sglang.index_k_with_scale_buffer.shape

        host, device = torch.arange(2 * PAGE, 4 * PAGE), torch.cat([torch.arange(5 * PAGE, 6 * PAGE), torch.arange(PAGE)])
        host_pages = [2, 3]
        for pool in (sglang, mine):
            pool.backup_from_device_all_layer(dev, host, device, io)
        if layout == "layer_first":
            assert same(mine.index_k_with_scale_buffer[:, host_pages], sglang.index_k_with_scale_buffer[:, host_pages])
        else:
            assert same(mine.index_k_with_scale_buffer[host_pages], sglang.index_k_with_scale_buffer[host_pages])
        for first in (2 * PAGE, 3 * PAGE):
            assert same(mine.get_data_page(first), sglang.get_data_page(first)), f"flat page at token {first}"
            assert same(mine.get_data_page(first, flat=False), sglang.get_data_page(first, flat=False))
        if layout != "layer_first":
            meta, sglang_meta = mine.get_page_buffer_meta(host), sglang.get_page_buffer_meta(host)
            assert meta[1] == sglang_meta[1]
            assert [ctypes.string_at(p, n) for p, n in zip(*meta)] == [ctypes.string_at(p, n) for p, n in zip(*sglang_meta)]
        mine.set_from_flat_data_page(6 * PAGE, sglang.get_data_page(3 * PAGE))
        assert same(mine.get_data_page(6 * PAGE), sglang.get_data_page(3 * PAGE))
        sglang.pin_memory = False  # its dummy pages would pin through the CUDA driver
        assert mine.get_dummy_flat_data_page().shape == sglang.get_dummy_flat_data_page().shape

        # Load back into other device pages: each owned layer, the shared-top-k one (nothing to do), the draft into its own pool.
        to = torch.arange(7 * PAGE, 9 * PAGE)
        buffers = [b for b in (*dev.index_k_with_scale_buffer, *draft.index_k_with_scale_buffer) if b.numel()]
        before = [b.clone() for b in buffers]
        for layer in range(dev.layer_num):
            mine.load_to_device_per_layer(dev, host, to, layer, io)
        mine.load_to_device_per_layer(draft, host, to, dev.layer_num, io, is_draft=True)
        for index, (old, new) in enumerate(zip(before, buffers)):
            expected = old.clone()
            expected[[7, 8]] = old[[5, 0]]
            assert same(new, expected), f"index layer {index}: loaded rows differ or a row outside the load changed"
        mine.destroy()
