"""SGLang 0.5.23's own Mooncake backend and portable_kv's MooncakeStore share pages, both ways, on the CPU.

Runs where sglang is importable (`tox -e sglang`); the plain test run skips it.  SGLang's
backend drives SGLang's own host pool (MHA, or MLA); portable_kv's store drives a portable_kv
pool of the same geometry; one loopback master serves both."""

from __future__ import annotations

import pytest
import torch
from storekit import needs_mooncake, unique_keys

pytestmark = needs_mooncake
pytest.importorskip("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store", reason="sglang is not installed: `tox -e sglang` runs this test")
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as SGLangMooncakeStore  # noqa: E402

import portable_kv as pk  # noqa: E402
from portable_kv import storage  # noqa: E402
from portable_kv.engines.sglang import SGLangHostPool  # noqa: E402

PAGE, LAYERS, HEADS, DEVICE_TOKENS, DTYPE = 4, 3, 2, 64, torch.bfloat16
MODEL = "org/model"


@pytest.fixture
def published():
    """SGLang's runtime context for one rank, as its own unit tests publish it."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", page_size=PAGE), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    yield
    reset_context()


def host_pools(layout: str):
    """SGLang's MHA host pool filled with random bits, and a zeroed portable_kv pool from the same arguments."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, HEADS, 16, LAYERS, "cpu", False, v_head_dim=16, start_layer=0, end_layer=LAYERS)
    args = (dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout)
    kwargs = dict(pin_memory=False, device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS)
    theirs, ours = MHATokenToKVPoolHost(*args, **kwargs), SGLangHostPool(*args, **kwargs)
    generator = torch.Generator().manual_seed(5)
    for buffer in (theirs.k_buffer, theirs.v_buffer):
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape, generator=generator, dtype=torch.int16))
    ours.k_buffer.zero_()
    ours.v_buffer.zero_()
    return theirs, ours


def mla_host_pools(layout: str):
    """SGLang's MLA host pool filled with random bits, and a zeroed portable_kv MLA pool over the same device pool."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, 32, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    theirs = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
                                  device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    ours = pk.MLAHostPool(dev, layout=layout)
    generator = torch.Generator().manual_seed(5)
    theirs.kv_buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, theirs.kv_buffer.shape, generator=generator, dtype=torch.int16))
    ours.kv_buffer.zero_()
    return theirs, ours


def sglang_backend(master: str, pool, is_mla: bool = False) -> SGLangMooncakeStore:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False,
        is_page_first_layout=pool.layout != "layer_first", model_name=MODEL,
        extra_config={"master_server_address": master, "local_hostname": "127.0.0.1", "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
                      "global_segment_size": 64 << 20, "device_name": "", "check_server": False},
    )
    backend = SGLangMooncakeStore(config)
    backend.register_mem_pool_host(pool)
    return backend


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE)


def same_page(theirs, their_token: int, ours, our_token: int) -> bool:
    return torch.equal(theirs.get_data_page(their_token).view(torch.int16), ours.get_data_page(our_token).view(torch.int16))


# SGLang's Mooncake backend refuses layer_first MHA pools; it puts an MLA layer_first page from its layers in turn.
@pytest.mark.parametrize("pool, layout", [("MHA", "page_first"), ("MHA", "page_first_direct"), ("MHA", "page_head"),
                                          ("MLA", "layer_first"), ("MLA", "page_first"), ("MLA", "page_first_direct")])
def test_sglang_and_portable_kv_read_each_others_pages(published, master, pool, layout):
    theirs, ours = host_pools(layout) if pool == "MHA" else mla_host_pools(layout)
    backend = sglang_backend(master.address, theirs, is_mla=pool == "MLA")
    try:
        # An MLA page is named without the tensor-parallel rank: a reader of another rank shares it.
        with storage.MooncakeStore(ours, master=master.address, segment_size_gb=0, model_name=MODEL, tp_rank=0 if pool == "MHA" else 3) as store:
            keys = unique_keys(3)
            assert backend.batch_set_v1(keys, slots(2, 3)) == [True] * 3
            assert store.exists(keys) == 3
            assert store.get(keys, slots(5, 3)) == [True] * 3
            for n in range(3):
                assert same_page(theirs, (2 + n) * PAGE, ours, (5 + n) * PAGE), f"page {n} put by SGLang"

            back = unique_keys(3)
            assert store.put(back, slots(5, 3)) == [True] * 3
            assert backend.batch_exists(back) == 3
            assert backend.batch_get_v1(back, slots(9, 3)) == [True] * 3
            for n in range(3):
                assert same_page(theirs, (9 + n) * PAGE, ours, (5 + n) * PAGE), f"page {n} put by portable_kv"
    finally:
        backend.store.close()
        ours.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglangs_mooncake_backend_moves_pages_between_its_own_mla_pool_and_the_installed_one(published, master, layout):
    """The MLA pool install() serves is an MLATokenToKVPoolHost to SGLang's Mooncake backend: one object
    per page, named without the tensor-parallel rank, at the addresses `get_page_buffer_meta` gives."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from portable_kv.engines.sglang.mla import SGLangMLAHostPool

    dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, 32, 8, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    args = (dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout)
    kwargs = dict(device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    theirs, ours = MLATokenToKVPoolHost(*args, pin_memory=False, **kwargs), SGLangMLAHostPool(*args, **kwargs)
    assert isinstance(ours, MLATokenToKVPoolHost) and ours.kv_buffer.shape == theirs.kv_buffer.shape
    theirs.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, theirs.kv_buffer.view(torch.uint8).shape, dtype=torch.uint8))
    backends = [sglang_backend(master.address, pool, is_mla=True) for pool in (theirs, ours)]
    try:
        keys = unique_keys(3)
        assert backends[0].batch_set_v1(keys, slots(2, 3)) == [True] * 3
        assert backends[1].batch_exists(keys) == 3
        assert backends[1].batch_get_v1(keys, slots(5, 3)) == [True] * 3
        for n in range(3):
            assert same_page(theirs, (2 + n) * PAGE, ours, (5 + n) * PAGE), f"page {n} put from SGLang's pool"
        back = unique_keys(3)
        assert backends[1].batch_set_v1(back, slots(5, 3)) == [True] * 3
        assert backends[0].batch_get_v1(back, slots(9, 3)) == [True] * 3
        for n in range(3):
            assert same_page(theirs, (9 + n) * PAGE, ours, (5 + n) * PAGE), f"page {n} put from the installed pool"
    finally:
        for backend in backends:
            backend.store.close()
        ours.close()
