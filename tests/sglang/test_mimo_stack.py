"""MiMo-V2-Flash's HiCache stack as SGLang 0.5.23 builds it, on the CPU, with portable_kv installed and without.

The stack (mimokit.build_stack) comes from SGLang's own functions along the scheduler's path: the
KV-cache configurator builds the hybrid device pool and its allocator from the model's config, the
MTP draft runners build theirs, and the tree-cache factory builds the UnifiedRadixCache, whose
init_hicache has the hybrid-SWA strategy assemble the host pool group and the
HybridCacheController.  The cycles drive the tree's own entry points: insert (write-through),
evict, match_prefix, init_load_back, ready_to_load_host_cache, evict_host, and for the file tier
prefetch_from_storage and check_prefetch_progress.  Without portable_kv the host pools are SGLang's own, the reference that
shows the harness itself is right; SGLang's pool for MiMo's unequal K and V widths moves only two
of the layout/io pairs and no flat pages, which the last tests record.
"""

from __future__ import annotations

import itertools

import pytest
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", reason=SKIP_REASON)
from mimokit import (  # noqa: E402
    FULL_HEADS,
    FULL_LAYERS,
    HICACHE_RATIO,
    LAYOUT_IO_CASES,
    MIMO_V2_FLASH_CONFIG,
    MTP_STEPS,
    PAGE,
    SGLANG_ASYMMETRIC_CASES,
    SWA_HEADS,
    SWA_LAYERS,
    build_stack,
    resolved_layout_io,
    run_cycle,
    run_file_cycle,
    write_model_config,
)

from portable_kv.engines.sglang import SGLangHostPool  # noqa: E402

K_DIM = MIMO_V2_FLASH_CONFIG["head_dim"]
V_DIM = MIMO_V2_FLASH_CONFIG["v_head_dim"]
assert (MIMO_V2_FLASH_CONFIG["swa_head_dim"], MIMO_V2_FLASH_CONFIG["swa_v_head_dim"]) == (K_DIM, V_DIM)

# portable_kv for every pair SGLang carries; SGLang's own pools for the pairs they can move.
POOL_CASES = [pytest.param(True, io, layout, id=f"portable_kv-{io}-{layout}") for io, layout in LAYOUT_IO_CASES] + [
    pytest.param(False, io, layout, id=f"sglang-{io}-{layout}") for io, layout in SGLANG_ASYMMETRIC_CASES
]
MTP = pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])


def host_pool_classes(stack) -> set:
    return {type(pool) for pool in stack.host_pools().values()}


@MTP
@pytest.mark.parametrize(("installed", "io", "layout"), POOL_CASES)
def test_write_free_load_evict_is_bit_exact_in_every_full_swa_and_draft_layer(tmp_path, installed, io, layout, mtp):
    with build_stack("cpu", layout, io, mtp=mtp, installed=installed, workdir=tmp_path) as stack:
        assert (stack.io, stack.layout) == (io, layout), "SGLang's argument hooks kept the pair"
        if installed:
            assert host_pool_classes(stack) == {SGLangHostPool}
        else:
            assert SGLangHostPool not in host_pool_classes(stack)
        report = run_cycle(stack)
        assert report.tokens == 5 * PAGE
        assert len(report.loaded_full) == len(report.loaded_swa) == report.tokens


