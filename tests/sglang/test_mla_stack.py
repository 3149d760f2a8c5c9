"""DeepSeek-V3's HiCache stack as SGLang 0.5.23 builds it on the scheduler's path, on the CPU, with portable_kv installed.

The stack (deepseekkit.build_stack) is SGLang's own from the model's config.json on: the configurator
builds the MLA device pool, the tree-cache factory the UnifiedRadixCache, whose init_hicache has the
plain-KV strategy build the MLA host pool and the HybridCacheController.  The cycle drives the tree's
own entry points; the file tier is driven through the controller's write_storage (its backup thread
and `_generic_page_set`) and `_generic_page_get`.  With portable_kv uninstalled the host pool is
SGLang's own, the reference that shows the harness itself is right.
"""

from __future__ import annotations

import pytest
import torch
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", reason=SKIP_REASON)
from deepseekkit import HICACHE_RATIO, KV_CACHE_DIM, LAYERS, PAGE, build_stack, resolved_layout_io, run_cycle  # noqa: E402
from mlakit import DTYPES, MLA_CASES, device_buffers, load_and_check, raw, wait  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from portable_kv.engines.sglang.mla import SGLangMLAHostPool  # noqa: E402

MTP = pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])
BACKUP_TIMEOUT = 60.0


@MTP
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("io", "layout"), MLA_CASES)
def test_write_free_load_evict_through_the_tree_is_bit_exact_in_every_layer(tmp_path, io, layout, dtype, mtp):
    with build_stack(tmp_path, layout, io, dtype=dtype, mtp=mtp) as stack:
        assert (stack.io, stack.layout) == (io, layout), "SGLang's argument hooks kept the pair"
        assert type(stack.host) is SGLangMLAHostPool and type(stack.controller).__name__ == "HybridCacheController"
        assert stack.host.dtype == stack.kvcache.store_dtype == (torch.uint8 if dtype == "fp8" else torch.bfloat16)
        assert len(run_cycle(stack)) == 5 * PAGE
        assert len(run_cycle(stack, seed=1)) == 5 * PAGE  # the slots the first cycle gave back serve again


@pytest.mark.parametrize(("io", "layout"), [MLA_CASES[0], MLA_CASES[3]])
def test_sglangs_own_pool_passes_the_same_cycle(tmp_path, io, layout):
    with build_stack(tmp_path, layout, io, mtp=True, installed=False) as stack:
        assert type(stack.host) is MLATokenToKVPoolHost
        run_cycle(stack)


