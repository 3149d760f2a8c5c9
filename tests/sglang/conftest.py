"""SGLang 0.5.23's own HiCache code on portable_kv pools, on the CPU (`tox -e sglang`).

Each module skips itself where sglang is not importable (the plain test run).  The runtime
context is published as SGLang's own tests do (`published_topology` in
sglang/test/test_utils.py): a ServerArgs for a dummy model, rank zero.
"""

from __future__ import annotations

import pytest
import torch

import portable_kv.sglang as pk_sglang

SKIP_REASON = "sglang is not installed: `tox -e sglang` runs these tests"

PAGE = 4
LAYERS = 3
HEADS = 2
DEVICE_TOKENS = 64
DTYPE = torch.bfloat16


@pytest.fixture
def topology(request):
    """Publish SGLang's runtime context for one rank, with the host-pool settings a test asks for."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def publish_args(**fields):
        reset_context()
        args = ServerArgs(model_path="dummy", page_size=PAGE, **fields)
        publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
        return args

    yield publish_args
    reset_context()


@pytest.fixture
def installed():
    pk_sglang.install()
    yield
    pk_sglang.uninstall()


def device_pool(k_dim: int, v_dim: int):
    """SGLang's device KV pool and its paged allocator, on the CPU, filled with random bits."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, HEADS, k_dim, LAYERS, "cpu", False, v_head_dim=v_dim, start_layer=0, end_layer=LAYERS)
    generator = torch.Generator().manual_seed(7)
    for buffer in [*pool.k_buffer, *pool.v_buffer]:
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape, generator=generator, dtype=torch.int16))
    allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, DTYPE, "cpu", pool, need_sort=False)
    return pool, allocator
