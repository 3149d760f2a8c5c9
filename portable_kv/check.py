"""`portable-kv check`: the split K/V roundtrip, and MLA's latent one, for every layout x io path, and an L3 round trip."""

from __future__ import annotations

import importlib.util
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

import portable_kv as pk

from . import backends
from .testing import bits, page_tokens, randomize


@dataclass
class CheckResult:
    layout: str
    io_backend: str
    passed: bool
    bytes_moved: int
    seconds: float
    detail: str = ""
    pool: str = "MHA"  # the kind of pool: MHA (K and V) or MLA (the latent)


@dataclass(frozen=True)
class Geometry:
    """The roundtrip's pools: small, with K and V of different head_dim (the case this package exists for),
    and an MLA pool of DeepSeek-V3's latent row (512 + 64)."""

    layers: int = 4
    tokens: int = 256
    page_size: int = 16
    k_heads: int = 4
    k_dim: int = 192
    v_heads: int = 4
    v_dim: int = 128
    latent_dim: int = 576
    dtype: torch.dtype = torch.bfloat16


GEOMETRY = Geometry()


def device_pool(pool: str, g: Geometry) -> Any:
    if pool == "MLA":
        return pk.MLADevicePool(g.layers, g.tokens, g.page_size, g.latent_dim, g.dtype)
    return pk.DeviceKVPool(g.layers, g.tokens, g.page_size, g.k_heads, g.k_dim, g.v_dim, v_heads=g.v_heads, dtype=g.dtype)


def host_pool(dev: Any, **kwargs: Any) -> Any:
    return (pk.MLAHostPool if dev.kind.name == "MLA" else pk.AsymmetricHostPool)(dev, **kwargs)


def roundtrip(layout: str, io_backend: str, geometry: Geometry = GEOMETRY, seed: int = 0, pool: str = "MHA") -> CheckResult:
    """Back up device pages to host pages, zero the device, load them back per layer into
    other pages; every buffer (K and V, or the latent) must come back byte-exact, every other token untouched."""
    g = geometry
    gen = torch.Generator().manual_seed(seed)
    dev = device_pool(pool, g)
    buffers = [(name, getattr(dev, name)) for name in dev.kind.buffers]
    for _, layers in buffers:
        for buf in layers:
            randomize(buf, gen)
    original = [[bits(b) for b in layers] for _, layers in buffers]
    with host_pool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io_backend) as host:
        pages = g.tokens // g.page_size
        src_pages = torch.randperm(pages, generator=gen)[: pages // 2]
        src = page_tokens(src_pages, g.page_size)
        host_idx = page_tokens(torch.randperm(host.page_num, generator=gen)[: src_pages.numel()], g.page_size)
        dst = page_tokens(torch.randperm(pages, generator=gen)[: src_pages.numel()], g.page_size)
        start = time.perf_counter()
        host.backup_from_device_all_layer(dev, host_idx, src)
        for _, layers in buffers:
            for buf in layers:
                buf.zero_()
        for layer in range(g.layers):
            host.load_to_device_per_layer(dev, host_idx, dst, layer)
        host.backend.synchronize()
        seconds = time.perf_counter() - start
        moved = 2 * src.numel() * host.token_bytes
    untouched = torch.ones(g.tokens, dtype=torch.bool)
    untouched[dst] = False
    for (name, layers), originals in zip(buffers, original):
        for layer, (got, want) in enumerate(zip(layers, originals)):
            got = bits(got)
            if not torch.equal(got[dst], want[src]):
                return CheckResult(layout, io_backend, False, moved, seconds, f"{name} of layer {layer} differs after the roundtrip", pool)
            if got[untouched].any():
                return CheckResult(layout, io_backend, False, moved, seconds, f"{name} of layer {layer}: a token outside the targets changed", pool)
    return CheckResult(layout, io_backend, True, moved, seconds, pool=pool)


def table(results: list[CheckResult]) -> list[str]:
    """`portable-kv check`'s table: a header and a row per result, each column as wide as its widest cell."""
    cells = [("pool", "layout", "io", "result", "bytes moved", "detail")]
    cells += [(r.pool, r.layout, r.io_backend, "PASS" if r.passed else "FAIL", str(r.bytes_moved), r.detail) for r in results]
    widths = [max(len(row[column]) for row in cells) for column in range(5)]
    return [f"{pool:<{widths[0]}}  {layout:<{widths[1]}}  {io:<{widths[2]}}  {result:<{widths[3]}}  {moved:>{widths[4]}}  {detail}".rstrip()
            for pool, layout, io, result, moved, detail in cells]


def run_check() -> list[CheckResult]:
    backend = backends.current()
    results = []
    for pool, layouts in (("MHA", pk.LAYOUTS), ("MLA", pk.MLAHostPool.layouts)):
        for layout in layouts:
            for io in backend.io_backends:
                try:
                    results.append(roundtrip(layout, io, pool=pool))
                except Exception as exc:  # a check reports every failure, it does not stop at the first
                    results.append(CheckResult(layout, io, False, 0, 0.0, f"{type(exc).__name__}: {exc}", pool))
    return results


def storage_check(geometry: Geometry = GEOMETRY, seed: int = 0) -> list[CheckResult]:
    """Pages of either pool kind put to the embedded local L3 store and got back into other
    host pages, byte-exact; no row where this install has no storage tier."""
    if importlib.util.find_spec("portable_kv.storage") is None:
        return []
    results = [_storage_roundtrip(pool, geometry, seed) for pool in ("MHA", "MLA")]
    return [r for r in results if r is not None]


def _storage_roundtrip(pool: str, g: Geometry, seed: int) -> CheckResult | None:
    layout = "page_first_direct"
    start = time.perf_counter()
    try:
        from . import storage

        if not hasattr(storage, "LocalStore"):
            return None
        gen = torch.Generator().manual_seed(seed)
        with host_pool(device_pool(pool, g), host_to_device_ratio=2.0, layout=layout) as host, tempfile.TemporaryDirectory() as path:
            for buffer in host.buffers:
                randomize(buffer, gen)
            pages = torch.randperm(host.page_num, generator=gen)
            half = host.page_num // 2
            src, dst = page_tokens(pages[:half], g.page_size), page_tokens(pages[half:2 * half], g.page_size)
            keys = [f"check-{seed}-{i}" for i in range(half)]
            with storage.LocalStore(host, path) as store:
                stored, read = store.put(keys, src), store.get(keys, dst)
            moved = 2 * half * g.page_size * host.token_bytes
            src_pages, dst_pages = pages[:half], pages[half:2 * half]
            same = all(torch.equal(b[dst_pages], b[src_pages]) for b in map(bits, host.buffers))
    except Exception as exc:  # reported as a FAIL row like the roundtrips above
        return CheckResult(layout, "L3 local", False, 0, time.perf_counter() - start, f"{type(exc).__name__}: {exc}", pool)
    seconds = time.perf_counter() - start
    if not all(stored) or not all(read):
        detail = f"{stored.count(False)} of {half} puts and {read.count(False)} gets failed"
        return CheckResult(layout, "L3 local", False, moved, seconds, detail, pool)
    detail = "put and got back through the local store" if same else "pages read back from the local store differ"
    return CheckResult(layout, "L3 local", same, moved, seconds, detail, pool)
