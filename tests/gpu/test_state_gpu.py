"""The state and indexer host pools (`SlotRowsHostPool`, what SGLang's Mamba and DSA indexer host
tiers get) on a GPU, without SGLang: a Qwen3-Next-shaped recurrent state (float32 temporal rows,
bf16 conv rows of an odd width) and fp8-sized index-key rows, backed up and loaded per layer on
every io path and host layout, bit-exact, and other slots left untouched.

Skipped (with the reason) where no GPU backend can run; the CPU suite covers the same pools
through SGLang's own classes (tests/sglang).
"""

from __future__ import annotations

import pytest
import torch

from portable_kv import backends
from portable_kv.engines.sglang.slots import SlotRows, SlotRowsHostPool

GPU = [n for n in ("cuda", "rocm") if backends.unavailable_reason(n) is None and backends.get(n).device.type == "cuda"]
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU backend: " + str(backends.unavailable_reason("cuda")))

LAYERS, SLOTS = 3, 9
# (per-slot shape, dtype): a temporal state, a conv state of 3 taps, a DSA index-key page (132 bytes a token x 64).
ROWS = {"temporal": ((4, 32, 32), torch.float32), "conv": ((2 * 16 * 8 + 4 * 8, 3), torch.bfloat16), "index_keys": ((64 * 132,), torch.uint8)}


@pytest.fixture(params=GPU or ["none"])
def gpu(request):
    before = backends.current()
    yield backends.use(request.param)
    backends.use(before.name)


def random_state(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (LAYERS, SLOTS, *shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


@pytest.mark.parametrize("kind", sorted(ROWS))
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("io", ["kernel", "bulk", "direct", "auto", "staged"])
def test_state_rows_back_up_and_load_bit_exact(gpu, kind, layout, io):
    shape, dtype = ROWS[kind]
    state = random_state(shape, dtype, gpu.device, seed=len(kind))
    rows = SlotRows(state.unbind(0))
    pool = SlotRowsHostPool(rows, (), slots=2 * SLOTS, layout=layout, pin_memory=True, io_backend=io, pool_label=kind)
    try:
        host_slots = torch.tensor([5, 0, 11, 2])
        dev_slots = torch.tensor([1, 4, 7, 8], device=gpu.device)
        pool.backup_from_device_all_layer(rows, host_slots, dev_slots, io)
        saved = state.clone()
        state.zero_()
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(rows, host_slots, dev_slots.flip(0), layer, io)
        torch.cuda.synchronize()
        moved = state[:, dev_slots.flip(0).cpu()].view(torch.uint8)
        assert torch.equal(moved.cpu(), saved[:, dev_slots.cpu()].view(torch.uint8).cpu())
        others = [s for s in range(SLOTS) if s not in dev_slots.tolist()]
        assert int(state[:, others].view(torch.uint8).count_nonzero()) == 0, "a load wrote slots it was not given"
        for host_slot, dev_slot in zip(host_slots.tolist(), dev_slots.tolist()):
            expect = saved[:, dev_slot].contiguous().view(torch.uint8).reshape(-1).cpu()
            assert torch.equal(pool.page_bytes(host_slot).reshape(-1).cpu(), expect), f"host slot {host_slot} in SGLang's byte order"
    finally:
        pool.close()
