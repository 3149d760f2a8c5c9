"""What a new user meets first: settings refused whatever backend is bound, log lines that
show with the setting alone, errors that name what to change, and one compile per node."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portable_kv import backends, log
from portable_kv.config import ConfigError

MALFORMED_IO_SETTINGS = [
    ("PORTABLE_KV_BLOCKS", "abc", "expected an integer, got 'abc'"),
    ("PORTABLE_KV_BLOCKS", "-3", "expected an integer >= 1, got -3"),
    ("PORTABLE_KV_DMA_STREAMS", "0", "expected an integer >= 1, got 0"),
    ("PORTABLE_KV_STAGING_BLOCKS", "many", "expected an integer, got 'many'"),
]


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


def python(script: str, **env: str) -> subprocess.CompletedProcess:
    """`python -c script` in a fresh process, with no PORTABLE_KV_* variable but `env`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PORTABLE_KV_")} | env
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=300)


BUILD_A_POOL = """
import torch
import portable_kv as pk
dev = pk.DeviceKVPool(2, 64, 16, 2, 8, 4, dtype=torch.float16)
pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="kernel").close()
"""


def test_the_log_level_setting_alone_shows_the_info_lines_on_stderr():
    """SGLang's install() logs on its module's logger before any pool exists; both lines show, once each."""
    script = ("import portable_kv.engines.sglang as glue\n"
              "glue.logger.info(\"portable_kv: SGLang's HiCache builds portable_kv host pools\")\n" + BUILD_A_POOL)
    run = python(script, PORTABLE_KV_LOG_LEVEL="INFO")
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines.count("portable_kv.engines.sglang INFO: portable_kv: SGLang's HiCache builds portable_kv host pools") == 1, run.stderr
    assert len([line for line in lines if line.startswith("portable_kv INFO: AsymmetricHostPool: 2 layers")]) == 1, run.stderr
    quiet = python(script)
    assert quiet.returncode == 0 and "INFO" not in quiet.stderr, quiet.stderr


@pytest.fixture
def package_logger(clean_env):
    logger = logging.getLogger(log.LOGGER_NAME)
    level, handlers = logger.level, list(logger.handlers)
    logger.handlers[:] = []
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.mark.parametrize("root_handler, added", [
    (None, True),
    (logging.NullHandler(), True),  # a library's "no output unless configured"
    (logging.StreamHandler(io.StringIO()), False),  # the application shows them already: not twice
])
def test_the_log_level_setting_adds_a_stderr_handler_where_nothing_shows_its_records(clean_env, package_logger, root_handler, added):
    clean_env.setattr(logging.getLogger(), "handlers", [root_handler] if root_handler else [])
    clean_env.setenv("PORTABLE_KV_LOG_LEVEL", "INFO")
    log.configure()
    log.configure()
    assert [type(h) for h in package_logger.handlers] == ([logging.StreamHandler] if added else [])


def test_without_the_log_level_setting_no_handler_is_added(clean_env, package_logger):
    clean_env.setattr(logging.getLogger(), "handlers", [])
    log.configure()
    assert package_logger.handlers == [] and package_logger.level == logging.WARNING


