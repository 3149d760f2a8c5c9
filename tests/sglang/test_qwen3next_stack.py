"""Qwen3-Next's recurrent state on portable_kv: SGLang's own assembler builds the state host pool with
install(), its controller and radix tree move a request's state and KV through it (qwen3nextkit), and
the pool matches SGLang's own MambaPoolHost byte for byte on the same device states: slots, flat pages,
page addresses, MTP draft states packed after the target's."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from mlakit import fill, same
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.mem_cache.pool_host.mamba", reason=SKIP_REASON)
from qwen3nextkit import CpuMambaKvcacheio, build_stack, run_cycle  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402

from portable_kv.engines.sglang.mamba import SGLangStateHostPool, state_unsupported_reason  # noqa: E402

# The (io backend, layout) pairs SGLang's Mamba host pool moves.
STATE_CASES = [("direct", "page_first_direct"), ("kernel", "page_first")]
# Qwen3-Next's per-rank state geometry at TP 2, with fewer heads so a CPU test stays small: a
# float32 temporal state (value heads, 128, 128) and a bf16 conv state (channels, 3 taps).
LAYERS, SLOTS = 3, 9
TEMPORAL, CONV = (2, 128, 128), (512, 3)


def states(layers: int = LAYERS, seed: int = 3) -> MambaStateBufferInfo:
    """Device states of one Mamba pool (layers, slots, ...), filled with random bytes."""
    generator = torch.Generator().manual_seed(seed)
    temporal = torch.empty(layers, SLOTS, *TEMPORAL, dtype=torch.float32)
    conv = torch.empty(layers, SLOTS, *CONV, dtype=torch.bfloat16)
    for buffer in (temporal, conv):
        fill(buffer.view(layers * SLOTS, -1), generator)
    return MambaStateBufferInfo(temporal=temporal, conv=(conv,))


def layers_of(info: MambaStateBufferInfo) -> list[torch.Tensor]:
    return [*info.temporal.unbind(0), *info.conv[0].unbind(0)]


def both_pools(layout: str, target: MambaStateBufferInfo, drafts: tuple = ()):
    """SGLang's own MambaPoolHost and portable_kv's state pool over the same device states, as SGLang's assembler builds them."""
    arguments = dict(device_capacity=SLOTS - 1, mtp_draft_buffer_infos=drafts, layout=layout)
    sglang = MambaPoolHost(target, 2.0, 0, pin_memory=False, **arguments)
    return sglang, SGLangStateHostPool(target, 2.0, 0, **arguments)


@pytest.fixture
def kvcacheio():
    with contextlib.ExitStack() as stack:
        yield CpuMambaKvcacheio().bind(stack)


@pytest.mark.parametrize(("io", "layout"), STATE_CASES)
def test_the_state_pool_matches_sglangs_byte_for_byte(kvcacheio, io, layout):
    target, drafts = states(), (states(1, seed=11), states(1, seed=12))
    kvcacheio.register(*(layer for info in (target, *drafts) for layer in layers_of(info)))
    sglang, mine = both_pools(layout, target, drafts)
    assert isinstance(mine, MambaPoolHost)
    for name in ("size", "page_num", "page_size", "num_mamba_layers", "size_per_token", "temporal_state_elem_size", "conv_state_elem_sizes",
                 "layout", "conv_dtype", "temporal_dtype", "dtype", "can_use_write_back_jit"):
        assert getattr(mine, name) == getattr(sglang, name), name
    assert [(b.shape, b.dtype) for b in mine.get_hybrid_pool_buffer()] == [(b.shape, b.dtype) for b in sglang.get_hybrid_pool_buffer()]
    assert mine.get_size_per_token() == mine.get_ksize_per_token() == sglang.get_ksize_per_token()

    host, device = torch.tensor([5, 1, 7]), torch.tensor([2, 8, 4])
    for pool in (sglang, mine):
        pool.backup_from_device_all_layer(None if pool is sglang else target, host, device, io)
    for theirs, ours in zip(sglang.get_hybrid_pool_buffer(), mine.get_hybrid_pool_buffer()):
        assert same(theirs[host], ours[host]), "host states differ after the same backup"
    for slot in host.tolist():
        assert same(mine.get_data_page(slot), sglang.get_data_page(slot)), f"flat page of slot {slot}"
    wanted = torch.tensor([7, 5])
    sglang_meta, meta = sglang.get_page_buffer_meta(wanted), mine.get_page_buffer_meta(wanted)
    assert meta[1] == sglang_meta[1] and len(meta[0]) == 4
    assert [ctypes.string_at(p, s) for p, s in zip(*meta)] == [ctypes.string_at(p, s) for p, s in zip(*sglang_meta)]
    assert mine.is_stride_page_aligned() == sglang.is_stride_page_aligned()

    # A page read back from an L3 tier: SGLang's flat page into another slot of portable_kv's pool.
    mine.set_from_flat_data_page(2, sglang.get_data_page(7))
    assert same(mine.get_data_page(2), sglang.get_data_page(7))
    assert mine.get_dummy_flat_data_page().numel() == sglang.get_dummy_flat_data_page().numel()

    # Load every layer, then each draft's into its own pool, into fresh device slots; nothing else changes.
    to = torch.tensor([0, 3, 6])
    before = [layer.clone() for info in (target, *drafts) for layer in layers_of(info)]
    for layer in range(LAYERS):
        mine.load_to_device_per_layer(target, host, to, layer, io)
    for depth, draft in enumerate(drafts):
        mine.load_to_device_per_layer(draft, host, to, LAYERS + depth, io, is_draft=True)
    after = [layer for info in (target, *drafts) for layer in layers_of(info)]
    for index, (old, new) in enumerate(zip(before, after)):
        expected = old.clone()
        expected[to] = old[device]
        assert same(new, expected), f"device layer {index}: loaded slots differ or a slot outside the load changed"
    assert mine.alloc(3).tolist() == [0, 1, 2] and mine.available_size() == mine.size - 3
    mine.destroy()
    mine.destroy()


