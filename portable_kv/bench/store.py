"""L3 benchmark: a store's page put and get against its own bulk transfer of the same bytes.

`run(store="mooncake")` starts a loopback `mooncake_master` (unless `master`
is given), fills a host pool, and per page size times `put` and `get` of
`total_bytes` of pages under fresh keys; the ceiling of the same run is the
store's bulk transfer of those bytes from one buffer (Mooncake: the K and V
spans as two objects through the same client; local: one file written and
read back).  `run(store="local")` does the same with a LocalStore in a
temporary directory.  Rows are returned and a table with a legend printed;
`portable-kv bench --store mooncake|local` calls it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

import portable_kv as pk

from ..storage import LocalStore, MooncakeStore, PageStore
from ..storage.master import MooncakeMaster

GEOMETRY = {"layers": 16, "k_heads": 4, "k_dim": 192, "v_heads": 4, "v_dim": 128}


def run(
    store: str = "mooncake",
    *,
    page_sizes: tuple[int, ...] = (64, 16),
    total_bytes: int = 128 << 20,
    repeats: int = 3,
    layout: str = "page_first_direct",
    master: str | None = None,
    path: str | None = None,
    out: Callable[[str], Any] = print,
) -> list[dict]:
    """Put/get GB/s and pages/s per page size, with the bulk ceiling of the same run; prints a table (to `out`) and returns its rows."""
    if store not in ("mooncake", "local"):
        raise ValueError(f"store: expected 'mooncake' or 'local', got {store!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
    own_master = MooncakeMaster().start() if store == "mooncake" and master is None else None
    directory = path or tempfile.mkdtemp(prefix="portable_kv_bench_")
    try:
        rows = [_measure(store, P, total_bytes, repeats, layout, own_master.address if own_master else master, directory) for P in page_sizes]
    finally:
        if own_master is not None:
            own_master.stop()
        if path is None:
            shutil.rmtree(directory, ignore_errors=True)
    out(table(rows))
    return rows


def _measure(kind: str, page_size: int, total_bytes: int, repeats: int, layout: str, master: str | None, directory: str) -> dict:
    g = GEOMETRY
    token_bytes = g["layers"] * (g["k_heads"] * g["k_dim"] + g["v_heads"] * g["v_dim"]) * 2
    pages = max(1, total_bytes // (token_bytes * page_size))
    # The host pool holds the pages twice: the put sources, then the get targets.
    dev = pk.DeviceKVPool(g["layers"], pages * page_size, page_size, g["k_heads"], g["k_dim"], g["v_dim"], v_heads=g["v_heads"], dtype=torch.bfloat16, device="cpu")
    host = pk.AsymmetricHostPool(dev, host_to_device_ratio=2.0, layout=layout, io_backend="direct")
    for buffer in host.buffers:
        buffer.view(torch.int16).random_()
    moved = pages * token_bytes * page_size
    if kind == "mooncake":
        # Room for every repeat's pages and bulk objects: a benchmark must not measure eviction.
        segment_gb = max(0.0625, 2.5 * repeats * moved / (1 << 30))
        opened: PageStore = MooncakeStore(host, master=master, segment_size_gb=segment_gb)
    else:
        opened = LocalStore(host, directory)
    sources = _tokens(range(pages), page_size)
    targets = _tokens(range(pages, 2 * pages), page_size)
    spans = [pages * nbytes for nbytes in opened.object_bytes]
    put_s, get_s, bulk_put_s, bulk_get_s = [], [], [], []
    try:
        for _ in range(repeats):
            keys = [uuid.uuid4().hex for _ in range(pages)]
            put_s.append(_timed(_all, "put", opened.put, keys, sources))
            get_s.append(_timed(_all, "get", opened.get, keys, targets))
            bulk = _bulk_mooncake if kind == "mooncake" else _bulk_file
            put_time, get_time = bulk(opened, host, spans, directory)
            bulk_put_s.append(put_time)
            bulk_get_s.append(get_time)
    finally:
        opened.close()
        host.close()
    put, get = statistics.median(put_s), statistics.median(get_s)
    bulk_put, bulk_get = statistics.median(bulk_put_s), statistics.median(bulk_get_s)
    return {
        "store": kind,
        "layout": layout,
        "page_size": page_size,
        "pages": pages,
        "page_bytes": opened.page_bytes,
        "bytes": moved,
        "put_gbps": moved / put / 1e9,
        "get_gbps": moved / get / 1e9,
        "put_pages_per_s": pages / put,
        "get_pages_per_s": pages / get,
        "bulk_put_gbps": moved / bulk_put / 1e9,
        "bulk_get_gbps": moved / bulk_get / 1e9,
    }


def _bulk_mooncake(store: Any, host: Any, spans: list[int], directory: str) -> tuple[float, float]:
    client = store._client
    names = [f"{uuid.uuid4().hex}_bulk_{part}" for part in store.objects]
    sources = [buffer.data_ptr() for buffer in host.buffers]
    # The targets are the pool's second half, where the page gets landed.
    targets = [buffer.data_ptr() + span for buffer, span in zip(host.buffers, spans)]
    put_time = _timed(lambda: _codes(client.batch_put_from(names, sources, spans), "bulk put"))
    get_time = _timed(lambda: _codes(client.batch_get_into(names, targets, spans), "bulk get", expect=spans))
    return put_time, get_time


def _bulk_file(store: Any, host: Any, spans: list[int], directory: str) -> tuple[float, float]:
    name = os.path.join(directory, uuid.uuid4().hex + ".bulk")
    sources = [(buffer.data_ptr(), span) for buffer, span in zip(host.buffers, spans)]
    targets = [(buffer.data_ptr() + span, span) for buffer, span in zip(host.buffers, spans)]

    def write() -> None:
        with open(name, "wb") as out:
            for ptr, size in sources:
                out.write(memoryview((ctypes.c_char * size).from_address(ptr)).cast("B"))

    def read() -> None:
        with open(name, "rb") as src:
            for ptr, size in targets:
                src.readinto(memoryview((ctypes.c_char * size).from_address(ptr)).cast("B"))

    put_time, get_time = _timed(write), _timed(read)
    os.unlink(name)
    return put_time, get_time


def _tokens(pages: range, page_size: int) -> torch.Tensor:
    return (torch.tensor(list(pages))[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _timed(call: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def _all(what: str, operation: Callable[..., list[bool]], *args: Any) -> None:
    results = operation(*args)
    if not all(results):
        raise RuntimeError(f"bench: {results.count(False)} of {len(results)} pages failed to {what}; the store is too small or unreachable")


def _codes(results: list[int], what: str, expect: list[int] | None = None) -> None:
    if results != (expect or [0] * len(results)):
        raise RuntimeError(f"bench: {what} answered {results}")


def table(rows: list[dict]) -> str:
    """The rows as a markdown table with its legend."""
    lines = [
        "| store | layout | page | pages x MB | put GB/s (% bulk) | get GB/s (% bulk) | put pages/s | get pages/s | bulk put / get GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['layout']} | {r['page_size']} | {r['pages']} x {r['page_bytes'] / 1e6:.2f} "
            f"| {r['put_gbps']:.2f} ({100 * r['put_gbps'] / r['bulk_put_gbps']:.0f}%) | {r['get_gbps']:.2f} ({100 * r['get_gbps'] / r['bulk_get_gbps']:.0f}%) "
            f"| {r['put_pages_per_s']:.0f} | {r['get_pages_per_s']:.0f} | {r['bulk_put_gbps']:.2f} / {r['bulk_get_gbps']:.2f} |"
        )
    g = GEOMETRY
    lines += [
        "",
        f"Legend: bf16 pages of {g['layers']} layers, K {g['k_heads']}x{g['k_dim']}, V {g['v_heads']}x{g['v_dim']}; each cell the median of the repeats, "
        "every repeat under fresh keys (a stored key is not copied again). put: host pool -> store (the existence check included); "
        "get: store -> other host pages. bulk: the same bytes in one transfer from one buffer through the same store "
        "(mooncake: K and V spans as two objects, same client; local: one file written then read) - the ceiling of this run. "
        "mooncake: one process, loopback TCP, a master started by the bench (Mooncake copies within a process by memcpy); "
        "local: a directory (the page cache, unless the files outgrow it).",
    ]
    return "\n".join(lines)
