"""The split K/V roundtrip that `portable-kv check` runs for every layout x io backend."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import backends
from .layout import LAYOUTS
from .pool import AsymmetricHostPool, DeviceKVPool


@dataclass
class CheckResult:
    layout: str
    io_backend: str
    passed: bool
    bytes_moved: int
    seconds: float
    detail: str = ""


def fill_random(t: torch.Tensor, generator: torch.Generator) -> None:
    """Random bit patterns (NaNs included): results are compared as bytes, never as floats."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=generator)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def roundtrip(layout: str, io_backend: str, *, layers: int = 4, tokens: int = 256, page_size: int = 16,
              k_heads: int = 4, k_dim: int = 192, v_heads: int = 4, v_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> CheckResult:
    """Back up device pages to host pages, zero the device, load them back per layer into
    other pages; K and V must come back byte-exact, every other token untouched."""
    gen = torch.Generator().manual_seed(seed)
    dev = DeviceKVPool(layers, tokens, page_size, k_heads, k_dim, v_dim, v_heads=v_heads, dtype=dtype)
    for buf in dev.k_buffer + dev.v_buffer:
        fill_random(buf, gen)
    original = [b.clone() for b in dev.k_buffer + dev.v_buffer]
    with AsymmetricHostPool(dev, host_to_device_ratio=2.0, layout=layout, io_backend=io_backend) as host:
        pages = tokens // page_size
        src_pages = torch.randperm(pages, generator=gen)[: pages // 2]
        host_pages = torch.randperm(host.page_num, generator=gen)[: src_pages.numel()]
        dst_pages = torch.randperm(pages, generator=gen)[: src_pages.numel()]
        offsets = torch.arange(page_size)
        src = (src_pages[:, None] * page_size + offsets).reshape(-1)
        host_idx = (host_pages[:, None] * page_size + offsets).reshape(-1)
        dst = (dst_pages[:, None] * page_size + offsets).reshape(-1)
        start = time.perf_counter()
        host.backup_from_device_all_layer(dev, host_idx, src)
        for buf in dev.k_buffer + dev.v_buffer:
            buf.zero_()
        for layer in range(layers):
            host.load_to_device_per_layer(dev, host_idx, dst, layer)
        host.backend.synchronize()
        seconds = time.perf_counter() - start
        moved = 2 * src.numel() * layers * (k_heads * k_dim + v_heads * v_dim) * dev.k_buffer[0].element_size()
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[dst] = False
    untouched = untouched.to(dev.device)
    for n, (got, want) in enumerate(zip(dev.k_buffer + dev.v_buffer, original)):
        name, layer = ("K" if n < layers else "V"), n % layers
        if not same_bytes(got[dst.to(got.device)], want[src.to(want.device)]):
            return CheckResult(layout, io_backend, False, moved, seconds, f"{name} of layer {layer} differs after the roundtrip")
        if got[untouched].view(torch.uint8).any():
            return CheckResult(layout, io_backend, False, moved, seconds, f"{name} of layer {layer}: a token outside the targets changed")
    return CheckResult(layout, io_backend, True, moved, seconds)


def run_check() -> list[CheckResult]:
    backend = backends.current()
    results = []
    for layout in LAYOUTS:
        for io in backend.io_backends:
            try:
                results.append(roundtrip(layout, io))
            except Exception as exc:  # a check reports every failure, it does not stop at the first
                results.append(CheckResult(layout, io, False, 0, 0.0, f"{type(exc).__name__}: {exc}"))
    return results