def test_what_stays_sglangs():
    info = states(1)
    assert state_unsupported_reason(info, "layer_first").startswith("layout")
    side = MambaStateBufferInfo(temporal=info.temporal, conv=info.conv, extra_checkpoint_buffers=(torch.zeros(SLOTS, 4),))
    assert "extra_checkpoint_buffers" in state_unsupported_reason(side)
    strided = MambaStateBufferInfo(temporal=info.temporal, conv=(torch.zeros(1, SLOTS, 3, 512).transpose(2, 3),))
    assert "strided" in state_unsupported_reason(strided)
    assert state_unsupported_reason(info) is None


@pytest.mark.parametrize(("io", "layout", "mtp"), [("direct", "page_first_direct", False), ("kernel", "page_first", True)])
def test_sglangs_controller_moves_qwen3_nexts_state_and_kv_through_portable_kv(tmp_path, io, layout, mtp):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    with build_stack(tmp_path, layout, io, mtp=mtp) as stack:
        assert (stack.io, stack.layout) == (io, layout)
        assert type(stack.state_host) is SGLangStateHostPool and type(stack.kv_host).__name__ == "SGLangHostPool"
        assert not isinstance(stack.kv_host, MHATokenToKVPoolHost)
        assert stack.state_host.size == int(stack.mamba_pool.size * 2.0) + 1, "sized as SGLang sizes its Mamba pool"
        report = run_cycle(stack)
        assert len(report.loaded_slots) == 2, "the node's checkpoint and the request's own copy are both loaded"


def test_the_same_cycle_through_sglangs_own_pools(tmp_path):
    """The reference: the cycle's checks hold for SGLang's own pools, moved by torch stand-ins for its kernels."""
    with build_stack(tmp_path, "page_first_direct", "direct", installed=False) as stack:
        assert type(stack.state_host) is MambaPoolHost
        run_cycle(stack)


def test_install_serves_both_pools_names_what_stays_sglangs_and_uninstall_restores(caplog):
    import logging

    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import dsa

    import portable_kv.engines.sglang as pk_sglang

    caplog.set_level(logging.INFO, logger="portable_kv")
    state_class, indexer_class = hybrid_pool_assembler.MambaPoolHost, dsa.DSAIndexerPoolHost
    pk_sglang.install()
    try:
        assert hybrid_pool_assembler.MambaPoolHost.sglang_class is state_class and dsa.DSAIndexerPoolHost.sglang_class is indexer_class
        own = [r.getMessage() for r in caplog.records if r.getMessage().startswith("portable_kv: SGLang's own ")]
        assert len(own) == len(pk_sglang.SGLANG_ONLY_POOLS) and any("DeepSeekV4PagedHostPool" in line for line in own)
    finally:
        pk_sglang.uninstall()
    assert hybrid_pool_assembler.MambaPoolHost is state_class and dsa.DSAIndexerPoolHost is indexer_class
