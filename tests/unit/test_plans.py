"""Plans (`host.prepare(...)`, and what every per-call transfer maps to): a launch built once per
plan, direction and layer span however calls interleave; the per-call API and SGLang's hook
path each reaching one plan; a steady call's Python frames; `plan.ready(layer)`; a plan
that refuses replaced device buffers and a closed pool; `background` on auto; io settings
read once, when the pool is built; every io path enqueuing on the caller's stream."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fake_gpu import SimulatedRuntime
from fake_runtimes import FAKE_STREAM, fake_rocm_backend
from kvspec import bits, page_tokens, randomize, sglang_host_pool

import portable_kv as pk
from portable_kv import backends
from portable_kv.backends import rocm
from portable_kv.config import ConfigError
from portable_kv.io import kernel_args

P, LAYERS = 4, 4
PACKAGE = str(Path(pk.__file__).resolve().parent)
# Python frames a steady per-layer call may run inside the package (docs/DESIGN.md, "The host path").
FRAMES_PER_CALL = 15


@pytest.fixture
def builds(monkeypatch) -> list[bool]:
    """Each kernel launch built from now (KernelArgs: the struct a launch packs once and keeps),
    by direction: the one place where a build count is the behaviour under test."""
    built = []
    init = kernel_args.KernelArgs.__init__

    def counted(self, transfer, indices, error_flag):
        built.append(transfer.to_device)
        init(self, transfer, indices, error_flag)

    monkeypatch.setattr(kernel_args.KernelArgs, "__init__", counted)
    return built


def filled_pools(layers: int = LAYERS, tokens: int = 32 * P, io: str = "kernel", layout: str = "page_first_direct", sglang: bool = False, **kwargs):
    dev = pk.DeviceKVPool(layers, tokens, P, 2, 8, 8, dtype=torch.float16)
    host = (sglang_host_pool if sglang else pk.AsymmetricHostPool)(dev, layout=layout, io_backend=io, **kwargs)
    gen = torch.Generator().manual_seed(7)
    for t in list(dev.k_buffer) + list(dev.v_buffer) + [host.k_buffer, host.v_buffer]:
        randomize(t, gen)
    return dev, host


def device_rows(dev, slots: torch.Tensor) -> list[torch.Tensor]:
    return [bits(buffer[layer][slots]).clone() for buffer in (dev.k_buffer, dev.v_buffer) for layer in range(len(buffer))]


def test_interleaved_plans_build_one_launch_per_direction_and_layer_span(simulated, builds):
    """Eight plans of different pages, each backed up then loaded layer by layer, interleaved
    with one another and between directions: 16 launches built for 96 calls, and what the
    backups took is what the loads put back."""
    dev, host = filled_pools()
    plans = [host.prepare(dev, page_tokens(torch.tensor([2 * i, 2 * i + 1]), P), page_tokens(torch.tensor([15 - i, 16 + 2 * i]), P))
             for i in range(8)]
    slots = torch.cat([plan.device_indices for plan in plans])
    saved = device_rows(dev, slots)
    for layer in range(LAYERS):
        for plan in plans:
            plan.backup(layer)
    for buffer in (dev.k_buffer, dev.v_buffer):
        for layer in range(LAYERS):
            buffer[layer].zero_()
    for _ in range(2):
        for layer in reversed(range(LAYERS)):
            for plan in plans:
                plan.load(layer)
                plan.backup(layer)
    assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, slots), saved))
    assert sorted(builds) == [False] * 8 + [True] * 8, "one launch per plan and direction, never one per call"
    assert len(simulated.runtime.launches) == 8 * LAYERS * 5
    stats = host.stats()
    assert (stats["load"]["kernel"]["calls"], stats["backup"]["kernel"]["calls"]) == (8 * LAYERS * 2, 8 * LAYERS * 3)
    host.close()


def test_the_per_call_api_and_sglangs_hook_path_each_reach_one_plan(simulated, builds):
    """The same tensors passed to every per-call transfer, and SGLang's submission (the pool's
    copies of its indices, passed to every call): one launch per direction and layer span
    however many calls."""
    dev, host = filled_pools()
    load_host, load_dev = page_tokens(torch.tensor([3, 9]), P), page_tokens(torch.tensor([1, 4]), P)
    backup_host, backup_dev = page_tokens(torch.tensor([20, 21]), P), page_tokens(torch.tensor([7, 8]), P)
    for _ in range(3):
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dev, load_host, load_dev, layer)
            host.backup_from_device_per_layer(dev, backup_host, backup_dev, layer)
    assert sorted(builds) == [False, True]
    for layer in range(LAYERS):
        assert torch.equal(bits(dev.k_buffer[layer][load_dev]), bits(host.k_buffer[[3, 9], layer].reshape(2 * P, 2, 8)))
        assert torch.equal(bits(host.v_buffer[[20, 21], layer].reshape(2 * P, 2, 8)), bits(dev.v_buffer[layer][backup_dev]))
    host.close()

    builds.clear()
    dev, pool = filled_pools(sglang=True)
    submitted = pool.prepare_transfer_indices(load_host, load_dev, "kernel")
    for _ in range(3):
        for layer in range(LAYERS):
            pool.load_to_device_per_layer_physical(dev, *submitted, layer)
        pool.backup_from_device_all_layer_physical(dev, *submitted)
    assert sorted(builds) == [False, True], "one launch for the per-layer loads, one for the all-layer backups"
    for layer in range(LAYERS):
        assert torch.equal(bits(dev.v_buffer[layer][load_dev]), bits(pool.v_buffer[[3, 9], layer].reshape(2 * P, 2, 8)))
    assert pool.stats()["load"]["kernel"]["calls"] == 3 * LAYERS
    pool.close()


def package_frames(call) -> list[str]:
    """The Python functions of the package that `call` runs, one entry per frame (a generator
    resumed is the same frame)."""
    frames = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE) and all(f is not frame for f in frames):
            frames.append(frame)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return [f"{Path(f.f_code.co_filename).name}:{f.f_code.co_qualname}" for f in frames]


def test_a_steady_per_layer_call_runs_few_python_frames(simulated):
    """After warm-up, `plan.load(layer)` and the per-call `load_to_device_per_layer` of the same
    tensors each run at most FRAMES_PER_CALL frames of the package: a call checks, sets the
    layer, launches and records; nothing is looked up, validated or built again."""
    dev, host = filled_pools()
    host_idx, dev_idx = page_tokens(torch.tensor([3, 9]), P), page_tokens(torch.tensor([1, 4]), P)
    plan = host.prepare(dev, host_idx, dev_idx)
    for layer in range(LAYERS):
        plan.load(layer)
        host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
    prepared = package_frames(lambda: plan.load(2))
    per_call = package_frames(lambda: host.load_to_device_per_layer(dev, host_idx, dev_idx, 2))
    counts = (len(prepared), len(per_call))
    assert max(counts) <= FRAMES_PER_CALL, f"plan.load: {counts[0]} frames {prepared}; load_to_device_per_layer: {counts[1]} frames {per_call}"
    host.close()


def test_ready_completes_once_a_plans_call_of_that_layer_landed(cpu_backend):
    dev, host = filled_pools()
    plan = host.prepare(dev, page_tokens(torch.tensor([3]), P), page_tokens(torch.tensor([5]), P))
    never = plan.ready(3)
    assert never.query(), "no call moved layer 3: ready at once"
    never.wait()
    never.synchronize()
    plan.load(1)
    plan.backup(2)
    for layer in (1, 2):
        ready = plan.ready(layer)
        assert ready.query()
        ready.wait()
        ready.synchronize()
    plan.load_all()
    assert all(plan.ready(layer).query() for layer in range(LAYERS))
    assert torch.equal(bits(dev.k_buffer[1][20:24]), bits(host.k_buffer[3, 1]))
    for bad, error in ((LAYERS, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="^layer_id"):
            plan.ready(bad)
    host.close()


def test_a_prepared_plan_refuses_replaced_device_buffers_and_a_closed_pool(cpu_backend):
    dev, host = filled_pools()
    plan = host.prepare(dev, page_tokens(torch.tensor([3]), P), page_tokens(torch.tensor([5]), P))
    plan.load(0)
    dev.k_buffer[2] = torch.zeros_like(dev.k_buffer[2])
    plan.load(0)  # layer 0's buffers are the ones it was prepared with
    with pytest.raises(ValueError, match=r"^plan: the device pool's k_buffer was replaced after prepare\(\); prepare the transfer again"):
        plan.load(2)
    with pytest.raises(ValueError, match="k_buffer was replaced"):
        plan.load_all()
    assert host.stats()["last_error"].startswith("ValueError: plan: the device pool's k_buffer")
    assert host.stats()["load"]["kernel"]["calls"] == 2
    again = host.prepare(dev, page_tokens(torch.tensor([3]), P), page_tokens(torch.tensor([5]), P))
    again.load(2)
    assert torch.equal(bits(dev.k_buffer[2][20:24]), bits(host.k_buffer[3, 2]))
    host.close()
    for call in (lambda: plan.load(0), lambda: again.backup(), lambda: again.load_all()):
        with pytest.raises(ValueError, match="^host pool: the pool is closed"):
            call()
    with pytest.raises(ValueError, match="closed"):
        host.prepare(dev, page_tokens(torch.tensor([3]), P), page_tokens(torch.tensor([5]), P))


def test_background_transfers_of_pages_take_the_copy_engines_on_auto(cpu_backend):
    """Off the caller's critical path, auto sends copies of a page (64 tokens of one layer's K:
    16 KiB) to the copy engines, however small the transfer, and says why."""
    dev = pk.DeviceKVPool(2, 8 * 64, 64, 2, 64, 64, dtype=torch.bfloat16)
    host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend="auto")
    randomize(dev.k_buffer[1], torch.Generator().manual_seed(3))
    host_idx, dev_idx = page_tokens(torch.tensor([5, 2]), 64), page_tokens(torch.tensor([1, 6]), 64)
    host.prepare(dev, host_idx, dev_idx, background=True).backup(1)
    host.load_to_device_per_layer(dev, host_idx, page_tokens(torch.tensor([3, 4]), 64), 1, background=True)
    assert torch.equal(bits(dev.k_buffer[1][page_tokens(torch.tensor([3, 4]), 64)]), bits(dev.k_buffer[1][dev_idx]))
    paths = host.stats()["paths"]["auto"]
    assert list(paths) == ["direct"] and paths["direct"]["calls"] == 2
    assert "critical path" in paths["direct"]["reason"] and "16 KiB" in paths["direct"]["reason"]
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    assert "latency" in host.stats()["paths"]["auto"]["indexing"]["reason"], "in the foreground a small transfer is one launch"
    for background in ("yes", 1, None):
        with pytest.raises(TypeError, match=rf"^background: expected True or False, got {background!r}"):
            host.prepare(dev, host_idx, dev_idx, background=background)
        with pytest.raises(TypeError, match="^background: expected True or False"):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, 0, background=background)
    assert host.stats()["last_error"].startswith("TypeError: background")
    with pytest.raises(TypeError, match="^validate: expected True or False, got 'no'"):
        pk.AsymmetricHostPool(dev, validate="no")
    host.close()


def test_a_pools_io_settings_are_read_once_when_it_is_built(cpu_backend, monkeypatch):
    """A setting gone bad after a pool was built changes nothing for that pool (its calls and
    plans read no setting, a path first used now included); a pool built now refuses it by name."""
    dev, host = filled_pools()
    idx = page_tokens(torch.tensor([3]), P)
    monkeypatch.setenv("PORTABLE_KV_STAGING_BYTES", "lots")
    try:
        host.load_to_device_per_layer(dev, idx, idx, 0)
        host.prepare(dev, idx, idx).backup(1)
        host.load_to_device_per_layer(dev, idx, idx, 1, io_backend="staged")
        assert host.stats()["paths"]["staged"] == {"staged": {"calls": 1, "reason": ""}}
        with pytest.raises(ConfigError, match="^PORTABLE_KV_STAGING_BYTES: expected an integer, got 'lots'"):
            pk.AsymmetricHostPool(dev, io_backend="kernel")
        assert host.stats()["last_error"] is None
    finally:
        monkeypatch.delenv("PORTABLE_KV_STAGING_BYTES")
    host.close()


@pytest.mark.parametrize("io", ["kernel", "direct", "staged"])
def test_every_io_path_enqueues_on_the_callers_current_stream(monkeypatch, tmp_path, io):
    """Against the fake HIP runtime, whose current stream is FAKE_STREAM: each io path's
    launches and copies go on it (the staged path's on side streams of it where it pipelines:
    one chunk here, so none)."""
    backend, _, _, lib = fake_rocm_backend(monkeypatch, tmp_path)
    monkeypatch.setitem(backends._instances, "rocm", backend)
    monkeypatch.setattr(rocm.RocmBackend, "unavailable_reason", classmethod(lambda cls: None))
    before = backends.current().name
    backends.use("rocm")
    try:
        dev = pk.DeviceKVPool(2, 16 * P, P, 2, 64, 64, dtype=torch.bfloat16)
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io)
        idx = page_tokens(torch.tensor([2, 3]), P)
        host.load_to_device_per_layer(dev, idx, idx, 1)
    finally:
        backends.use(before)
    calls = [(name, args) for name, args in lib.calls if name != "hipSetDevice"]
    assert calls, "the transfer reached the runtime"
    streams = {args[8] if name == "hipModuleLaunchKernel" else args[-1] for name, args in calls}
    assert streams == {FAKE_STREAM}, [(name, args) for name, args in calls]


@pytest.mark.parametrize("io", ["kernel", "bulk", "direct", "staged"])
def test_every_io_path_enqueues_on_the_simulated_gpus_current_stream(simulated, monkeypatch, io):
    """The simulated GPU's current stream is handle 0: each io path's launches and copies name it."""
    streams = []
    for name in ("launch", "batch_call", "memcpy_2d"):
        real = getattr(SimulatedRuntime, name)
        position = {"launch": 4, "batch_call": 1, "memcpy_2d": 6}[name]
        monkeypatch.setattr(SimulatedRuntime, name, lambda self, *args, real=real, position=position: streams.append(args[position]) or real(self, *args))
    dev, host = filled_pools(io=io)
    idx = page_tokens(torch.tensor([2, 3]), P)
    host.load_to_device_per_layer(dev, idx, idx, 1)
    assert streams and set(streams) == {simulated.runtime.current_stream()}, streams
    host.close()
