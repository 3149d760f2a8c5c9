"""A run's rows and the labels every table of them shares (report.py, engine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    section: str
    name: str
    direction: str  # "h2d" | "d2h" | "both" | "-"
    page_size: int = 0
    gbps: float = 0.0
    pct_ceiling: float = 0.0  # 0 where the ceiling means nothing (CPU backend)
    host_us: float = 0.0  # host CPU time per call (enqueue only)
    grid: int = 0  # block quota of the kernel path: the most SMs (CUs) a call occupies
    extra: dict = field(default_factory=dict)


def on_gpu(meta: dict) -> bool:
    return meta["gpu"] != "none"


def device_label(meta: dict) -> str:
    return meta["gpu"] if on_gpu(meta) else f"{meta['device']} (CPU backend: says nothing about GPUs)"


def ceiling_text(meta: dict) -> str:
    ceil = meta["ceiling"]
    if not on_gpu(meta):
        return f"ceiling (one host memcpy of the same bytes): {ceil.get('memcpy', ceil.get('h2d', 0.0)):.1f} GB/s"
    parts = [f"{ceil[key]:.1f} {label}" for key, label in (("h2d", "H2D"), ("d2h", "D2H"), ("both", "both ways at once")) if key in ceil]
    return "ceiling (one bulk page-locked memcpy): " + ", ".join(parts) + " GB/s"
