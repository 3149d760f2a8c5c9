"""The kernel path's argument packing, proven on the CPU: backends/gpu.py fills the
real PkvCopyArgs struct and a Python model of kv_copy.h executes it; every
layout, shape and index set must move exactly the bytes of the CPU oracle."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from kvspec import bits

from portable_kv import backends
from portable_kv.backends import gpu

HEADER = Path(gpu.__file__).resolve().parents[1] / "kernels_common" / "kv_copy.h"


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, "simulated", "fake_gpu:SimulatedGpuBackend")
    backends._instances.pop("simulated", None)
    before = backends.current().name
    yield backends.use("simulated")
    backends.use(before)


def test_struct_mirrors_the_header():
    text = HEADER.read_text()
    job_fields = re.findall(r"(?:long long|unsigned long long) ([a-z_, ]+);", text.split("struct PkvCopyArgs")[0].split("struct PkvTensorJob")[1])
    names = [n.strip() for group in job_fields for n in group.split(",")]
    assert names == [f for f, _ in gpu.TensorJob._fields_]
    args_part = text.split("struct PkvCopyArgs")[1].split("};")[0]
    names = ["job"] + [n.strip() for group in re.findall(r"(?:long long|unsigned long long) ([a-z_, ]+);", args_part) for n in group.split(",")]
    assert names == [f for f, _ in gpu.CopyArgs._fields_]
    assert ctypes.sizeof(gpu.TensorJob) == 13 * 8 and ctypes.sizeof(gpu.CopyArgs) == 2 * 13 * 8 + 9 * 8
    assert f"#define PKV_BLOCK {gpu.BLOCK}" in text and f"#define PKV_UNROLL {gpu.UNROLL}" in text


def test_access_width_and_grid():
    assert gpu.access_width(1536, 1024, 4096) == 16
    assert gpu.access_width(48, 16, 6) == 2
    assert gpu.access_width(3) == 1
    assert gpu.grid_size(10, 16) == 1
    assert gpu.grid_size(10**9, 16) == 16


def test_roundtrip_through_the_kernel_model(simulated):
    import test_transfers  # the conformance suite's helpers

    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        dev, host = test_transfers.make_pools(simulated, layout, "kernel", torch.bfloat16, tokens=32, page_size=4)
        gen = torch.Generator().manual_seed(3)
        test_transfers.fill(dev, host, gen)
        src = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])
        host_idx = torch.tensor([36, 37, 38, 39, 8, 9, 10, 11])
        host.backup_from_device_all_layer(dev, host_idx, src)
        test_transfers.expect_host_rows(host, dev, host_idx, src, range(host.layer_num))
    width, grid, block = simulated.launches[-1]
    assert width == 16 and block == gpu.BLOCK and grid == 1


def test_bad_index_sets_the_flag_and_copies_nothing_of_it(simulated):
    import test_transfers

    dev, host = test_transfers.make_pools(simulated, "page_first", "kernel", tokens=32, page_size=4)
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
