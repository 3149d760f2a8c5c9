"""The GGUF kernels SGLang's quantization layer imports at module level where CUDA is present."""

from __future__ import annotations

from . import _standin

_NAMES = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
globals().update({name: _standin(name) for name in _NAMES})
__all__ = list(_NAMES)