@pytest.mark.parametrize("installed", [True, False], ids=["portable_kv", "sglang"])
def test_sglang_builds_mimo_v2_flash_pools_with_per_rank_heads_and_drafts_packed_into_the_swa_host_pool(tmp_path, installed):
    with build_stack("cpu", "page_first", "kernel", mtp=True, installed=installed, workdir=tmp_path) as stack:
        full, swa = stack.kvcache.full_kv_pool, stack.kvcache.swa_kv_pool
        # Attention TP 2 halves the KV heads: 4 -> 2 on full layers, 8 -> 4 on sliding-window layers.
        assert (full.layer_num, full.head_num, full.head_dim, full.v_head_dim) == (len(FULL_LAYERS), FULL_HEADS, K_DIM, V_DIM) == (2, 2, 192, 128)
        assert (swa.layer_num, swa.head_num, swa.head_dim, swa.v_head_dim) == (len(SWA_LAYERS), SWA_HEADS, K_DIM, V_DIM) == (4, 4, 192, 128)
        assert stack.kvcache.layers_mapping == {0: (0, False), 5: (1, False), 1: (0, True), 2: (1, True), 3: (2, True), 4: (3, True)}
        assert type(stack.allocator).__name__ == "SWATokenToKVPoolAllocator"
        # SGLang's sizer gives the SWA pool fewer rows than the full pool, but at least a window and a page.
        assert MIMO_V2_FLASH_CONFIG["sliding_window"] + PAGE <= stack.kvcache.size_swa < stack.kvcache.size
        assert len(stack.drafts) == MTP_STEPS
        for draft in stack.drafts:
            assert draft.full_kv_pool.layer_num == 0 and draft.swa_kv_pool.layer_num == 1
            assert (draft.swa_kv_pool.head_num, draft.swa_kv_pool.head_dim, draft.swa_kv_pool.v_head_dim) == (SWA_HEADS, K_DIM, V_DIM)
            assert draft.swa_kv_pool.size == stack.kvcache.size_swa

        pools = stack.host_pools()
        assert set(pools) == {"kv", "swa"} and stack.tree.sidecar_pool_specs == [], "drafts ride in the SWA host pool, not a sidecar"
        assert pools["kv"].layer_num == len(FULL_LAYERS)
        assert pools["swa"].layer_num == len(SWA_LAYERS) + MTP_STEPS
        # SGLang's sizing: the device rows times the ratio, plus one page.
        for pool, device in ((pools["kv"], stack.kvcache.size), (pools["swa"], stack.kvcache.size_swa)):
            assert pool.size == (int(device * HICACHE_RATIO) // PAGE + 1) * PAGE
        # SGLang hands each host pool its device pool's layer range as the device pool states it.
        assert (pools["kv"].start_layer, pools["kv"].end_layer) == (full.start_layer, full.end_layer)
        assert (pools["swa"].start_layer, pools["swa"].end_layer) == (swa.start_layer, swa.end_layer)
        assert stack.controller.transfer_layer_id_max == len(FULL_LAYERS) + len(SWA_LAYERS)


@pytest.mark.parametrize(("installed", "io", "layout"), [POOL_CASES[1], POOL_CASES[-1]])
def test_load_goes_layer_by_layer_and_each_draft_loads_into_its_own_pool_with_the_target_layer_of_its_depth(tmp_path, installed, io, layout):
    with build_stack("cpu", layout, io, mtp=True, installed=installed, workdir=tmp_path) as stack:
        report = run_cycle(stack)
        expected = []
        for layer in range(len(FULL_LAYERS) + len(SWA_LAYERS)):
            kind, local = ("kv", FULL_LAYERS.index(layer)) if layer in FULL_LAYERS else ("swa", SWA_LAYERS.index(layer))
            target_pool = stack.kvcache.full_kv_pool if kind == "kv" else stack.kvcache.swa_kv_pool
            expected.append((kind, local, False, target_pool))
            if layer < MTP_STEPS:
                # Draft depth d is packed after the target's SWA layers and loads beside target layer d.
                expected.append(("swa", len(SWA_LAYERS) + layer, True, stack.drafts[layer].swa_kv_pool))
        got = report.layer_calls
        assert [(n, layer, draft) for n, layer, draft, _ in got] == [(n, layer, draft) for n, layer, draft, _ in expected]
        assert all(device is want for (*_, device), (*_, want) in zip(got, expected))


@MTP
def test_hicache_file_tier_round_trip_through_the_group_is_bit_exact(tmp_path, mtp):
    with build_stack("cpu", "page_first", "kernel", mtp=mtp, installed=True, workdir=tmp_path, storage=True) as stack:
        assert stack.controller.storage_backend_type == "file"
        assert host_pool_classes(stack) == {SGLangHostPool}
        report = run_file_cycle(stack)
        assert report.tokens == 5 * PAGE
        assert any((tmp_path / "hicache").iterdir()), "the pages went to files"


def test_sglangs_layout_io_rewrite_leaves_exactly_the_pairs_tested_here(tmp_path):
    model_dir = write_model_config(tmp_path / "model")
    layouts = ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split")
    resolved = {(io, layout): resolved_layout_io(model_dir, "cpu", layout, io) for layout, io in itertools.product(layouts, ("kernel", "direct"))}
    assert resolved[("kernel", "page_first_direct")] == ("direct", "page_first_direct")
    assert resolved[("direct", "page_first")] == ("direct", "page_first_direct")
    kept = set(resolved.values())
    # page_first_kv_split is MLA's layout; direct io with page_head the controller refuses (next test).
    assert kept - {("kernel", "page_first_kv_split"), ("direct", "page_first_kv_split"), ("direct", "page_head")} == set(LAYOUT_IO_CASES)


def test_sglangs_controller_refuses_direct_io_with_page_head(tmp_path):
    with build_stack("cpu", "page_head", "direct", mtp=False, installed=True, workdir=tmp_path) as stack:
        with pytest.raises(ValueError, match="Unsupported layout 'page_head' for io backend 'direct'"):
            run_cycle(stack)


@pytest.mark.parametrize(("io", "layout"), [case for case in LAYOUT_IO_CASES if case not in SGLANG_ASYMMETRIC_CASES])
def test_sglangs_own_host_pool_refuses_mimo_layouts_other_than_page_first_and_page_first_direct(tmp_path, io, layout):
    with pytest.raises(ValueError, match="head_dim != v_head_dim"):
        build_stack("cpu", layout, io, mtp=False, installed=False, workdir=tmp_path)


def test_sglangs_own_host_pool_has_no_flat_pages_for_the_file_tier_to_store(tmp_path):
    with build_stack("cpu", "page_first", "kernel", mtp=False, installed=False, workdir=tmp_path) as stack:
        for pool in stack.host_pools().values():
            with pytest.raises(NotImplementedError, match="head_dim != v_head_dim"):
                pool.get_data_page(0)


def test_the_stack_gives_back_sglangs_context_and_host_pool_class_when_closed(tmp_path):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import mha
    from sglang.srt.runtime_context import get_context

    original = mha.get_mha_host_pool_cls
    had_op = hasattr(mha, "transfer_kv_per_layer_mla_pf_lf")  # sgl_kernel's, where it is built
    with build_stack("cpu", "page_first", "kernel", mtp=True, installed=True, workdir=tmp_path) as stack:
        assert hybrid_pool_assembler.get_mha_host_pool_cls is not original
        assert hasattr(mha, "transfer_kv_per_layer_mla_pf_lf")
        assert get_context().server_args is stack.server_args
    assert mha.get_mha_host_pool_cls is original and hybrid_pool_assembler.get_mha_host_pool_cls is original
    assert hasattr(mha, "transfer_kv_per_layer_mla_pf_lf") == had_op
    with pytest.raises(ValueError, match="not set"):
        _ = get_context().server_args
