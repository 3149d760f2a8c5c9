"""What the SGLang tests share: the pool geometry and a device pool of it (a module of its
own, since tests/storage has a conftest too and `from conftest import` would be ambiguous)."""

from __future__ import annotations

import torch

SKIP_REASON = "sglang is not installed: `tox -e sglang` runs these tests"

PAGE = 4
LAYERS = 3
HEADS = 2
DEVICE_TOKENS = 64
DTYPE = torch.bfloat16


def device_pool(k_dim: int, v_dim: int, layers: dict | None = None):
    """SGLang's device KV pool and its paged allocator, on the CPU, filled with random bits.

    `layers`: `start_layer`/`end_layer` as SGLang's callers pass them ({}: the device
    pool's own default); by default the model runner's exclusive `end_layer`."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layers = dict(start_layer=0, end_layer=LAYERS) if layers is None else layers
    pool = MHATokenToKVPool(DEVICE_TOKENS, PAGE, DTYPE, HEADS, k_dim, LAYERS, "cpu", False, v_head_dim=v_dim, **layers)
    generator = torch.Generator().manual_seed(7)
    for buffer in [*pool.k_buffer, *pool.v_buffer]:
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape, generator=generator, dtype=torch.int16))
    allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, DTYPE, "cpu", pool, need_sort=False)
    return pool, allocator


def record_io_paths(host) -> list[str]:
    """The io path of every transfer `host` makes from now on, in order (its `_transfer`
    wrapped on the instance)."""
    used: list[str] = []
    transfer = host._transfer

    def recorded(device_pool, host_indices, device_indices, layers, to_device, io_backend, *rest):
        used.append(io_backend)
        transfer(device_pool, host_indices, device_indices, layers, to_device, io_backend, *rest)

    host._transfer = recorded
    return used
