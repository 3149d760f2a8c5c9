"""The host slot allocator: SGLang's contract, runs of consecutive pages, a model test."""

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from portable_kv.allocator import FreeListAllocator, PageRunAllocator, churn_run_lengths, page_runs

P = 4


def test_alloc_hands_out_cpu_int64_whole_pages_and_none_when_full():
    a = PageRunAllocator(8 * P, P)
    slots = a.alloc(3 * P)
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert slots.tolist() == list(range(3 * P))
    assert a.available_size() == 5 * P
    assert a.alloc(6 * P) is None
    assert a.available_size() == 5 * P  # a refused alloc takes nothing
    assert a.alloc(5 * P) is not None and a.available_size() == 0
    assert a.alloc(P) is None


def test_alloc_of_zero_is_empty():
    a = PageRunAllocator(2 * P, P)
    assert a.alloc(0).numel() == 0 and a.available_size() == 2 * P


@pytest.mark.parametrize("need", [1, P + 1, -P, 2.0 * P, True])
def test_alloc_of_a_non_page_multiple_raises(need):
    a = PageRunAllocator(8 * P, P)
    with pytest.raises(ValueError, match="need_size"):
        a.alloc(need)


def test_double_free_and_free_of_a_slot_never_allocated_raise_naming_the_slot():
    a = PageRunAllocator(8 * P, P)
    slots = a.alloc(2 * P)
    assert a.free(slots) == 2 * P
    with pytest.raises(ValueError, match=r"slot 0 is not allocated"):
        a.free(slots)
    with pytest.raises(ValueError, match=rf"slot {5 * P} is not allocated"):
        a.free(torch.tensor([5 * P]))
    with pytest.raises(ValueError, match="outside the pool"):
        a.free(torch.tensor([8 * P]))


def test_a_failed_free_changes_nothing():
    a = PageRunAllocator(8 * P, P)
    slots = a.alloc(2 * P)
    with pytest.raises(ValueError, match="more than once"):
        a.free(torch.cat([slots, slots[:1]]))
    assert a.available_size() == 6 * P
    assert a.free(slots) == 2 * P and a.available_size() == 8 * P


@pytest.mark.parametrize("given", [torch.tensor([0.9, 2.7]), torch.tensor([True, False]), None], ids=["float", "bool", "none"])
def test_free_refuses_what_is_not_integer_slots(given):
    """A float 2.7 would free slot 2 and True slot 1: slots a request still uses."""
    allocator = PageRunAllocator(16, 4)
    slots = allocator.alloc(8)
    with pytest.raises(TypeError, match="indices: expected integer token slots"):
        allocator.free(given)
    assert allocator.available_size() == 8
    assert allocator.free(slots) == 8


def test_numpy_integer_sizes_are_sizes():
    import numpy as np

    allocator = PageRunAllocator(16, 4)
    assert allocator.alloc(np.int64(4)).tolist() == [0, 1, 2, 3]


def test_free_merges_neighbours_into_one_run():
    a = PageRunAllocator(8 * P, P)
    parts = [a.alloc(2 * P) for _ in range(4)]
    for i in (0, 2, 1, 3):
        a.free(parts[i])
    assert a.runs() == [(0, 8)]


def test_best_fit_keeps_the_long_run_whole():
    a = PageRunAllocator(16 * P, P)
    parts = [a.alloc(n * P) for n in (2, 1, 8, 5)]
    a.free(parts[0])  # a 2-page hole at 0
    a.free(parts[2])  # an 8-page hole at 3
    assert a.alloc(2 * P).tolist() == list(range(2 * P))
    assert a.runs() == [(3, 8)]


def test_alloc_joins_the_longest_runs_when_none_fits():
    a = PageRunAllocator(10 * P, P)
    parts = [a.alloc(n * P) for n in (1, 1, 3, 1, 4)]
    for i in (0, 2, 4):
        a.free(parts[i])  # free runs of 1, 3 and 4 pages
    slots = a.alloc(7 * P)
    assert page_runs(slots, P) == [3, 4]
    assert a.runs() == [(0, 1)]


def test_a_page_returns_when_all_its_slots_are_freed():
    a = PageRunAllocator(2 * P, P)
    slots = a.alloc(2 * P)
    a.free(slots[:2])
    assert a.available_size() == 0
    a.free(slots[2:P])
    assert a.runs() == [(0, 1)]


def test_clear_frees_every_slot():
    a = PageRunAllocator(4 * P, P)
    a.alloc(3 * P)
    a.clear()
    assert a.runs() == [(0, 4)] and a.available_size() == 4 * P


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_matches_a_reference_free_set(ops):
    """Against the simplest model: a set of free slots and a list of live allocations."""
    pages = 16
    a = PageRunAllocator(pages * P, P)
    free = set(range(pages * P))
    live = []
    for is_alloc, n in ops:
        if is_alloc:
            slots = a.alloc(n * P)
            if n * P > len(free):
                assert slots is None
                continue
            got = slots.tolist()
            assert len(got) == n * P and set(got) <= free
            for start in range(0, len(got), P):
                assert got[start] % P == 0 and got[start:start + P] == list(range(got[start], got[start] + P))
            free -= set(got)
            live.append(slots)
        elif live:
            slots = live.pop(n % len(live))
            assert a.free(slots) == slots.numel()
            free |= set(slots.tolist())
        assert a.available_size() == len(free)
        assert sum(p for _, p in a.runs()) * P == len(free)
        runs = a.runs()
        assert all(f1 + p1 < f2 for (f1, p1), (f2, _) in zip(runs, runs[1:]))  # merged: no two runs touch


def test_threads_never_hand_out_a_slot_twice():
    a = PageRunAllocator(64 * P, P)
    owned = [[] for _ in range(4)]

    def worker(mine):
        for _ in range(200):
            slots = a.alloc(2 * P)
            if slots is not None:
                mine.append(slots)
            if len(mine) > 4:
                a.free(mine.pop(0))

    threads = [threading.Thread(target=worker, args=(o,)) for o in owned]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    held = torch.cat([s for mine in owned for s in mine])
    assert held.unique().numel() == held.numel()
    assert a.available_size() == 64 * P - held.numel()


def test_churn_reports_runs_longer_than_a_page():
    histogram = churn_run_lengths(page_num=512, page_size=P, allocations=2000, max_pages=32, seed=1)
    runs = sum(histogram.values())
    pages = sum(length * count for length, count in histogram.items())
    assert runs and pages / runs > 4  # a free list after churn hands out runs of about one page


def test_churn_rejects_allocations_larger_than_the_pool():
    with pytest.raises(ValueError, match="max_pages"):
        churn_run_lengths(page_num=8, max_pages=9)


def test_the_engine_device_allocator_model_keeps_the_padding_page_and_reuses_freed_pages_first():
    """FreeListAllocator (SGLang's device allocator, held to it in tests/sglang): page 0 stays
    out; a freed allocation's pages, ascending, are the next handed out."""
    model = FreeListAllocator(8 * 4, 4)
    first = model.alloc(3 * 4)
    assert first is not None and first[::4].tolist() == [4, 8, 12]
    rest = model.alloc(5 * 4)
    assert rest is not None and int(rest.max()) == 8 * 4 + 3 and model.alloc(4) is None
    model.free(first.flip(0))
    assert model.alloc(2 * 4)[::4].tolist() == [4, 8]
