"""The page-store interface an engine calls, and what every store shares.

An engine names each page by a key (SGLang's: a hash of the page's tokens and
its prefix) and says where the page lives in the host pool by all of its
token indices.  A store moves a page as one object per buffer of the pool, as
SGLang 0.5.23's Mooncake backend does: an MHA page as `{name}_k` and
`{name}_v`, an MLA page as one `{name}_k`, where `name` adds the model and the
rank to the key as SGLang names them (an MLA page without the tensor-parallel
rank: every rank holds the same latent).  Each object holds its buffer's block
in the layout's own byte order (docs/API.md, "Pages for storage tiers"), so
SGLang reads what portable_kv stored and the reverse.

Pages that are contiguous in the host pool (`page_first`, `page_first_direct`,
`page_head`) move straight from and to the pool at the addresses
`host.get_page_buffer_meta` gives; `layer_first` pages, one run per layer, go
through a staging buffer of whole pages in the `page_first_direct` order (what
SGLang's flat page of a `layer_first` pool is, and the bytes of its MLA
object, which SGLang puts from the page's layers in turn).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layout import canonical_view

STAGED_LAYOUTS = ("layer_first",)
# Staging is bounded so that a store over a large layer_first pool holds at most this much extra memory.
STAGING_BYTES = 64 << 20
# SGLang's object suffixes of a page, one per buffer of the pool, by pool kind.
PAGE_OBJECTS = {"MHA": ("k", "v"), "MLA": ("k",)}


def key_prefix(model_name: str, backend_tag: str) -> str:
    """SGLang's namespace of a store: `{backend_tag}_{model}` with `/` in the model name as `-`; either part may be empty."""
    parts = [part for part in (backend_tag, "-".join(model_name.split("/"))) if part]
    return "_".join(parts)


def rank_suffix(tp_rank: int, pp_rank: int | None, kind: str = "MHA") -> str:
    """SGLang's rank suffix of a page.  MHA: the tensor-parallel rank, or `{tp}_{pp}` under
    pipeline parallelism.  MLA: none, or the pipeline rank (every tensor-parallel rank holds the
    same latent, so SGLang stores it once)."""
    if kind == "MLA":
        return "" if pp_rank is None else f"{pp_rank}"
    return f"{tp_rank}" if pp_rank is None else f"{tp_rank}_{pp_rank}"


@dataclass(frozen=True)
class PageBatch:
    """Where a run of pages' blocks are while a store moves them, one list of addresses per object (K, V; or the latent)."""

    first: int  # position of the run's first page in the caller's batch
    ptrs: tuple[list[int], ...]
    pages: np.ndarray  # host page numbers of the run
    staged: bool  # True: the pointers are the staging buffer's, not the pool's


