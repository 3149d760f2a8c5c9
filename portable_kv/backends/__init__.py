"""Backend registry: detection once, at first use, then current() / available() / use().

The registry knows backends by name only; each backend module says itself
whether it can run here (Backend.unavailable_reason) and holds every vendor
detail.  Order of detection (docs/API.md): PORTABLE_KV_BACKEND, then ROCm, then
CUDA, then the CPU reference.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from .. import config
from .base import Backend, BackendUnavailable

# name -> module:class, imported only when asked for, so that a CPU-only
# install never imports a vendor binding.
_REGISTRY = {
    "cuda": "portable_kv.backends.cuda:CudaBackend",
    "rocm": "portable_kv.backends.rocm:RocmBackend",
    "triton": "portable_kv.backends.triton:TritonBackend",
    "cpu": "portable_kv.backends.cpu:CpuBackend",
}
ENV_VAR = config.BACKEND.name

_current: Backend | None = None
_instances: dict[str, Backend] = {}


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _backend_class(name: str) -> type[Backend]:
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {', '.join(_REGISTRY)}, got {name!r}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(name: str) -> str | None:
    """None when backend `name` can run here, else the reason it cannot."""
    try:
        return _backend_class(name).unavailable_reason()
    except ImportError as exc:
        return f"its module failed to import: {exc}"


def available() -> list[str]:
    """Names of the backends usable on this machine, GPU backends first."""
    return [name for name in _REGISTRY if unavailable_reason(name) is None]


def get(name: str) -> Backend:
    """The (cached) instance of a usable backend; ValueError when it cannot run here."""
    if name not in _instances:
        reason = unavailable_reason(name)
        if reason is not None:
            raise ValueError(f"backend {name!r} cannot run here: {reason}")
        _instances[name] = _backend_class(name)()
    return _instances[name]


def detect() -> str:
    """The backend name that detection at first use picks on this machine."""
    forced = config.BACKEND.raw()
    if forced:
        return forced
    gpu = torch.cuda.is_available()
    if getattr(torch.version, "hip", None) and gpu:
        return "rocm"
    if getattr(torch.version, "cuda", None) and gpu:
        return "cuda"
    return "cpu"


def use(name: str) -> Backend:
    """Rebind the process's backend; ValueError for an unknown or unusable name, ConfigError
    for a malformed io setting (config.IO_SETTINGS), whichever backend reads it."""
    global _current
    config.check(config.IO_SETTINGS)
    _current = get(name)
    return _current


def current() -> Backend:
    """The bound backend; the first call detects and binds it."""
    if _current is None:
        _bind_at_first_use()
    assert _current is not None
    return _current


def _bind_at_first_use() -> None:
    name = detect()
    try:
        use(name)
    except config.ConfigError:
        raise  # the setting names itself: neither the backend it was read for nor a fallback is the cause
    except ValueError as exc:
        if config.BACKEND.raw():
            raise ValueError(f"{ENV_VAR}={name}: {exc}") from None
        # A GPU was seen but its backend cannot run (binding missing, say):
        # fall back to the reference so the package stays importable, and say why.
        warnings.warn(f"portable_kv: {exc}; falling back to the cpu backend", stacklevel=3)
        use("cpu")


__all__ = ["Backend", "BackendUnavailable", "available", "current", "detect", "get", "names", "use"]
