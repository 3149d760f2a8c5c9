"""SGLang's HiCacheController (write -> load, layer by layer -> evict_host) on a portable_kv pool built by SGLang's own builder."""

from __future__ import annotations

import threading

import pytest
import torch
from sglangkit import DEVICE_TOKENS, DTYPE, HEADS, LAYERS, PAGE, SKIP_REASON, device_pool, record_io_paths

pytest.importorskip("sglang.srt.managers.cache_controller", reason=SKIP_REASON)
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool  # noqa: E402

import portable_kv.engines.sglang as pk_sglang  # noqa: E402

# What the controller accepts (its move_indices): kernel io with any layout,
# direct io with layer_first and page_first_direct.
CASES = [("kernel", layout) for layout in ("layer_first", "page_first", "page_first_direct", "page_head")] + [
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
GEOMETRIES = {"asymmetric": (24, 16), "symmetric": (16, 16)}


def wait(ack):
    ack.finish_event.synchronize()


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize(("io", "layout"), CASES)
def test_write_load_evict(topology, installed, io, layout, geometry):
    topology(hicache_ratio=2.0, hicache_mem_layout=layout, hicache_io_backend=io)
    dev, allocator = device_pool(*GEOMETRIES[geometry])
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    assert isinstance(host, pk_sglang.SGLangHostPool)
    assert host.layout == layout and host.size == (2 * dev.size // PAGE + 1) * PAGE  # SGLang's sizing
    controller = HiCacheController(allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend=io, write_policy="write_through")

    written = allocator.alloc(5 * PAGE)
    originals = [(k[written].clone(), v[written].clone()) for k, v in zip(dev.k_buffer, dev.v_buffer)]
    free_before = host.available_size()
    host_indices = controller.write(written)
    assert host_indices is not None and host.available_size() == free_before - 5 * PAGE
    wait(controller.ack_write_queue.pop())

    loaded = controller.load(host_indices)
    assert loaded is not None and not bool(torch.isin(loaded, written).any())
    controller.start_loading()
    wait(controller.ack_load_queue.pop())
    for layer, (k, v) in enumerate(originals):
        assert torch.equal(dev.k_buffer[layer][loaded].view(torch.int16), k.view(torch.int16)), f"K layer {layer}"
        assert torch.equal(dev.v_buffer[layer][loaded].view(torch.int16), v.view(torch.int16)), f"V layer {layer}"

    assert controller.evict_host(host_indices) == 5 * PAGE
    assert host.available_size() == free_before
    with pytest.raises(ValueError, match="not allocated"):
        controller.evict_host(host_indices)
    host.destroy()


def test_load_goes_layer_by_layer(topology, installed):
    """SGLang's transfer engine loads one layer at a time through the physical entry point, in order."""
    topology(hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, allocator = device_pool(24, 16)
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    controller = HiCacheController(allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend="kernel", write_policy="write_through")
    written = allocator.alloc(2 * PAGE)
    host_indices = controller.write(written)
    wait(controller.ack_write_queue.pop())
    loaded = controller.load(host_indices)
    calls = []
    physical = host.load_to_device_per_layer_physical

    def recorded(device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
        calls.append((layer_id, io_backend, kwargs))
        physical(device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)

    host.load_to_device_per_layer_physical = recorded
    controller.start_loading()
    wait(controller.ack_load_queue.pop())
    assert calls == [(layer, "kernel", {"is_draft": False}) for layer in range(LAYERS)]
    assert all(torch.equal(k[loaded].view(torch.int16), k[written].view(torch.int16)) for k in dev.k_buffer)
    host.destroy()


# How SGLang 0.5.23 passes `end_layer` to the assembler (`_mha_host_inputs` reads the device
# pool's): the device pool's own default, inclusive (`layer_num - 1`, as each sub-pool of an
# SWAKVPool keeps it); a pipeline stage's slice, inclusive as `unified_draft_pool` writes it;
# and the model runner's exclusive `model.end_layer`.
END_LAYERS = {
    "device_pool_default_inclusive": ({}, LAYERS - 1),
    "stage_slice_inclusive": (dict(start_layer=4, end_layer=4 + LAYERS - 1), 4 + LAYERS - 1),
    "model_runner_exclusive": (dict(start_layer=0, end_layer=LAYERS), LAYERS),
}


def write_then_load(allocator, host, io: str):
    """Two pages through SGLang's controller: written to the host, loaded back to new device slots."""
    controller = HiCacheController(allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend=io, write_policy="write_through")
    written = allocator.alloc(2 * PAGE)
    host_indices = controller.write(written)
    wait(controller.ack_write_queue.pop())
    loaded = controller.load(host_indices)
    controller.start_loading()
    wait(controller.ack_load_queue.pop())
    return written, loaded


@pytest.mark.parametrize("passed", END_LAYERS)
def test_end_layer_is_stored_as_sglang_passes_it(topology, installed, passed):
    layers, expected = END_LAYERS[passed]
    topology(hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, allocator = device_pool(24, 16, layers)
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    assert isinstance(host, pk_sglang.SGLangHostPool)
    assert (host.start_layer, host.end_layer) == (dev.start_layer, dev.end_layer) == (layers.get("start_layer", 0), expected)
    assert host.layer_num == host.target_layer_num == LAYERS
    written, loaded = write_then_load(allocator, host, "kernel")
    for k, v in zip(dev.k_buffer, dev.v_buffer):
        assert torch.equal(k[loaded].view(torch.int16), k[written].view(torch.int16))
        assert torch.equal(v[loaded].view(torch.int16), v[written].view(torch.int16))
    host.destroy()


@pytest.mark.parametrize(("setting", "sglang_io", "path"), [
    ("staged", "kernel", "staged"), ("auto", "direct", "auto"),
    ("kernel=auto,direct=staged", "kernel", "auto"), ("kernel=auto,direct=staged", "direct", "staged"),
    ("kernel=staged", "direct", "direct"),
])
def test_the_sglang_io_setting_maps_sglangs_choice_to_a_portable_kv_path(topology, installed, monkeypatch, setting, sglang_io, path):
    monkeypatch.setenv("PORTABLE_KV_SGLANG_IO", setting)
    topology(hicache_ratio=2.0, hicache_mem_layout="layer_first", hicache_io_backend=sglang_io)
    dev, allocator = device_pool(24, 16)
    host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
    used = record_io_paths(host)
    written, loaded = write_then_load(allocator, host, sglang_io)
    assert used and set(used) == {path}
    assert all(torch.equal(k[loaded].view(torch.int16), k[written].view(torch.int16)) for k in dev.k_buffer)
    host.destroy()


@pytest.mark.parametrize("setting", ["fast", "kernel=warp", "gpu=staged"])
def test_a_bad_sglang_io_setting_is_named(topology, installed, monkeypatch, setting):
    monkeypatch.setenv("PORTABLE_KV_SGLANG_IO", setting)
    topology(hicache_ratio=2.0, hicache_mem_layout="layer_first", hicache_io_backend="kernel")
    dev, _ = device_pool(24, 16)
    with pytest.raises(ValueError, match="^PORTABLE_KV_SGLANG_IO: expected one of"):
        build_kv_host_pool(kv_pool=dev, page_size=PAGE)


def test_the_mha_pool_refuses_mla_buffers_and_names_the_mla_pool(installed):
    class MLABufferInfo:  # the name SGLang's MLA device pools describe themselves by
        pass

    assert "SGLangMLAHostPool" in pk_sglang.unsupported_reason(MLABufferInfo())
    with pytest.raises(NotImplementedError, match="SGLangMLAHostPool"):
        pk_sglang.SGLangHostPool(MLABufferInfo(), 2.0, 0, PAGE, "page_first", device_capacity_tokens=64)


def draft_pools(k_dim: int, v_dim: int, count: int = 2, layers: int = 1):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    drafts = tuple(MHATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, HEADS, k_dim, layers, "cpu", False, v_head_dim=v_dim) for _ in range(count))
    for draft in drafts:
        for buffer in [*draft.k_buffer, *draft.v_buffer]:
            buffer.view(torch.int16).random_()
    return drafts


def test_packed_draft_layers_load_into_their_own_pools_and_back_up_from_them(topology, installed):
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_group

    topology(hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, _ = device_pool(24, 16)
    drafts = draft_pools(24, 16)
    group = build_kv_only_group(page_size=PAGE, kv_pool=dev, full_layer_mapping={i: i for i in range(LAYERS)}, use_mla=False,
                                mtp_draft_device_pools=drafts)
    host = group.entries[0].host_pool
    assert isinstance(host, pk_sglang.SGLangHostPool)
    assert (host.target_layer_num, host.layer_num) == (LAYERS, LAYERS + 2)
    slots, others = torch.arange(2 * PAGE), torch.arange(4 * PAGE, 6 * PAGE)
    host.backup_from_device_all_layer(dev, slots, slots, "kernel")
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, slots, others, layer, "kernel")
    host.load_to_device_per_layer(dev, slots, others, LAYERS, "kernel")  # a target call past the target's layers: nothing
    assert not any(torch.equal(d.k_buffer[0][others].view(torch.int16), d.k_buffer[0][slots].view(torch.int16)) for d in drafts)
    for depth, draft in enumerate(drafts):
        host.load_to_device_per_layer(draft, slots, others, LAYERS + depth, "kernel", is_draft=True)
    for pool in (dev, *drafts):
        for buffer in [*pool.k_buffer, *pool.v_buffer]:
            assert torch.equal(buffer[others].view(torch.int16), buffer[slots].view(torch.int16))
    with pytest.raises(ValueError, match=r"^layer_id: expected a packed draft layer in \[3, 5\)"):
        host.load_to_device_per_layer(drafts[0], slots, others, 0, "kernel", is_draft=True)
    with pytest.raises(ValueError, match="^device_pool: with is_draft=True, expected the one-layer device pool"):
        host.load_to_device_per_layer(dev, slots, others, LAYERS, "kernel", is_draft=True)
    with pytest.raises(ValueError, match="^device_pool: expected the target model's device pool of 3 layers"):
        host.backup_from_device_all_layer(drafts[0], slots, slots, "kernel")
    host.destroy()


@pytest.mark.parametrize(("dims", "layers", "message"), [
    ((16, 16), 1, r"^draft_buffer_infos\[1\]: expected K rows like the target's"),
    ((24, 16), 2, r"^draft_buffer_infos\[1\]: expected one packed draft layer, got 2"),
])
def test_a_draft_unlike_the_target_is_named(topology, installed, dims, layers, message):
    topology(hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    dev, _ = device_pool(24, 16)
    good, bad = draft_pools(24, 16, count=1)[0], draft_pools(*dims, count=1, layers=layers)[0]
    infos = tuple(pool.get_device_pool_infos()[0].buffer_info for pool in (good, bad))
    target = dev.get_device_pool_infos()[0].buffer_info
    with pytest.raises(ValueError, match=message):
        pk_sglang.SGLangHostPool(target, 2.0, 0, PAGE, "page_first", device_capacity_tokens=dev.size, draft_buffer_infos=infos)
