"""The bench places device pages with FreeListAllocator, its model of SGLang's device page
allocator: here both run the same churn side by side and must hand out the same slots."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch
from sglangkit import SKIP_REASON

from portable_kv.allocator import FreeListAllocator

paged = pytest.importorskip("sglang.srt.mem_cache.allocator.paged", reason=SKIP_REASON)


@pytest.mark.parametrize("page_size", [64, 16, 1])
def test_the_model_hands_out_sglangs_slots_through_churn(page_size):
    pages = 512
    sglang = paged.PagedTokenToKVPoolAllocator(pages * page_size, page_size, torch.int64, "cpu", None, False)
    model = FreeListAllocator(pages * page_size, page_size)
    rng = random.Random(page_size)
    live: deque[torch.Tensor] = deque()
    refused = 0
    for _ in range(3000):
        need = rng.randint(1, 64) * page_size
        theirs, ours = sglang.alloc(need), model.alloc(need)
        while theirs is None:
            assert ours is None, "the model allocated where SGLang refused"
            refused += 1
            freed = live.popleft()
            sglang.free(freed)
            model.free(freed)
            theirs, ours = sglang.alloc(need), model.alloc(need)
        assert ours is not None and torch.equal(theirs, ours)
        live.append(theirs)
    assert refused > 100, "the churn filled the pool again and again"
