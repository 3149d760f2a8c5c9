"""Backend detection and the registry, proven without hardware by faking torch's version attributes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from portable_kv import backends


@pytest.mark.parametrize(
    "hip,cuda,gpu,expected",
    [
        ("7.1.0", None, True, "rocm"),
        (None, "13.0", True, "cuda"),
        ("7.1.0", None, False, "cpu"),
        (None, "13.0", False, "cpu"),
        (None, None, False, "cpu"),
    ],
)
def test_detection_order(monkeypatch, hip, cuda, gpu, expected):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert backends.detect() == expected


def test_environment_wins(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.detect() == "triton"


def test_unusable_forced_backend_fails_at_binding():
    """The package imports lazily; the first use of the backend names the bad setting."""
    env = {"PORTABLE_KV_BACKEND": "rocm", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", "import portable_kv; portable_kv.backends.current()"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "PORTABLE_KV_BACKEND=rocm" in result.stderr and "cannot run here" in result.stderr


def test_forced_cpu_binds_at_import():
    env = {"PORTABLE_KV_BACKEND": "cpu", "PATH": "/usr/bin:/bin"}
    code = "import portable_kv; b = portable_kv.backends.current(); print(b.name, b.vendor, b.io_backends)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split()[0:2] == ["cpu", "cpu"]


def test_available_and_use():
    names = backends.available()
    assert names[-1] == "cpu"
    assert backends.use("cpu").name == "cpu"
    with pytest.raises(ValueError, match="expected one of cuda, rocm, triton, cpu"):
        backends.use("metal")


def test_unavailable_reasons_name_the_cause(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "GPU" in backends.unavailable_reason("cuda") or "CUDA build" in backends.unavailable_reason("cuda")
    assert backends.unavailable_reason("rocm")
    with pytest.raises(ValueError, match="cannot run here"):
        backends.get("rocm")
