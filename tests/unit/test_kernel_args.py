"""The kernel path's argument packing, proven on the CPU: backends/kernel_args.py fills the
real PkvCopyArgs struct and a Python model of kv_copy.h executes it; every
layout, shape and index set must move exactly the bytes of the CPU oracle."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import fake_gpu
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvspec import bits

from portable_kv.io import kernel_args as ka

HEADER = Path(ka.__file__).resolve().parents[1] / "kernels_common" / "kv_copy.h"


def test_struct_mirrors_the_header():
    text = HEADER.read_text()
    job_fields = re.findall(r"(?:long long|unsigned long long) ([a-z_, ]+);", text.split("struct PkvCopyArgs")[0].split("struct PkvTensorJob")[1])
    names = [n.strip() for group in job_fields for n in group.split(",")]
    assert names == [f for f, _ in ka.TensorJob._fields_]
    args_part = text.split("struct PkvCopyArgs")[1].split("};")[0]
    names = ["job"] + [n.strip() for group in re.findall(r"(?:long long|unsigned long long) ([a-z_, ]+);", args_part) for n in group.split(",")]
    assert names == [f for f, _ in ka.CopyArgs._fields_]
    assert ctypes.sizeof(ka.TensorJob) == 17 * 8 and ctypes.sizeof(ka.CopyArgs) == 2 * 17 * 8 + 14 * 8
    assert f"#define PKV_BLOCK {ka.BLOCK}" in text and f"#define PKV_UNROLL {ka.UNROLL}" in text


@given(st.integers(1, 1 << 40), st.integers(0, (1 << 63) - 1))
def test_divisor_divides_every_index_the_kernel_can_hold(d, n):
    magic, shift = ka.divisor(d)
    assert 0 < magic < 1 << 64 and 0 <= shift < 64
    for value in (n, n % (d * 4 + 1), d - 1, d, d + 1, (1 << 63) - 1):
        assert fake_gpu.pkv_div(value, magic, shift) == value // d, (value, d)


def test_divisor_at_its_edges():
    for d in [1, 2, 3, 5, 7, 48, 64, 96, 1 << 31, (1 << 31) + 1, (1 << 32) - 1, 1 << 32, (1 << 62) + 1]:
        magic, shift = ka.divisor(d)
        for n in (0, 1, d - 1, d, 2 * d - 1, 2 * d, (1 << 32) - 1, 1 << 32, (1 << 63) - 1):
            if n >= 1 << 63:
                continue  # past every index and vector count a kernel is given
            assert fake_gpu.pkv_div(n, magic, shift) == n // d, (n, d)
    with pytest.raises(ValueError, match="positive"):
        ka.divisor(0)


def test_access_width_and_grid():
    assert ka.access_width(1536, 1024, 4096) == 16
    assert ka.access_width(48, 16, 6) == 2
    assert ka.access_width(3) == 1
    assert ka.grid_size(10, 16) == 1
    assert ka.grid_size(10**9, 16) == 16


@pytest.mark.parametrize("kind", ("MHA", "MLA"))
def test_roundtrip_through_the_kernel_model(simulated, kind):
    import test_transfers  # the conformance suite's helpers
    from kvspec import KIND_LAYOUTS

    for layout in KIND_LAYOUTS[kind]:
        dev, host = test_transfers.make_pools(simulated, kind, layout, "kernel", torch.bfloat16, tokens=32, page_size=4)
        gen = torch.Generator().manual_seed(3)
        test_transfers.fill(dev, host, gen)
        src = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])
        host_idx = torch.tensor([36, 37, 38, 39, 8, 9, 10, 11])
        host.backup_from_device_all_layer(dev, host_idx, src)
        test_transfers.expect_host_rows(host, dev, host_idx, src, range(host.layer_num))
    width, grid, block = simulated.runtime.launches[-1]
    assert width == 16 and block == ka.BLOCK and grid == 1


def launched_args(monkeypatch) -> list[tuple[int, ka.CopyArgs]]:
    """Each kernel launch on the simulated GPU from now: its parameter address and a copy of
    the struct as the launch read it (the runtime copies it at the call)."""
    seen = []
    launch = fake_gpu.SimulatedRuntime.launch

    def recorded(self, kernel, grid, block, params, stream, shared_bytes=0):
        if kernel != fake_gpu.BULK_ENTRY:
            address = ctypes.c_void_p.from_address(params).value
            seen.append((params, ka.CopyArgs.from_buffer_copy(ka.CopyArgs.from_address(address))))
        return launch(self, kernel, grid, block, params, stream, shared_bytes)

    monkeypatch.setattr(fake_gpu.SimulatedRuntime, "launch", recorded)
    return seen


def test_an_mla_launch_leaves_the_second_job_without_a_vector(simulated, monkeypatch):
    """One latent buffer, one job: the second starts at the last vector, so no thread takes it."""
    import test_transfers

    seen = launched_args(monkeypatch)
    dev, host = test_transfers.make_pools(simulated, "MLA", "page_first_direct", "kernel", tokens=32, page_size=4, latent_dim=576)
    host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(8, 16))
    (_, args), = seen
    assert args.job[1].vec_begin == args.total_vecs == 8 * host.layer_num * 576 * 2 // 16
    assert args.job[0].chunk_bytes == 576 * 2 and args.job[0].host_base == host.kv_buffer.data_ptr()


def test_bad_index_sets_the_flag_and_copies_nothing_of_it(simulated):
    import test_transfers

    dev, host = test_transfers.make_pools(simulated, "MHA", "page_first", "kernel", tokens=32, page_size=4)
    dev.k_buffer[0].fill_(1.0)
    host.k_buffer.zero_()
    unchecked = type(host)(dev, layout="page_first", io_backend="kernel", validate=False)
    unchecked.k_buffer.zero_()
    unchecked.backup_from_device_per_layer(dev, torch.tensor([3, 500]), torch.tensor([1, 2]), 0)
    assert bool((unchecked.k_buffer[3, 0] == 1.0).all()) and not bits(unchecked.k_buffer[4:]).any()
    with pytest.raises(RuntimeError, match="outside the pools"):
        unchecked.backup_from_device_per_layer(dev, torch.tensor([3]), torch.tensor([1]), 0)
    unchecked.backup_from_device_per_layer(dev, torch.tensor([3]), torch.tensor([1]), 0)  # the flag was reset


def test_property_kernel_model_matches_oracle(simulated):
    import test_oracle

    @given(test_oracle.transfers())
    def check(case):
        expected = test_oracle.run("cpu", "kernel", *case)
        got = test_oracle.run("simulated", "kernel", *case)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)

    check()


def test_reused_launch_moves_each_layer_and_follows_the_quota(simulated, monkeypatch):
    """Per-layer calls launch one argument block per plan and direction, changing only its layer;
    a new block quota reaches the next launch; a backup of other pages interleaved with the
    loads has a block of its own and leaves the loads' in place."""
    import test_transfers

    seen = launched_args(monkeypatch)
    dev, host = test_transfers.make_pools(simulated, "MHA", "page_first_direct", "kernel", tokens=64, page_size=4, layers=3, k_dim=128, v_dim=64)
    gen = torch.Generator().manual_seed(5)
    test_transfers.fill(dev, host, gen)
    host_idx, dev_idx = torch.arange(16, 64), torch.arange(0, 48)  # 48 x 48 vectors: 2 blocks' work
    simulated.block_quota = 1
    for layer in range(host.layer_num):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)
    for layer in range(host.layer_num):
        for h, d in zip(host_idx.tolist(), dev_idx.tolist()):
            assert torch.equal(bits(dev.k_buffer[layer][d]), bits(host.k_buffer[h // 4, layer, h % 4])), f"K layer {layer} token {h}"
            assert torch.equal(bits(dev.v_buffer[layer][d]), bits(host.v_buffer[h // 4, layer, h % 4])), f"V layer {layer} token {h}"
    assert [grid for _, grid, _ in simulated.runtime.launches[-3:]] == [1, 1, 1]
    assert [args.layer_begin for _, args in seen] == [0, 1, 2] and {args.layers for _, args in seen} == {1}
    assert len({params for params, _ in seen}) == 1, "one argument block for the plan's per-layer loads"
    load_params = seen[0][0]
    simulated.block_quota = 2
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 0)
    assert simulated.runtime.launches[-1][1] == 2, "a new block quota must reach the next launch"
    host.backup_from_device_per_layer(dev, torch.arange(0, 4), torch.arange(60, 64), 2)
    assert torch.equal(bits(host.k_buffer[0, 2]), bits(dev.k_buffer[2][60:64]))
    dev.k_buffer[1].zero_()
    host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)
    assert torch.equal(bits(dev.k_buffer[1][dev_idx]), bits(host.k_buffer[4:16, 1].reshape(48, *host.k_buffer.shape[-2:])))
    (backup_params, backup), (again, load) = seen[-2:]
    assert (backup.to_device, backup.tokens, load.to_device, load.layer_begin) == (0, 4, 1, 1)
    assert backup_params != load_params and again == load_params, "the load's arguments stayed in place beside the backup's"
    stats = host.stats()
    assert (stats["load"]["kernel"]["calls"], stats["backup"]["kernel"]["calls"]) == (5, 1)
