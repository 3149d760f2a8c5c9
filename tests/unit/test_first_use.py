"""What a new user meets first: settings refused whatever backend is bound, log lines that
show with the setting alone, errors that name what to change, and one compile per node."""

from __future__ import annotations

import importlib.util

import pytest

from portable_kv import backends, config
from portable_kv.config import ConfigError

MALFORMED_IO_SETTINGS = [
    ("PORTABLE_KV_BLOCKS", "abc", "expected an integer, got 'abc'"),
    ("PORTABLE_KV_BLOCKS", "-3", "expected an integer >= 1, got -3"),
    ("PORTABLE_KV_DMA_STREAMS", "0", "expected an integer >= 1, got 0"),
    ("PORTABLE_KV_STAGING_BLOCKS", "many", "expected an integer, got 'many'"),
]


@pytest.fixture
def clean_env(monkeypatch):
    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    return monkeypatch


@pytest.fixture
def unbound(clean_env):
    """No backend bound yet, as in a fresh process; the bound one and its instances restored after."""
    clean_env.setattr(backends, "_current", None)
    clean_env.setattr(backends, "_instances", {})
    return clean_env


@pytest.mark.parametrize("name, value, problem", MALFORMED_IO_SETTINGS)
def test_a_malformed_io_setting_is_refused_when_the_cpu_backend_is_bound(unbound, name, value, problem):
    unbound.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        backends.use("cpu")
    assert str(raised.value) == f"{name}: {problem}"
    with pytest.raises(ConfigError) as raised:
        backends.current()  # bound at first use, detection choosing cpu or a GPU backend alike
    assert str(raised.value) == f"{name}: {problem}"


def test_binding_the_cpu_backend_with_valid_io_settings_still_works(unbound):
    unbound.setenv("PORTABLE_KV_BLOCKS", "8")
    unbound.setenv("PORTABLE_KV_DMA_STREAMS", "2")
    assert backends.use("cpu").name == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_malformed_setting_under_the_triton_backend_names_itself_not_the_backend(unbound):
    unbound.setenv("PORTABLE_KV_BACKEND", "triton")
    unbound.setenv("TRITON_INTERPRET", "1")
    unbound.setenv("PORTABLE_KV_BLOCKS", "abc")
    with pytest.raises(ConfigError) as raised:
        backends.current()
    assert str(raised.value) == "PORTABLE_KV_BLOCKS: expected an integer, got 'abc'"
