"""What a new user meets first, continued: a server started with the SGLang tier and a setting
it cannot use stops, and what `stats()` and `placement` say reads as what happened."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from kvspec import page_tokens

import portable_kv as pk
import portable_kv.engines.sglang as pk_sglang
from portable_kv import backends, config, log
from portable_kv.io import auto

P = 4
BAD_SGLANG_IO = "PORTABLE_KV_SGLANG_IO: expected one of"


@pytest.fixture
def clean_env(monkeypatch):
    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    return monkeypatch


# -- SGLang's plugin -----------------------------------------------------------------------


@pytest.mark.parametrize("name, value", [("PORTABLE_KV_SGLANG_IO", "fast"), ("PORTABLE_KV_BLOCKS", "abc"), ("PORTABLE_KV_SGLANG", "maybe")])
def test_the_sglang_plugin_stops_the_process_on_a_setting_it_cannot_use(clean_env, name, value):
    """SGLang's loader catches an Exception from a plugin and serves with its own pools: the
    plugin raises SystemExit, which it does not catch, with one line naming the setting."""
    clean_env.setenv("PORTABLE_KV_SGLANG", "1")
    clean_env.setenv(name, value)
    with pytest.raises(SystemExit) as raised:
        pk_sglang.plugin()
    message = raised.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"portable_kv: {name}: expected ")
    assert not isinstance(raised.value, Exception)


def test_without_the_sglang_setting_the_plugin_ignores_the_io_setting(clean_env):
    clean_env.setenv("PORTABLE_KV_SGLANG_IO", "fast")
    assert pk_sglang.plugin() is None  # the tier is not asked for: nothing to stop


def sglangs_plugin_loader_here() -> bool:
    # tests/sglang is on the path as a namespace package named sglang: ask for SGLang's own loader.
    try:
        return importlib.util.find_spec("sglang.srt.plugins") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not sglangs_plugin_loader_here(), reason="SGLang is not installed here (tox -e sglang runs this)")
def test_sglangs_own_plugin_loader_stops_on_a_bad_io_setting():
    if "portable_kv" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        pytest.skip("portable-kv is not installed here with its entry point")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PORTABLE_KV_")}
    environ |= {"PORTABLE_KV_SGLANG": "1", "PORTABLE_KV_SGLANG_IO": "fast", "SGLANG_PLUGINS": "portable_kv"}
    script = "from sglang.srt.plugins import load_plugins; load_plugins(); print('served on')"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=300)
    assert run.returncode == 1 and "served on" not in run.stdout
    assert run.stderr.strip().splitlines()[-1].startswith(f"portable_kv: {BAD_SGLANG_IO}")


# -- auto's reasons ------------------------------------------------------------------------


def auto_reason(layers: int, call: str, monkeypatch) -> str:
    """The reason auto gives for one call on a layer_first pool of `layers` layers whose 32
    pages are one run on both sides: one copy of K (12 KiB) and one of V (8 KiB) a layer."""
    monkeypatch.setattr(auto, "AUTO_MIN_BYTES", 0)
    monkeypatch.setattr(auto, "DIRECT_MIN_COPY_BYTES", 8 << 10)
    monkeypatch.setattr(auto, "BACKGROUND_MIN_COPY_BYTES", 8 << 10)
    dev = pk.DeviceKVPool(layers, 32 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="auto")
    idx = page_tokens(torch.arange(32), P)
    if call == "backup":
        host.backup_from_device_all_layer(dev, idx, idx)
    elif call == "background backup":
        host.prepare(dev, idx, idx, background=True).backup()
    else:
        host.load_to_device_per_layer(dev, idx, idx, 0)
    (entry,) = host.stats()["paths"]["auto"].values()
    host.close()
    return entry["reason"]


def test_autos_reason_counts_the_copies_of_the_call_over_its_layers(cpu_backend, monkeypatch):
    reasons = {layers: auto_reason(layers, "backup", monkeypatch) for layers in (2, 3, 4)}
    assert reasons == {layers: f"{2 * layers} copies of 10 KiB on average over {layers} layers: the copy engines, no SM"
                       for layers in (2, 3, 4)}
    assert auto_reason(3, "load", monkeypatch) == "2 copies of 10 KiB on average over 1 layer: the copy engines, no SM"
    assert auto_reason(3, "background backup", monkeypatch) == ("off the caller's critical path, 6 copies of 10 KiB on average "
                                                                 "over 3 layers: the copy engines, no SM")


# -- where host memory goes ----------------------------------------------------------------


@pytest.fixture
def triton_on_the_cpu(clean_env):
    """The triton backend bound under Triton's interpreter, its device the CPU; the bound backend restored after."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    clean_env.setenv("TRITON_INTERPRET", "1")
    clean_env.setattr(backends, "_current", backends._current)
    clean_env.setattr(backends, "_instances", {})
    return backends.use("triton")


def test_a_pool_under_the_triton_interpreter_names_the_triton_backend_as_why_it_has_no_numa_node(triton_on_the_cpu):
    assert triton_on_the_cpu.device.type == "cpu"
    dev = pk.DeviceKVPool(2, 8 * P, P, 2, 24, 16, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="layer_first", io_backend="kernel")
    try:
        assert host.placement.node is None and host.placement.reason == "triton backend on the CPU: no device"
        assert log.pool_line(host).endswith(", no NUMA node (triton backend on the CPU: no device)")
    finally:
        host.close()


def test_info_names_the_triton_backend_in_its_numa_placement_row(clean_env):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PORTABLE_KV_")}
    environ |= {"PORTABLE_KV_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "portable_kv", "info"], capture_output=True, text=True, env=environ, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("numa placement ")]
    assert [row.removeprefix("numa placement").strip() for row in rows] == ["triton backend on the CPU: no device"]