def test_too_large_a_host_reserve_is_named_as_what_to_lower(clean_env):
    import torch

    import portable_kv as pk
    from portable_kv import host_memory

    clean_env.setattr(host_memory, "_available_host_memory", lambda: 4 << 30)
    clean_env.setenv("PORTABLE_KV_HOST_RESERVE", str(4 << 30))
    dev = pk.DeviceKVPool(1, 32, 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(MemoryError) as raised:
        pk.AsymmetricHostPool(dev, host_size_gb=0.5, io_backend="kernel")
    message = str(raised.value)
    assert "4.29 GB kept in reserve" in message and "or the reserve (PORTABLE_KV_HOST_RESERVE, in bytes)" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("call", ["get_page_buffer_meta", "get_split_heads_page_buffer_meta"])
@pytest.mark.parametrize("indices", ["sparse", "meta"])
def test_page_meta_calls_refuse_indices_without_dense_data_by_name(call, indices):
    import torch

    import portable_kv as pk

    dev = pk.DeviceKVPool(1, 32, 4, 2, 8, 8, dtype=torch.float16)
    with pk.AsymmetricHostPool(dev, layout="page_head", io_backend="kernel") as host:
        tokens = torch.arange(8)
        given = tokens.to_sparse() if indices == "sparse" else tokens.to("meta")
        args = (given,) if call == "get_page_buffer_meta" else (given, 2)
        with pytest.raises(TypeError) as raised:
            getattr(host, call)(*args)
        expected = "dense (strided) tensor, got layout torch.sparse_coo" if indices == "sparse" else "on the meta device"
        assert str(raised.value).startswith("indices: expected ") and expected in str(raised.value), raised.value
        assert getattr(host, call)(tokens, *args[1:])  # the same pages, dense, are served


def cpu_bench(*argv: str) -> int:
    from portable_kv.cli import main

    before = backends.current().name
    try:
        return main(["bench", "--page-size", "4", "--pages", "4", "--reps", "2", "--backends", "cpu", "--mla-dim", "0", *argv])
    finally:
        backends.use(before)


@pytest.mark.parametrize("flag, value, minimum", [("--draws", "-1", 1), ("--layers", "0", 1), ("--reps", "-2", 0)])
def test_a_bench_count_out_of_range_is_named_alone(capsys, flag, value, minimum):
    assert cpu_bench("--quick", flag, value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"portable-kv bench: {flag}: expected an integer >= {minimum}, got {value} "), err
    assert sum(other in err[0] for other in ("--draws", "--layers", "--reps")) == 1, err  # the valid flags are not listed


def test_a_quick_bench_reports_the_layers_and_repetitions_it_used(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert cpu_bench("--quick", "--reps", "0", "--json", str(path)) == 0
    used = json.loads(path.read_text())["meta"]["args"]
    assert (used["layers"], used["mla_layers"], used["reps"], used["quick"]) == (8, 8, 5, True)
    assert cpu_bench("--layers", "3", "--reps", "2", "--json", str(path)) == 0
    used = json.loads(path.read_text())["meta"]["args"]
    assert (used["layers"], used["mla_layers"], used["reps"]) == (3, 61, 2)


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_a_bench_output_into_a_missing_directory_is_refused_before_measuring(tmp_path, capsys, flag):
    target = tmp_path / "no such dir" / "bench.out"
    assert cpu_bench("--quick", flag, str(target)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"portable-kv bench: {flag}: the directory {str(target.parent)!r} "), err
    assert "does not exist" in err[0]
    assert "[bench]" not in captured.err + captured.out  # nothing was measured
    assert cpu_bench("--quick", flag, str(tmp_path)) == 2
    assert f"{flag}: expected a file path, got the directory" in capsys.readouterr().err


def test_a_bench_usage_error_is_one_line_with_status_2():
    run = subprocess.run([sys.executable, "-m", "portable_kv", "bench", "--draws", "x"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["portable-kv bench: error: argument --draws: invalid int value: 'x' "
                                       "(`portable-kv bench --help` lists the arguments)"]


def stand_in_spec():
    from portable_kv.backends import jit

    # An arch no prebuilt directory holds, so the cache or the compile answers.
    return jit.KernelSpec.for_source(jit.PACKAGE_DIR / "kernels_cuda" / "kv_copy.cu", "sm_stand_in", "stand-in compiler 1.0", "cubin")


def build_with_a_counting_compiler(barrier, counter: str, results) -> None:
    """One rank: wait for the others, then ask for the kernel as a backend does at first use."""

    def compile(spec) -> bytes:
        with open(counter, "a") as calls:
            calls.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # a compile takes a while: the other ranks ask meanwhile
        return f"code object for {spec.arch}".encode()

    spec = stand_in_spec()
    barrier.wait()
    results.put(spec.build(compile))


def test_ranks_starting_together_compile_once_and_read_the_cached_result(clean_env, tmp_path):
    ranks = 4
    clean_env.setenv("PORTABLE_KV_CACHE", str(tmp_path / "cache"))
    counter = tmp_path / "compiles"
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(ranks), spawn.Queue()
    processes = [spawn.Process(target=build_with_a_counting_compiler, args=(barrier, str(counter), results)) for _ in range(ranks)]
    for process in processes:
        process.start()
    images = [results.get(timeout=240) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert len(counter.read_text().splitlines()) == 1
    assert images == [b"code object for sm_stand_in"] * ranks
    assert stand_in_spec().cache_path().read_bytes() == images[0]


def test_a_compile_lock_held_too_long_is_named(clean_env, tmp_path):
    from portable_kv.backends import jit

    clean_env.setenv("PORTABLE_KV_CACHE", str(tmp_path))
    clean_env.setattr(jit, "LOCK_WAIT_S", 0.2)
    spec = stand_in_spec()
    lock = spec.cache_path().with_name(f".{spec.cache_path().name}.lock")
    with jit.file_lock(lock):  # another compile of the same kernel, in progress
        with pytest.raises(TimeoutError) as raised:
            spec.build(lambda _: pytest.fail("compiled while another process held the lock"))
    assert str(raised.value).startswith(f"kernel cache: waited 0.2 s for the lock file {lock}, held by a process compiling the same kernel")
    assert spec.build(lambda _: b"image") == b"image"  # the lock released, the next build compiles


@pytest.fixture
def kernelkit(monkeypatch):
    """tests/sglang/kernelkit.py, with sys.path and any sgl_kernel module put back after the test."""
    path = Path(__file__).resolve().parents[1] / "sglang" / "kernelkit.py"
    spec = importlib.util.spec_from_file_location("kernelkit_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "sgl_kernel"}
    yield module
    for name in [n for n in sys.modules if n.split(".")[0] == "sgl_kernel"]:
        del sys.modules[name]
    sys.modules.update(before)


def test_sglang_gets_the_sgl_kernel_stand_in_on_a_gpu_host_without_sgl_kernel(kernelkit, monkeypatch):
    import torch

    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("sgl_kernel is installed here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernelkit.sgl_kernel_or_standin() == "not needed (no GPU)" and str(kernelkit.STANDINS) not in sys.path
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernelkit.sgl_kernel_or_standin() == "stand-in"
    import sgl_kernel

    assert sgl_kernel.__version__ == "0.0.0+standin" and sys.path[0] == str(kernelkit.STANDINS)
    assert kernelkit.sgl_kernel_or_standin() == "stand-in" and sys.path.count(str(kernelkit.STANDINS)) == 1
