"""What a section is handed: the run's settings, its clock and ceiling, and where to say what it does."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from .measure import Clock
from .progress import Progress
from .workload import Geometry


@dataclass
class Context:
    args: argparse.Namespace  # the command line, for a section's own flags
    geometry: Geometry
    sizes: list[int]  # --page-size
    names: list[str]  # the backends to measure, all on `device`
    device: torch.device
    clock: Clock
    ceil: dict  # the ceiling this run measured (sections.ceiling)
    reps: int  # timed calls per measurement, median kept
    layers: int  # of the MHA pools
    mla_layers: int  # of the MLA pools
    draws: int  # draws of each row beside compute (draws.py)
    progress: Progress

    @property
    def gpu(self) -> bool:
        return self.clock.gpu

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)
