"""Host slot allocation with SGLang's contract, handing out runs of consecutive pages.

SGLang's host pool keeps a free list of token slots: after some churn an
allocation is scattered over the whole pool, one page here, one there.  Here
the free pages are kept as sorted runs ``(first_page, pages)``: an allocation
takes the smallest run that holds it (best fit keeps the long runs long), and
only when none does it joins the longest runs; a free merges a run with its
neighbours.  Long host runs are what lets a transfer become a few bulk copies.

Slots are token indices; pages are ``page_size`` consecutive slots starting at a
multiple of ``page_size``.  A page returns to the free runs when every one of
its slots has been freed.
"""

from __future__ import annotations

import bisect
import random
import threading
from collections import Counter, deque

import numpy as np
import torch


class PageRunAllocator:
    """Token-slot allocator over ``size`` slots in pages of ``page_size``; thread-safe."""

    def __init__(self, size: int, page_size: int) -> None:
        if page_size <= 0 or size <= 0 or size % page_size:
            raise ValueError(f"size: expected a positive multiple of page_size={page_size}, got {size}")
        self.size = size
        self.page_size = page_size
        self.page_num = size // page_size
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Every slot free again: one run over the whole pool."""
        with self._lock:
            self._run_starts = [0]
            self._run_pages = {0: self.page_num}
            self._free_pages = self.page_num
            self._slot_used = np.zeros(self.size, dtype=bool)
            self._page_used = np.zeros(self.page_num, dtype=np.int64)

    def available_size(self) -> int:
        """Slots an `alloc` can hand out now (whole free pages)."""
        return self._free_pages * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` CPU int64 token slots, whole pages, or None if they are not free."""
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0 or need_size % self.page_size:
            raise ValueError(f"need_size: expected a non-negative multiple of page_size={self.page_size}, got {need_size!r}")
        need = int(need_size) // self.page_size
        with self._lock:
            if need > self._free_pages:
                return None
            pages = [np.arange(first, first + count) for first, count in self._take(need)]
            pages = np.concatenate(pages) if pages else np.empty(0, dtype=np.int64)
            self._page_used[pages] = self.page_size
            slots = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
            self._slot_used[slots] = True
            return torch.from_numpy(slots)

    def free(self, indices: torch.Tensor) -> int:
        """Release token slots; returns how many.  A slot not allocated (or given twice) raises ValueError."""
        if indices is None:
            raise TypeError("indices: expected integer token slots (a tensor, array or list), got None")
        given = torch.as_tensor(indices)
        if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
            # A float 2.7 would free slot 2, True slot 1: slots another request still uses.
            raise TypeError(f"indices: expected integer token slots, got dtype {given.dtype}")
        slots = given.reshape(-1).to("cpu", torch.int64).numpy()
        if slots.size == 0:
            return 0
        with self._lock:
            outside = (slots < 0) | (slots >= self.size)
            if outside.any():
                raise ValueError(f"indices: slot {int(slots[outside][0])} is outside the pool [0, {self.size})")
            free_given = ~self._slot_used[slots]
            if free_given.any():
                raise ValueError(f"indices: slot {int(slots[free_given][0])} is not allocated (double free, or never allocated)")
            unique, counts = np.unique(slots, return_counts=True)
            if unique.size != slots.size:
                raise ValueError(f"indices: slot {int(unique[counts > 1][0])} is given more than once")
            self._slot_used[slots] = False
            pages, released = np.unique(slots // self.page_size, return_counts=True)
            self._page_used[pages] -= released
            self._give_back(pages[self._page_used[pages] == 0].tolist())
            return int(slots.size)

    def runs(self) -> list[tuple[int, int]]:
        """The free runs as (first_page, pages), in page order."""
        with self._lock:
            return [(first, self._run_pages[first]) for first in self._run_starts]

    # -- runs ---------------------------------------------------------------------------

    def _take(self, need: int) -> list[tuple[int, int]]:
        if need == 0:
            return []
        best = None
        for first in self._run_starts:
            pages = self._run_pages[first]
            if pages >= need and (best is None or pages < self._run_pages[best]):
                best = first
                if pages == need:
                    break
        if best is not None:
            self._remove_head(best, need)
            return [(best, need)]
        taken = []
        for first in sorted(self._run_starts, key=self._run_pages.__getitem__, reverse=True):
            pages = min(self._run_pages[first], need)
            self._remove_head(first, pages)
            taken.append((first, pages))
            need -= pages
            if need == 0:
                break
        return sorted(taken)

    def _remove_head(self, first: int, pages: int) -> None:
        left = self._run_pages.pop(first) - pages
        i = bisect.bisect_left(self._run_starts, first)
        if left:
            self._run_starts[i] = first + pages
            self._run_pages[first + pages] = left
        else:
            del self._run_starts[i]
        self._free_pages -= pages

    def _give_back(self, pages: list[int]) -> None:
        """Insert freed pages (sorted, unique) as runs, merged with their neighbours."""
        run_first = None
        for page, nxt in zip(pages, pages[1:] + [None]):
            if run_first is None:
                run_first = page
            if nxt != page + 1:
                self._insert(run_first, page + 1 - run_first)
                run_first = None

    def _insert(self, first: int, pages: int) -> None:
        self._free_pages += pages
        i = bisect.bisect_left(self._run_starts, first)
        if i < len(self._run_starts) and self._run_starts[i] == first + pages:
            pages += self._run_pages.pop(first + pages)
            del self._run_starts[i]
        if i and self._run_starts[i - 1] + self._run_pages[self._run_starts[i - 1]] == first:
            self._run_pages[self._run_starts[i - 1]] += pages
        else:
            self._run_starts.insert(i, first)
            self._run_pages[first] = pages


class FreeListAllocator:
    """Device pages as an engine hands them out: SGLang 0.5.23's PagedTokenToKVPoolAllocator
    with its default (no sorting), a free list whose head is handed out and to whose head a
    freed allocation's pages return in ascending order.  Page 0 is never handed out (SGLang
    keeps it for padded tokens).  The bench places device pages with it; a test holds it to
    SGLang's own allocator, slot for slot."""

    def __init__(self, size: int, page_size: int) -> None:
        if page_size <= 0 or size <= 0 or size % page_size:
            raise ValueError(f"size: expected a positive multiple of page_size={page_size}, got {size}")
        self.page_size = page_size
        self.free_pages = torch.arange(1, size // page_size + 1, dtype=torch.int64)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = need_size // self.page_size
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return (taken[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        self.free_pages = torch.cat((torch.unique(slots // self.page_size), self.free_pages))


def page_runs(slots: torch.Tensor, page_size: int) -> list[int]:
    """Lengths, in pages, of the runs of consecutive pages in an allocation of whole pages."""
    pages = (slots[::page_size] // page_size).tolist()
    lengths, length = [], 0
    for previous, page in zip([None] + pages, pages):
        if previous is not None and page == previous + 1:
            length += 1
        else:
            if length:
                lengths.append(length)
            length = 1
    if length:
        lengths.append(length)
    return lengths


def churn_run_lengths(
    page_num: int = 4096,
    page_size: int = 64,
    allocations: int = 20000,
    max_pages: int = 64,
    seed: int = 0,
) -> dict[int, int]:
    """Run lengths an engine's host pool sees after churn.

    Allocates prefixes of 1..``max_pages`` pages (uniform); when the pool is
    full, frees the least recently allocated prefixes until the next fits (an
    LRU cache's eviction), then allocates again.  Returns ``{run length in
    pages: how many runs}`` over all allocations after the pool first filled
    (the steady state, not the easy start on an empty pool).
    """
    if not 0 < max_pages <= page_num:
        raise ValueError(f"max_pages: expected 1..page_num={page_num}, got {max_pages}")
    allocator = PageRunAllocator(page_num * page_size, page_size)
    rng = random.Random(seed)
    live: deque[torch.Tensor] = deque()
    histogram: Counter[int] = Counter()
    filled = False
    for _ in range(allocations):
        need = rng.randint(1, max_pages) * page_size
        slots = allocator.alloc(need)
        while slots is None:
            filled = True
            allocator.free(live.popleft())
            slots = allocator.alloc(need)
        live.append(slots)
        if filled:
            histogram.update(page_runs(slots, page_size))
    return dict(sorted(histogram.items()))
