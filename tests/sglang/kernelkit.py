"""SGLang's kernel package, `sgl_kernel`, where it imports; else, on a GPU host, the stand-in of
tests/gpu/standins (whose every kernel raises, naming itself).

SGLang's modules import sgl_kernel at module level wherever CUDA is present (its quantization
layers, on the way to the pool assembler); on a CPU host they do not, and there a stand-in
could turn SGLang onto paths that call it, so it is put on sys.path only where a GPU is visible.
Spawned processes inherit the parent's sys.path, so SGLang's scheduler-like children see it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

STANDINS = Path(__file__).resolve().parents[1] / "gpu" / "standins"


def sgl_kernel_or_standin() -> str:
    """Which sgl_kernel SGLang gets here: "sgl_kernel", "stand-in", or "not needed (no GPU)"."""
    import torch

    if not torch.cuda.is_available():
        return "not needed (no GPU)"
    try:
        import sgl_kernel
    except Exception:  # not installed, or built for another torch or CUDA
        for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
            del sys.modules[name]
        if str(STANDINS) not in sys.path:
            sys.path.insert(0, str(STANDINS))
        return "stand-in"
    return "stand-in" if getattr(sgl_kernel, "__version__", "").endswith("+standin") else "sgl_kernel"