@pytest.mark.parametrize("installed", [True, False], ids=["portable_kv", "sglang"])
def test_sglang_builds_deepseeks_pools_with_the_nextn_draft_packed_into_the_mla_host_pool(tmp_path, installed):
    with build_stack(tmp_path, "page_first", "kernel", mtp=True, installed=installed) as stack:
        kv, host = stack.kvcache, stack.host
        assert type(kv).__name__ == "MLATokenToKVPool" and isinstance(host, MLATokenToKVPoolHost)
        assert (kv.layer_num, kv.kv_cache_dim, kv.kv_lora_rank, kv.qk_rope_head_dim) == (LAYERS, KV_CACHE_DIM, 512, 64)
        assert len(stack.drafts) == 1 and stack.drafts[0].layer_num == 1 and stack.tree.sidecar_pool_specs == []
        assert (host.target_layer_num, host.layer_num) == (LAYERS, LAYERS + 1)
        assert host.kv_buffer.shape == (host.size, LAYERS + 1, 1, KV_CACHE_DIM)
        assert host.size == (int(kv.size * HICACHE_RATIO) // PAGE + 1) * PAGE
        assert (host.start_layer, host.end_layer) == (kv.start_layer, kv.end_layer)
        assert host.get_size_per_token() == (LAYERS + 1) * KV_CACHE_DIM * 2
        assert stack.controller.transfer_layer_id_max == LAYERS


def test_sglangs_layout_io_rewrite_for_mla_leaves_exactly_the_pairs_tested_here(tmp_path):
    resolved = {(io, layout): resolved_layout_io(tmp_path, layout, io)
                for layout in ("layer_first", "page_first", "page_first_direct") for io in ("kernel", "direct")}
    assert resolved[("kernel", "page_first_direct")] == ("direct", "page_first_direct")
    assert resolved[("direct", "page_first")] == ("direct", "page_first_direct")
    assert set(resolved.values()) == set(MLA_CASES)


# -- the file tier -------------------------------------------------------------------------------


def write_to_host(stack, pages: int, seed: int):
    """Fresh random rows written to host memory through the controller: (host indices, their bytes, per layer)."""
    generator = torch.Generator().manual_seed(seed)
    rows = stack.allocator.alloc(pages * PAGE)
    for buffer in device_buffers(stack.kvcache, stack.drafts):
        buffer.view(torch.uint8)[rows] = torch.randint(0, 256, (len(rows), *buffer.view(torch.uint8).shape[1:]), generator=generator, dtype=torch.uint8)
    originals = [buffer[rows].clone() for buffer in device_buffers(stack.kvcache, stack.drafts)]
    host_indices = stack.controller.write(rows)
    wait(stack.controller.ack_write_queue.pop())
    stack.allocator.free(rows)
    return host_indices, originals


def back_up(stack, host_indices, keys: list[str]):
    """The controller's storage backup (its backup thread, `_page_backup`, the page-set function) of written pages."""
    assert stack.controller.page_set_func.__func__ is HiCacheController._generic_page_set
    stack.controller.write_storage(host_indices, list(range(len(keys) * PAGE)), hash_value=keys)
    return stack.controller.ack_backup_queue.get(timeout=BACKUP_TIMEOUT)


def read_back(stack, keys: list[str]) -> torch.Tensor:
    """Pages of `keys` from the tier into fresh host slots, as a prefetch reads them (`_generic_page_get`)."""
    assert stack.controller.page_get_func.__func__ is HiCacheController._generic_page_get
    host_indices = stack.host.alloc(len(keys) * PAGE)
    operation = PrefetchOperation("read-back", list(range(len(keys) * PAGE)))
    assert stack.controller.page_get_func(operation, keys, host_indices) == len(keys)
    return host_indices


def stored(storage, keys: list[str]) -> dict[str, bytes]:
    files = {key: [p for p in storage.iterdir() if p.name.startswith(f"{key}_")] for key in keys}
    assert all(len(found) == 1 for found in files.values()), f"one file per page: {files}"
    return {key: found[0].read_bytes() for key, found in files.items()}


@pytest.mark.parametrize(("io", "layout"), MLA_CASES)
def test_hicache_file_round_trip_through_the_controllers_page_set_and_get_is_bit_exact(tmp_path, io, layout):
    storage = tmp_path / "hicache"
    with build_stack(tmp_path, layout, io, mtp=True, storage_dir=storage) as stack:
        assert stack.controller.storage_backend_type == "file" and stack.controller.storage_config.is_mla_model
        assert not stack.controller.backup_skip, "TP rank 0 writes MLA pages"
        keys = [f"page{i}" for i in range(3)]
        host_indices, originals = write_to_host(stack, 3, seed=1)
        ack = back_up(stack, host_indices, keys)
        assert ack.completed_tokens == 3 * PAGE
        files = stored(storage, keys)
        # A file holds the flat page: all layers, drafts included, in the layout's byte order.
        for page, key in enumerate(keys):
            assert files[key] == raw(stack.host.get_data_page(int(host_indices[page * PAGE]))).numpy().tobytes()
        assert stack.controller.evict_host(host_indices) == 3 * PAGE
        stack.host.kv_buffer.view(torch.uint8).fill_(0x5A)  # nothing may come back from host memory
        read = read_back(stack, keys)
        generator = torch.Generator().manual_seed(2)
        loaded = load_and_check(stack.controller, stack.kvcache, stack.allocator, read, originals, generator, stack.drafts)
        stack.allocator.free(loaded)
        assert stack.controller.evict_host(read) == 3 * PAGE


def test_two_tp_ranks_share_one_l3_copy_rank_zero_writes_and_rank_one_reads_and_loads(tmp_path):
    storage, keys = tmp_path / "hicache", [f"page{i}" for i in range(4)]
    with build_stack(tmp_path, "page_first_direct", "direct", storage_dir=storage, tp_rank=0) as rank0:
        assert not rank0.controller.backup_skip
        host_indices, originals = write_to_host(rank0, 4, seed=3)
        assert back_up(rank0, host_indices, keys).completed_tokens == 4 * PAGE
    written = stored(storage, keys)

    with build_stack(tmp_path, "page_first_direct", "direct", storage_dir=storage, tp_rank=1) as rank1:
        config = rank1.controller.storage_config
        assert (config.tp_rank, config.tp_size, config.is_mla_model, config.is_storage_writer) == (1, 2, True, False)
        assert rank1.controller.backup_skip, "only TP rank 0 writes MLA pages: the latent is the same on every rank"
        # Rank 1's own backup of the same pages is acknowledged and writes nothing.
        own, _ = write_to_host(rank1, 4, seed=4)
        assert back_up(rank1, own, keys).completed_tokens == 0
        assert stored(storage, keys) == written
        rank1.controller.evict_host(own)
        read = read_back(rank1, keys)
        loaded = load_and_check(rank1.controller, rank1.kvcache, rank1.allocator, read, originals, torch.Generator().manual_seed(5))
        rank1.allocator.free(loaded)
        assert rank1.controller.evict_host(read) == 4 * PAGE