class PageStore(ABC):
    """A store of KV pages beyond the host pool, driven by page keys and host token indices.

    Subclasses move objects; this class checks the arguments (before any byte
    moves), names the objects, finds the pages' bytes and stages them where a
    layout does not keep a page contiguous.
    """

    def __init__(self, host: Any, *, model_name: str = "", tp_rank: int = 0, pp_rank: int | None = None, backend_tag: str = "") -> None:
        for name in ("kind", "buffers", "layout", "page_size", "page_num", "get_page_buffer_meta"):
            if not hasattr(host, name):
                raise TypeError(f"host: expected an AsymmetricHostPool or MLAHostPool (missing {name!r}), got {type(host).__name__}")
        if getattr(host, "closed", False) or not host.buffers:
            raise ValueError("host: the pool is closed")
        for name, value in (("model_name", model_name), ("backend_tag", backend_tag)):
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
        self.tp_rank = _rank("tp_rank", tp_rank)
        self.pp_rank = None if pp_rank is None else _rank("pp_rank", pp_rank)
        self.host = host
        self.page_size = int(host.page_size)
        self.prefix = key_prefix(model_name, backend_tag)
        self.suffix = rank_suffix(self.tp_rank, self.pp_rank, host.kind.name)
        self.objects = PAGE_OBJECTS[host.kind.name]
        views = [canonical_view(buffer, host.layout, self.page_size) for buffer in host.buffers]
        self.object_bytes = tuple(view[0].numel() * view.element_size() for view in views)
        self.staged = host.layout in STAGED_LAYOUTS
        self._stages: list[torch.Tensor] = []
        self._stage = None
        if self.staged:
            pages = max(1, min(int(host.page_num), STAGING_BYTES // self.page_bytes))
            # Ordinary tensors and views even for a store made under torch.inference_mode():
            # its calls write the stage from any thread, outside that mode.
            with torch.inference_mode(False):
                self._stage = torch.empty(pages * self.page_bytes, dtype=torch.uint8)
                start = 0
                for view, nbytes in zip(views, self.object_bytes):
                    # (page, layer, token, head, dim): SGLang's flat-page order of a layer_first pool.
                    region = self._stage[start : start + pages * nbytes].view(view.dtype)
                    self._stages.append(region.view(pages, view.shape[2], self.page_size, *view.shape[3:]))
                    start += pages * nbytes
        self.closed = False

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, every object."""
        return sum(self.object_bytes)

    def object_names(self, keys: Sequence[str]) -> list[str]:
        """The name each page key is stored under, before its `_k` / `_v`: `{prefix}_{key}_{rank}` as SGLang names it."""
        head = f"{self.prefix}_" if self.prefix else ""
        return [f"{head}{key}_{self.suffix}" for key in keys]

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys have every object stored (SGLang's `batch_exists`); a failed lookup counts as a miss."""
        self._check_usable()
        names = self.object_names(_keys(keys))
        found = self._exist(names)
        hits = 0
        while hits < len(found) and found[hits]:
            hits += 1
        return hits

    def put(self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]) -> list[bool]:
        """Store pages from the host pool: `keys[i]` is the page at `host_indices[i*P:(i+1)*P]` (all of its tokens).

        Returns one bool per page: True when every object of it is in
        the store afterwards (a key already stored counts as stored and is not
        copied again), False where the store refused it (full, unreachable).
        A key named more than once in the batch is stored once, from the last
        page named for it; every position of that key gets its result.
        """
        self._check_usable()
        names, pages = self._check_batch(keys, host_indices, unique=False)
        once = _positions(names, last=True)
        if len(once) == len(names):
            return self._put_pages(names, host_indices, pages)
        stored = self._put_pages([names[i] for i in once], self._tokens(pages[once]), pages[once])
        by_name = dict(zip((names[i] for i in once), stored))
        return [by_name[name] for name in names]

    def get(self, keys: Sequence[str], host_indices: torch.Tensor | Sequence[int]) -> list[bool]:
        """Read pages into the host pool at `host_indices` (all tokens of each page, in key order).

        Returns one bool per page: True where every object of it arrived.  No
        byte outside the named pages changes; a page reported False may have
        received part of its bytes (its slots are the caller's destination,
        so the caller treats them as not loaded).  A key named more than once
        is read once and its page copied to each of its destinations.
        """
        self._check_usable()
        names, pages = self._check_batch(keys, host_indices, unique=True)
        once = _positions(names, last=False)
        if len(once) == len(names):
            return self._get_pages(names, host_indices, pages)
        # Mooncake's batch_get_into fills only one of several destinations of one object (and
        # reports all of them read), so each key is read once and copied within the pool.
        arrived = self._get_pages([names[i] for i in once], self._tokens(pages[once]), pages[once])
        source = {names[i]: (int(pages[i]), ok) for i, ok in zip(once, arrived)}
        copies = [(source[name][0], int(page)) for name, page in zip(names, pages) if source[name][1] and source[name][0] != page]
        if copies:
            self._copy_pages(*zip(*copies))
        return [source[name][1] for name in names]

    def _put_pages(self, names: list[str], host_indices: Any, pages: np.ndarray) -> list[bool]:
        stored: list[bool] = []
        for batch in self._batches(host_indices, pages):
            if batch.staged:
                self._gather(batch.pages)
            stored += self._put(names[batch.first : batch.first + len(batch.pages)], batch.ptrs)
        return stored

    def _get_pages(self, names: list[str], host_indices: Any, pages: np.ndarray) -> list[bool]:
        arrived: list[bool] = []
        for batch in self._batches(host_indices, pages):
            got = self._get(names[batch.first : batch.first + len(batch.pages)], batch.ptrs)
            if batch.staged:
                self._scatter(batch.pages, got)
            arrived += got
        return arrived

    def _tokens(self, pages: np.ndarray) -> torch.Tensor:
        """All token indices of `pages`, as an engine passes them."""
        return torch.from_numpy((pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1))

    # The copies within the pool record no autograd history, whatever the caller's mode.
    @torch.no_grad()
    def _copy_pages(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        src, dst = torch.tensor(sources), torch.tensor(targets)
        for buffer in self.host.buffers:
            view = canonical_view(buffer, self.host.layout, self.page_size)
            view[dst] = view[src]

    def close(self) -> None:
        """Release what the store holds (registrations, connections); idempotent.  Close the store before its host pool."""
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _exist(self, names: list[str]) -> list[bool]: ...

    @abstractmethod
    def _put(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]:
        """Store each named page from its objects' addresses (`ptrs[j][i]`: object j of page i)."""

    @abstractmethod
    def _get(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _check_usable(self) -> None:
        if self.closed:
            raise ValueError(f"{type(self).__name__}: the store is closed")
        if getattr(self.host, "closed", False) or not self.host.buffers:
            raise ValueError(f"{type(self).__name__}: its host pool was closed; close the store first")

    def _check_batch(self, keys: Sequence[str], host_indices: Any, unique: bool) -> tuple[list[str], np.ndarray]:
        keys = _keys(keys)
        tokens = _token_array(host_indices)
        P = self.page_size
        if tokens.size != len(keys) * P:
            raise ValueError(f"host_indices: expected len(keys) * page_size = {len(keys)} * {P} = {len(keys) * P} token indices, got {tokens.size}")
        runs = tokens.reshape(len(keys), P)
        firsts = runs[:, 0]
        size = int(self.host.page_num) * P
        broken = ((firsts % P) != 0) | (firsts < 0) | (firsts >= size) | (runs != firsts[:, None] + np.arange(P)).any(axis=1)
        if broken.any():
            bad = int(np.flatnonzero(broken)[0])
            raise ValueError(f"host_indices: expected each run of {P} to be one whole page (first token a multiple of {P} in [0, {size}), then consecutive); run {bad} starts {runs[bad].tolist()[:4]}")
        pages = firsts // P
        if unique and np.unique(pages).size != pages.size:
            raise ValueError("host_indices: a page is named twice; a get needs one destination per page")
        return self.object_names(keys), pages

    def _batches(self, host_indices: Any, pages: np.ndarray) -> Iterator[PageBatch]:
        if not pages.size:
            return
        n = len(self.objects)
        if not self.staged:
            ptrs, sizes = self.host.get_page_buffer_meta(host_indices)
            if len(ptrs) != n * pages.size or tuple(sizes[:n]) != self.object_bytes:
                raise RuntimeError(
                    f"host.get_page_buffer_meta: expected {n} blocks per page ({n * pages.size} pointers of {self.object_bytes} bytes), "
                    f"got {len(ptrs)} pointers, sizes {sizes[:n]}"
                )
            yield PageBatch(0, tuple(ptrs[j::n] for j in range(n)), pages, False)
            return
        chunk = self._stages[0].shape[0]
        for first in range(0, pages.size, chunk):
            run = pages[first : first + chunk]
            yield PageBatch(first, tuple([stage.data_ptr() + i * nbytes for i in range(run.size)] for stage, nbytes in zip(self._stages, self.object_bytes)),
                            run, True)

    @torch.no_grad()
    def _gather(self, pages: np.ndarray) -> None:
        index = torch.from_numpy(pages)
        for stage, buffer in zip(self._stages, self.host.buffers):
            # canonical (page, token, layer, ...) -> the stage's (page, layer, token, ...)
            stage[: pages.size].copy_(canonical_view(buffer, self.host.layout, self.page_size)[index].transpose(1, 2))

    @torch.no_grad()
    def _scatter(self, pages: np.ndarray, arrived: list[bool]) -> None:
        mask = torch.tensor(arrived, dtype=torch.bool)
        if not mask.any():
            return
        index = torch.from_numpy(pages)[mask]
        for stage, buffer in zip(self._stages, self.host.buffers):
            view = canonical_view(buffer, self.host.layout, self.page_size)
            view[index] = stage[: pages.size][mask].transpose(1, 2)


def _rank(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def _positions(names: list[str], last: bool) -> np.ndarray:
    """Positions of each name's first (or last) occurrence, in batch order."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if last or name not in seen:
            seen[name] = i
    return np.array(sorted(seen.values()), dtype=np.int64)


def _keys(keys: Any) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys: expected a list of str, got {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise TypeError(f"keys: expected non-empty str keys, got {key!r} at position {i}")
    return list(keys)


def _token_array(host_indices: Any) -> np.ndarray:
    if isinstance(host_indices, torch.Tensor):
        if host_indices.dim() != 1 or host_indices.dtype.is_floating_point or host_indices.dtype.is_complex or host_indices.dtype == torch.bool:
            raise TypeError(f"host_indices: expected a 1-D integer tensor, got {host_indices.dtype} of shape {tuple(host_indices.shape)}")
        return host_indices.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(host_indices, Sequence) and not isinstance(host_indices, (str, bytes)):
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in host_indices):
            raise TypeError("host_indices: expected a list of ints")
        return np.asarray(host_indices, dtype=np.int64).reshape(-1)
    raise TypeError(f"host_indices: expected a 1-D integer tensor or a list of ints, got {type(host_indices).__name__}")
