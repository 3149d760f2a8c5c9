"""Rows drawn several times, the paths of a table in turn, each reported as median and spread.

Beside the bench's matmul loop the GPU runs at its power cap, and a single draw of a
load beside it lands in one of two modes.  So such a row is drawn `draws` times, in turn
with the other paths of its table (path A's first draw, path B's first, ..., path A's
second, ...), so that a drift over the run falls on every path alike; a row reports
the median of each measure and its spread, the least and the most of the draws.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from .progress import Progress

DRAWS = 5  # --draws' default


def alternate(paths: Sequence[str], draw: Callable[[str], dict[str, float]], draws: int, progress: Progress,
              what: str) -> dict[str, list[dict[str, float]]]:
    """`draws` draws of every path, the paths in turn; per path its draws in order."""
    drawn: dict[str, list[dict[str, float]]] = {path: [] for path in paths}
    progress.expect(draws * len(paths))
    for n in range(draws):
        for path in paths:
            drawn[path].append(draw(path))
            progress.done(f"{what}: {path}, draw {n + 1} of {draws}")
    return drawn


def summarize(draws: list[dict[str, float]]) -> dict[str, float]:
    """Each measure's median under its own name and its spread as `<name>_min` and `<name>_max`;
    `draws`: how many there were."""
    out: dict[str, float] = {"draws": len(draws)}
    for key in draws[0]:
        values = [d[key] for d in draws]
        out[key] = statistics.median(values)
        out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def spread_text(extra: dict, key: str, fmt: str = ".1f", single: float | None = None) -> str:
    """'median (least to most)' of a summarized measure; of one drawn once, its value (`single`
    where the row keeps it outside its extras)."""
    if f"{key}_min" not in extra:
        return format(extra.get(key, 0.0) if single is None else single, fmt)
    return f"{format(extra[key], fmt)} ({format(extra[f'{key}_min'], fmt)} to {format(extra[f'{key}_max'], fmt)})"
