"""A stand-in for SGLang's CUDA kernel package, for GPU hosts where it is not installed.

SGLang's modules import ``sgl_kernel`` at module level wherever CUDA is present, for kernels that
the HiCache path under test never runs: the pool, allocator and controller modules pull in
SGLang's quantization and MoE layers on the way, and its own host pools bind the KV-cache copy
ops (``sgl_kernel.kvcacheio``).  With portable_kv's host pools installed, portable_kv moves every
byte between host and device, so any call into one of these means SGLang's own kernel was reached:
each raises and names itself rather than doing something quietly.

Only the names SGLang imports without a fallback are here.  Where SGLang catches the
ImportError and falls back (``sgl_kernel.scalar_type``, ``kvcacheio.get_device_accessible_ptr``),
the name is left out so that SGLang takes its fallback, as it would on a build without the kernel.
The GPU tests put this folder on ``sys.path`` only where the real package is not importable.
"""

from __future__ import annotations

from collections.abc import Callable

__version__ = "0.0.0+standin"


def _standin(name: str) -> Callable[..., None]:
    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"sgl_kernel stand-in: portable_kv moves every byte; SGLang's own kernel was called: {name}")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# Imported at module level where CUDA is present by SGLang's layers, which its memory pools,
# scheduler and model worker import: MoE and quantization (fused_moe, gguf, compressed_tensors
# w8a8_int8), RMSNorm (layernorm), gated activations (activation), the sampler.
_NAMES = (
    "moe_sum",
    "moe_sum_reduce",
    "int8_scaled_mm",
    "fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "silu_and_mul",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
)
globals().update({name: _standin(name) for name in _NAMES})

from . import kvcacheio, quantization  # noqa: E402  (the submodules use _standin)

__all__ = [*_NAMES, "kvcacheio", "quantization"]
