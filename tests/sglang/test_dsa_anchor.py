"""DSA (DeepSeek-V3.2's sparse attention): install() serves its latent pool, the root of SGLang's DSA host
pool group; the indexer pool stays SGLang's own DSAIndexerPoolHost, anchored on portable_kv's pool (it
takes its layout, page size and slots).  One write and load through SGLang's HybridCacheController, the
group built as SGLang's DSA strategy builds it, moves both, bit for bit, in bf16 and in fp8's packed rows."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from mlakit import MLA_CASES, CpuMlaKvcacheio, fill, same, wait
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.pool_host.dsa", reason=SKIP_REASON)
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_host_pool_group, prepare_host_pool_config  # noqa: E402
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

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
    assert type(root) is SGLangMLAHostPool and isinstance(root, MLATokenToKVPoolHost) and type(indexer) is DSAIndexerPoolHost
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
