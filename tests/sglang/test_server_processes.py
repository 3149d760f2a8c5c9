"""portable_kv in SGLang's server processes: the plugin SGLang loads in each of them, and the
launch command's flags as SGLang 0.5.23's own parser reads them."""

from __future__ import annotations

import importlib
import multiprocessing
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from types import ModuleType

import pytest
from kernelkit import sgl_kernel_or_standin
from sglangkit import SKIP_REASON

pytest.importorskip("sglang.srt.plugins", reason=SKIP_REASON)

import portable_kv.engines.sglang as pk_sglang  # noqa: E402

SGL_KERNEL = sgl_kernel_or_standin()

# The README's MiMo-V2-Flash command, after `python -m sglang.launch_server`.
MIMO_V2_FLASH_FLAGS = [
    "--model-path", "XiaomiMiMo/MiMo-V2-Flash", "--trust-remote-code", "--tp-size", "8",
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4",
    "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-mem-layout", "layer_first",
    "--hicache-io-backend", "direct",
]


def scheduler_like(enabled: str, results) -> None:
    """What SGLang's scheduler process does first (`run_scheduler_process`): load the
    plugins, then (later) build its host pools through the assembler."""
    import os

    import torch
    from sglangkit import PAGE, device_pool

    os.environ["PORTABLE_KV_SGLANG"] = enabled
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    publish(ServerArgs(model_path="dummy", page_size=PAGE, hicache_ratio=2.0, hicache_mem_layout="page_first", hicache_io_backend="kernel"),
            role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    dev, _ = device_pool(24, 16)
    info = dev.get_device_pool_infos()[0].buffer_info
    chosen = hybrid_pool_assembler.get_mha_host_pool_cls(info).__name__
    moved = None
    if chosen == "SGLangHostPool":
        host = build_kv_host_pool(kv_pool=dev, page_size=PAGE)
        slots, others = torch.arange(2 * PAGE), torch.arange(2 * PAGE, 4 * PAGE)
        host.backup_from_device_all_layer(dev, slots, slots, "kernel")
        for layer in range(host.layer_num):
            host.load_to_device_per_layer(dev, slots, others, layer, "kernel")
        moved = all(torch.equal(k[others].view(torch.int16), k[slots].view(torch.int16)) for k in dev.k_buffer)
        host.destroy()
    results.put((chosen, moved))


@pytest.fixture(scope="module")
def assembler() -> ModuleType:
    """SGLang's pool assembler, where SGLang's modules import here: on a GPU host they need sgl_kernel (kernelkit)."""
    try:
        return importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    except Exception as exc:
        pytest.skip(f"SGLang's pool assembler does not import here (sgl_kernel: {SGL_KERNEL}): {type(exc).__name__}: {exc}")


def run_spawned(enabled: str):
    # One spawned process: it imports SGLang afresh, which takes about a minute on two cores.
    context = multiprocessing.get_context("spawn")  # SGLang starts its schedulers this way
    results = context.Queue()
    process = context.Process(target=scheduler_like, args=(enabled, results))
    process.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    return outcome


@pytest.fixture
def entry_point() -> EntryPoint:
    """portable_kv's entry point in SGLang's plugin group, which SGLang's plugin loader reads."""
    try:
        distribution("portable-kv")
    except PackageNotFoundError:
        pytest.skip("portable-kv is not installed (imported from a source tree on the path): no entry point for SGLang to load")
    registered = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "portable_kv" in registered, "reinstall portable_kv: its entry point is missing"
    return registered["portable_kv"]


def test_the_package_registers_a_general_plugin_with_sglang(entry_point):
    assert entry_point.load() is pk_sglang.plugin


def test_a_spawned_scheduler_builds_portable_kv_pools_where_the_setting_asks(entry_point, assembler):
    assert run_spawned("1") == ("SGLangHostPool", True)


def test_without_the_setting_the_plugin_changes_nothing(monkeypatch, assembler):
    monkeypatch.delenv("PORTABLE_KV_SGLANG", raising=False)
    sglangs_own = assembler.get_mha_host_pool_cls
    pk_sglang.plugin()
    assert assembler.get_mha_host_pool_cls is sglangs_own
    monkeypatch.setenv("PORTABLE_KV_SGLANG", "1")
    pk_sglang.plugin()
    try:
        assert assembler.get_mha_host_pool_cls is not sglangs_own
    finally:
        pk_sglang.uninstall()
    assert assembler.get_mha_host_pool_cls is sglangs_own


def test_the_mimo_v2_flash_command_parses_with_sglangs_own_parser():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(MIMO_V2_FLASH_FLAGS)
    assert args.enable_hierarchical_cache and args.hicache_ratio == 2
    assert (args.hicache_mem_layout, args.hicache_io_backend) == ("layer_first", "direct")
    assert (args.speculative_algorithm, args.speculative_num_steps, args.tp_size) == ("EAGLE", 3, 8)
