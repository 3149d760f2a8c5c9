"""The staged path's schedule (io/staging_schedule.py), as pure functions of host indices and
buffer strides: host runs, the 2-D copy each layout folds a run into, chunks within a
staging slot, the taper toward a small tail, and the rule of when staging carries a schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvspec import page_tokens

from portable_kv.io import staging_schedule as schedule
from portable_kv.layout import host_shape
from portable_kv.transfer import tensor_pair

L, H, KD, VD, ITEM = 8, 4, 192, 128, 2  # MiMo-V2's K 192 / V 128, 4 heads, bf16
K_TOKEN, V_TOKEN = H * KD * ITEM, H * VD * ITEM


def pairs(layout: str, page_size: int, pages: int = 64):
    """K and V of a host pool in `layout`, and a one-page device pool per layer."""
    device = [[torch.empty(page_size, H, d, dtype=torch.bfloat16) for _ in range(L)] for d in (KD, VD)]
    return tuple(tensor_pair(torch.empty(host_shape(layout, L, pages, page_size, H, d), dtype=torch.bfloat16), device[n], layout, page_size)
                 for n, d in enumerate((KD, VD)))


def page_slots(pages, page_size: int) -> np.ndarray:
    return page_tokens(torch.tensor(pages), page_size).numpy()


def build(layout: str, page_size: int, host_idx: np.ndarray, layers: range, slot_bytes: int = 32 << 20):
    return schedule.build(host_idx, pairs(layout, page_size), layout, page_size, layers, L, slot_bytes)


# -- runs and copies -------------------------------------------------------------------------


def test_runs_break_where_tokens_jump_at_chunks_and_registrations():
    idx = np.array([4, 5, 6, 7, 8, 20, 21, 3])
    starts, lengths = schedule.host_runs(idx, np.array([0, 8]))
    assert starts.tolist() == [0, 5, 7] and lengths.tolist() == [5, 2, 1]
    starts, lengths = schedule.host_runs(idx, np.array([0, 4, 8]))
    assert starts.tolist() == [0, 4, 5, 7] and lengths.tolist() == [4, 1, 2, 1]
    starts, lengths = schedule.host_runs(idx, np.array([0, 3, 6, 8]))
    assert starts.tolist() == [0, 3, 5, 6, 7] and lengths.tolist() == [3, 2, 1, 1, 1]
    starts, lengths = schedule.host_runs(idx, np.array([0, 8]), registration_tokens=(6,))
    assert starts.tolist() == [0, 2, 5, 7]


def test_page_first_direct_per_layer_run_is_one_row_per_page():
    P = 16
    staged_schedule = build("page_first_direct", P, page_slots([3, 4, 5, 6, 40], P), range(2, 3))
    k, v = staged_schedule.copies
    page_bytes = L * P * K_TOKEN
    assert k.width.tolist() == [P * K_TOKEN] * 2 and k.height.tolist() == [4, 1]
    assert k.host_pitch[0] == page_bytes and k.staging_pitch[0] == P * K_TOKEN
    assert k.host.tolist() == [3 * page_bytes, 40 * page_bytes]  # the layer term is added per call
    assert k.staging.tolist() == [0, 4 * P * K_TOKEN]
    assert v.width[0] == P * V_TOKEN and staged_schedule.offsets[1] % schedule.STAGING_ALIGN == 0
    assert staged_schedule.staging[0].layer == 0, "one staged layer: the kernel's absolute layer lands on it"


def test_whole_pages_over_all_layers_are_one_flat_copy():
    P = 16
    for layout in ("page_first_direct", "page_head"):
        k, _ = build(layout, P, page_slots([3, 4, 5, 9], P), range(L)).copies
        assert k.height.tolist() == [1, 1] and k.width.tolist() == [3 * L * P * K_TOKEN, L * P * K_TOKEN]


def test_layer_first_all_layers_is_one_row_per_layer():
    P = 4
    k, _ = build("layer_first", P, np.arange(8, 8 + 10), range(L)).copies
    assert len(k) == 1 and k.width[0] == 10 * K_TOKEN and k.height[0] == L
    assert k.host_pitch[0] == 64 * P * K_TOKEN and k.staging_pitch[0] == schedule.chunk_tokens(10, (K_TOKEN + V_TOKEN) * L, P, 32 << 20) * K_TOKEN


def test_page_first_per_layer_is_one_row_per_token_and_all_layers_one_copy():
    P = 1
    k, _ = build("page_first", P, np.arange(5, 5 + 12), range(3, 4)).copies
    assert (k.width[0], k.height[0], k.host_pitch[0], k.staging_pitch[0]) == (K_TOKEN, 12, L * K_TOKEN, K_TOKEN)
    k, _ = build("page_first", P, np.arange(5, 5 + 12), range(L)).copies
    assert (k.width[0], k.height[0]) == (12 * L * K_TOKEN, 1)


def test_page_head_per_layer_rows_are_one_head_row():
    """What the link rule refuses: 384-byte rows, one 2-D copy per page and head... or fewer where they continue."""
    P = 4
    staged_schedule = build("page_head", P, page_slots([2, 3], P), range(1, 2))
    k, _ = staged_schedule.copies
    assert set(k.width.tolist()) == {KD * ITEM} and k.height.sum() * k.width[0] == 2 * P * K_TOKEN
    assert not schedule.LINK_RULE.carries(staged_schedule) and schedule.EVERY_SCHEDULE.carries(staged_schedule)


def test_pitches_past_the_device_maximum_become_rows_of_their_own(monkeypatch):
    monkeypatch.setattr(schedule, "MAX_PITCH", 1000)
    k, _ = build("layer_first", 4, np.arange(8, 18), range(L)).copies
    assert len(k) == L and set(k.height.tolist()) == {1}
    assert np.diff(k.host).tolist() == [64 * 4 * K_TOKEN] * (L - 1)


def test_k_and_v_are_folded_each_by_its_own_strides():
    """page_head with one layer: one K head makes K's pages adjacent, two V heads keep V's apart."""
    P = 2
    host = [torch.empty(host_shape("page_head", 1, 4, P, heads, 1), dtype=torch.float16) for heads in (1, 2)]
    device = [[torch.empty(8, heads, 1, dtype=torch.float16)] for heads in (1, 2)]
    both = tuple(tensor_pair(h, d, "page_head", P) for h, d in zip(host, device))
    k, v = schedule.build(np.arange(4), both, "page_head", P, range(0, 1), 1, 1 << 20).copies
    assert (k.width[0], k.height[0]) == (8, 1) and (v.width[0], v.height[0]) == (16, 1)


def test_page_layouts_need_whole_pages_and_layers_one_or_all():
    P = 4
    assert build("page_first_direct", P, np.array([1, 2, 3, 4]), range(0, 1)) is None  # not page aligned
    assert build("page_first_direct", P, page_slots([1], P), range(2, 5)) is None
    assert build("layer_first", P, np.array([1, 2, 3, 4]), range(0, 1)) is not None


# -- chunks and the staging bound --------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunks_are_whole_pages_within_a_slot(page_size):
    token_bytes = (K_TOKEN + V_TOKEN) * L
    for tokens in (page_size, 1000 * page_size):
        for slot in (token_bytes * page_size, 1 << 20, 32 << 20):
            chunk = schedule.chunk_tokens(tokens, token_bytes, page_size, slot)
            fits = slot // (token_bytes * page_size) * page_size  # whole pages a slot holds
            assert chunk % page_size == 0 and chunk * token_bytes <= slot and (chunk == 0) == (fits == 0)
            if chunk:
                assert -(-tokens // chunk) <= max(schedule.PIPELINE_CHUNKS, -(-tokens // fits))
    assert schedule.chunk_tokens(100, token_bytes, page_size, token_bytes * page_size - 1) == 0


def test_a_schedule_fits_its_slot_and_cuts_runs_at_chunks():
    P = 16
    idx = page_slots(range(10, 74), P)  # one run of 64 pages
    slot = 3 * L * P * (K_TOKEN + V_TOKEN) + schedule.STAGING_ALIGN
    staged_schedule = build("page_first_direct", P, idx, range(L), slot)
    assert staged_schedule.slot_bytes <= slot and staged_schedule.chunk_tokens == 3 * P
    assert len(staged_schedule.chunks) == 22 and [len(c) for c in staged_schedule.chunks][-1] == P
    k, _ = staged_schedule.copies
    assert len(k) == 22 and k.chunk_ends.tolist() == list(range(1, 23))
    assert build("page_first_direct", P, idx, range(L), L * P * (K_TOKEN + V_TOKEN) - 1) is None


@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunks_taper_to_a_small_tail_no_faster_than_the_kernel_keeps_up(page_size, to_device):
    """A load's chunks shrink toward its end (a backup's grow from its start) by no more than
    TAPER a step, down to about TAIL_BYTES: the kernel of the last chunk alone is the tail,
    and no copy waits for a slot.  Every chunk starts on a page, and a slot holds its pages."""
    token_bytes = (K_TOKEN + V_TOKEN)  # one layer: a per-layer load
    page_bytes = token_bytes * page_size
    for total, odd in ((100e6, 0), (800e6, 0), (3e6, 0), (page_bytes, 0), (100e6, page_size // 2), (3e6, page_size - 1)):
        tokens = max(page_size, int(total // page_bytes) * page_size) + odd  # odd: a token layout's last part page
        for slot in (32 << 20, 4 << 20, page_bytes):
            bounds = schedule.chunk_bounds(tokens, token_bytes, page_size, slot, to_device)
            sizes = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == tokens and (sizes > 0).all()
            assert (bounds[:-1] % page_size == 0).all(), "every chunk starts on a page"
            assert (-(-sizes // page_size) * page_size * token_bytes <= slot).all(), "a slot holds each chunk's pages"
            order = sizes if to_device else sizes[::-1]  # in the order the pipeline drains them
            full = schedule.chunk_tokens(tokens, token_bytes, page_size, slot)
            tail = max(page_size, -(-(schedule.TAIL_BYTES // token_bytes) // page_size) * page_size)
            if tokens >= 4 * full and full > 2 * tail:
                assert order[-1] <= tail + page_size, "the tail is one small chunk"
                shrink = order[1:] / order[:-1]
                assert (shrink >= schedule.TAPER - page_size / order[1:]).all(), "no chunk less than TAPER of the one before"
