"""Settings are validated where they are read and all at once at an entry point; the package
logger follows PORTABLE_KV_LOG_LEVEL; a host pool's construction line says what was built."""

from __future__ import annotations

import logging

import pytest
import torch

import portable_kv as pk
from portable_kv import backends, config, log
from portable_kv.config import ConfigError

BAD = [
    ("PORTABLE_KV_BACKEND", "gpu", "expected one of cuda, rocm, triton, cpu, got 'gpu'"),
    ("PORTABLE_KV_BLOCKS", "abc", "expected an integer, got 'abc'"),
    ("PORTABLE_KV_DMA_STREAMS", "0", "expected an integer >= 1, got 0"),
    ("PORTABLE_KV_STAGING_BYTES", "0", "expected an integer >= 1, got 0"),
    ("PORTABLE_KV_STAGING_BLOCKS", "many", "expected an integer, got 'many'"),
    ("PORTABLE_KV_HOST_RESERVE", "-5", "expected an integer >= 0, got -5"),
    ("PORTABLE_KV_SGLANG", "maybe", "expected one of 1, true, yes, on, 0, false, no, off, got 'maybe'"),
    ("PORTABLE_KV_SGLANG_IO", "bad", "expected one of kernel, direct, staged, auto, bulk or pairs like kernel=staged,direct=auto"),
    ("PORTABLE_KV_LOG_LEVEL", "LOUD", "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    ("PORTABLE_KV_DEBUG", "2", "expected one of 1, true, yes, on, 0, false, no, off, got '2'"),
]


def test_every_default_can_be_used(clean_env):
    states = config.states()
    assert [s.name for s in states] == [s.name for s in config.SETTINGS]
    assert all(s.valid and s.source == "default" for s in states), states
    config.check_all()


@pytest.mark.parametrize("name, value, problem", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_setting_is_refused_where_it_is_read_and_at_once_by_check_all(clean_env, name, value, problem):
    clean_env.setenv(name, value)
    setting = next(s for s in config.SETTINGS if s.name == name)
    with pytest.raises(ConfigError) as raised:
        setting.raw()
    assert str(raised.value).startswith(f"{name}: {problem}")
    with pytest.raises(ConfigError, match=f"^{name}: "):
        config.check_all()
    state = next(s for s in config.states() if s.name == name)
    assert (state.value, state.source, state.valid) == (value, "env", False) and state.problem.startswith(problem)


def test_states_say_where_each_value_comes_from(clean_env):
    clean_env.setenv("PORTABLE_KV_BLOCKS", "8")
    clean_env.setenv("PORTABLE_KV_LOG_LEVEL", "info")
    found = {s.name: s for s in config.states({"PORTABLE_KV_LOG_LEVEL": "info"})}
    assert found["PORTABLE_KV_BLOCKS"][:3] == ("PORTABLE_KV_BLOCKS", "8", "env")
    assert found["PORTABLE_KV_LOG_LEVEL"][:3] == ("PORTABLE_KV_LOG_LEVEL", "info", "argument")
    assert found["PORTABLE_KV_DMA_STREAMS"][:3] == ("PORTABLE_KV_DMA_STREAMS", "4", "default")
    assert all(s.valid for s in found.values())


def test_the_settings_name_what_the_package_has():
    from portable_kv.io.mover import IO_PATHS

    assert config.IO_PATHS == IO_PATHS
    assert config.BACKEND_NAMES == backends.names()


@pytest.mark.parametrize("value", ["staged", "auto", "kernel=auto,direct=staged", "kernel=staged", " direct = auto "])
def test_the_sglang_io_setting_parses_as_the_sglang_pools_read_it(clean_env, value):
    from portable_kv.engines.sglang.pool import io_mapping

    clean_env.setenv("PORTABLE_KV_SGLANG_IO", value)
    assert config.sglang_io_mapping(value) == io_mapping()


def test_sglang_install_fails_fast_on_a_malformed_setting(clean_env):
    """Before SGLang is imported (or found missing), not when its first pool is built."""
    import portable_kv.engines.sglang as pk_sglang

    clean_env.setenv("PORTABLE_KV_SGLANG_IO", "bad")
    with pytest.raises(ConfigError, match="^PORTABLE_KV_SGLANG_IO: expected one of"):
        pk_sglang.install()


@pytest.fixture
def package_logger_restored():
    logger = logging.getLogger(log.LOGGER_NAME)
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("level, info_shown", [(None, False), ("INFO", True), ("debug", True), ("ERROR", False)])
def test_the_logger_honours_the_level_setting(clean_env, package_logger_restored, level, info_shown):
    if level is not None:
        clean_env.setenv("PORTABLE_KV_LOG_LEVEL", level)
    records = Records()
    package_logger_restored.addHandler(records)
    logger = log.configure()
    assert logger is package_logger_restored
    assert logger.getEffectiveLevel() == logging.getLevelName((level or "WARNING").upper())
    logging.getLogger("portable_kv.storage.mooncake").info("a pool was built")  # a module's logger below the package's
    logger.error("an error")
    assert records.messages == (["a pool was built"] if info_shown else []) + ["an error"]


def test_a_malformed_level_is_a_config_error(clean_env, package_logger_restored):
    clean_env.setenv("PORTABLE_KV_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError, match="^PORTABLE_KV_LOG_LEVEL: expected one of DEBUG"):
        log.configure()


def test_pool_line_describes_an_mha_pool_as_built():
    dev = pk.DeviceKVPool(2, 64, 16, 2, 8, 4, v_heads=1, dtype=torch.float32)
    with pk.AsymmetricHostPool(dev, layout="page_head", io_backend="direct", host_to_device_ratio=2.0) as host:
        line = log.pool_line(host)
        nbytes = sum(b.nbytes for b in host.buffers)
    assert "\n" not in line
    assert line.startswith("AsymmetricHostPool: 2 layers, K 2x8, V 1x4, torch.float32; 128 tokens in 8 pages of 16; "
                           "layout page_head, io direct; ")
    assert f"{nbytes / 2**20:.1f} MiB host memory" in line
    memory = "pinned (page-locked)" if host.pin_memory else "pageable"
    assert f", {memory}, no NUMA node (cpu backend: no device)" in line


def test_pool_line_describes_an_mla_pool_on_an_explicit_node():
    dev = pk.MLADevicePool(3, 32, 16, 24, dtype=torch.bfloat16)
    with pk.MLAHostPool(dev, layout="layer_first", numa_node=0) as host:
        line = log.pool_line(host)
    assert line.startswith("MLAHostPool: 3 layers, latent 1x24, torch.bfloat16; 64 tokens in 4 pages of 16; layout layer_first, io direct; ")
    assert line.endswith("NUMA node 0 (explicit numa_node=0)")


@pytest.mark.parametrize("level, logged", [("INFO", True), ("WARNING", False)])
def test_a_host_pool_logs_one_line_at_construction_at_info(clean_env, package_logger_restored, level, logged):
    clean_env.setenv("PORTABLE_KV_LOG_LEVEL", level)
    records = Records()
    package_logger_restored.addHandler(records)
    log.configure()
    dev = pk.DeviceKVPool(2, 64, 16, 2, 8, 4, dtype=torch.float16)
    with pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="kernel") as host:
        lines = [m for m in records.messages if m.startswith("AsymmetricHostPool")]
        assert lines == ([log.pool_line(host)] if logged else [])
