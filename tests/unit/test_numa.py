"""NUMA placement: the node decision against simulated sysfs topologies, the thread
memory policy and the page-node reader on this machine, and (on a multi-node GPU
host) page-locked host memory landing on the GPU's node."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from portable_kv import backends, numa

GPU = torch.device("cuda", 0)
PCI = "0000:17:00.0"


def fake_sysfs(root: Path, nodes: int, gpu_node: str | None) -> Path:
    """A sysfs tree with `nodes` NUMA nodes and one GPU at PCI whose numa_node file
    holds `gpu_node` (None: the file is absent)."""
    for n in range(nodes):
        (root / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    device = root / "bus" / "pci" / "devices" / PCI
    device.mkdir(parents=True)
    if gpu_node is not None:
        (device / "numa_node").write_text(gpu_node + "\n")
    return root


@pytest.fixture
def gpu_at_pci(monkeypatch):
    monkeypatch.setattr(numa, "gpu_pci_address", lambda index: PCI if index == 0 else None)


def test_two_nodes_follow_the_gpu(tmp_path, gpu_at_pci):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    assert numa.placement(GPU, sysfs=sysfs) == numa.Placement(1, f"node 1: the NUMA node of GPU 0 (PCI {PCI})")


def test_one_node_needs_no_placement(tmp_path, gpu_at_pci):
    sysfs = fake_sysfs(tmp_path, nodes=1, gpu_node="0")
    assert numa.placement(GPU, sysfs=sysfs) == numa.Placement(None, "one NUMA node: no placement needed")


def test_no_numa_directory_is_one_node(tmp_path, gpu_at_pci):
    assert numa.numa_nodes(tmp_path) == []
    assert numa.placement(GPU, sysfs=tmp_path).node is None


@pytest.mark.parametrize("gpu_node", ["-1", None, "garbage"])
def test_missing_numa_information_gives_default_placement(tmp_path, gpu_at_pci, gpu_node):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node=gpu_node)
    assert numa.placement(GPU, sysfs=sysfs) == numa.Placement(None, f"no NUMA information for PCI {PCI}: default placement")


def test_unknown_pci_address_gives_default_placement(tmp_path, monkeypatch):
    monkeypatch.setattr(numa, "gpu_pci_address", lambda index: None)
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    placed = numa.placement(GPU, sysfs=sysfs)
    assert placed.node is None and "PCI address of GPU 0" in placed.reason


def test_explicit_node_overrides_detection(tmp_path, gpu_at_pci):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    assert numa.placement(GPU, numa_node=0, sysfs=sysfs) == numa.Placement(0, "explicit numa_node=0")
    assert numa.placement(torch.device("cpu"), numa_node=1, sysfs=sysfs) == numa.Placement(1, "explicit numa_node=1")


def test_off_leaves_placement_to_the_kernel(tmp_path, gpu_at_pci):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    assert numa.placement(GPU, numa_node="off", sysfs=sysfs) == numa.Placement(None, "numa_node='off': default placement")


@pytest.mark.parametrize("bad", [2, -1, "1", "on", 1.0, True])
def test_explicit_node_must_exist(tmp_path, gpu_at_pci, bad):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    with pytest.raises(ValueError, match=r"numa_node: expected one of this machine's NUMA nodes \[0, 1\]"):
        numa.placement(GPU, numa_node=bad, sysfs=sysfs)


def test_cpu_device_needs_no_placement(tmp_path):
    sysfs = fake_sysfs(tmp_path, nodes=2, gpu_node="1")
    assert numa.placement(torch.device("cpu"), sysfs=sysfs) == numa.Placement(None, "cpu backend: no device")


def test_gpu_pci_address_from_torch_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(pci_domain_id=0, pci_bus_id=0xDC, pci_device_id=0))
    assert numa.gpu_pci_address(0) == "0000:dc:00.0"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="old torch"))
    assert numa.gpu_pci_address(0) is None


def test_this_machine_has_node_zero():
    assert 0 in numa.numa_nodes()


def fresh_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    memory = mmap.mmap(-1, nbytes)
    return memory, ctypes.addressof(ctypes.c_char.from_buffer(memory))


def test_bind_allocations_places_a_fresh_mapping_and_restores_the_policy():
    before = numa.memory_policy()
    nbytes = 64 * numa.PAGE_BYTES
    memory, address = fresh_mapping(nbytes)
    assert set(numa.page_nodes(address, nbytes)) == {-2}  # mapped, not yet touched
    with numa.bind_allocations(0):
        assert numa.memory_policy() == numa.MemoryPolicy(numa.MPOL_PREFERRED, (0,))
        ctypes.memset(address, 1, nbytes)
    assert numa.memory_policy() == before
    assert numa.page_nodes(address, nbytes) == [0] * 64
    assert numa.page_nodes(address, nbytes, step_pages=16) == [0] * 4
    memory.close()


def test_bind_allocations_restores_the_policy_after_an_error_and_when_nested():
    before = numa.memory_policy()
    with pytest.raises(KeyError):
        with numa.bind_allocations(0):
            raise KeyError("inside")
    assert numa.memory_policy() == before
    with numa.bind_allocations(0):
        outer = numa.memory_policy()
        with numa.bind_allocations(0):
            pass
        assert numa.memory_policy() == outer
    assert numa.memory_policy() == before


def test_bind_allocations_none_is_a_no_op():
    before = numa.memory_policy()
    with numa.bind_allocations(None):
        assert numa.memory_policy() == before


def test_binding_to_a_node_the_kernel_does_not_have_raises_and_changes_nothing():
    before = numa.memory_policy()
    with pytest.raises(OSError, match="set_mempolicy"):
        with numa.bind_allocations(numa.MASK_BITS - 1):
            pass
    assert numa.memory_policy() == before


def test_page_nodes_of_a_tensor():
    tensor = torch.ones(3 * numa.PAGE_BYTES // 4, dtype=torch.float32)
    assert set(numa.tensor_page_nodes(tensor)) == {0}


@pytest.mark.parametrize("nbytes, step, name", [(0, 1, "nbytes"), (4096, 0, "step_pages")])
def test_page_nodes_rejects_bad_arguments(nbytes, step, name):
    with pytest.raises(ValueError, match=name):
        numa.page_nodes(4096, nbytes, step)


def test_tensor_page_nodes_needs_a_host_tensor():
    with pytest.raises(ValueError, match="tensor: expected a host"):
        numa.tensor_page_nodes(torch.empty(4, device="meta"))


def test_release_cached_host_memory_uses_what_this_torch_has(monkeypatch):
    calls = []
    # Torch 2.11 has no torch.accelerator.empty_host_cache: set it either way (raising=False).
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("accelerator"), raising=False)
    numa.release_cached_host_memory()
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("older torch"), raising=False)
    numa.release_cached_host_memory()
    assert calls == ["accelerator", "older torch"]


GPU_BACKEND = next((n for n in ("cuda", "rocm") if backends.unavailable_reason(n) is None), None)


@pytest.mark.skipif(GPU_BACKEND is None or len(numa.numa_nodes()) < 2, reason="needs a GPU and a host with two or more NUMA nodes")
def test_page_locked_memory_lands_on_the_gpu_node():
    before = backends.current()
    backend = backends.use(GPU_BACKEND)
    try:
        placed = numa.placement(backend.device)
        if placed.node is None:
            pytest.skip(f"no node to place on: {placed.reason}")
        for node in numa.numa_nodes():
            # A fresh block: the caching host allocator would hand back a freed one of the same size class.
            numa.release_cached_host_memory()
            with numa.bind_allocations(node):
                pinned = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
            assert set(numa.tensor_page_nodes(pinned, step_pages=64)) == {node}, f"pinned memory, node {node}"
            del pinned
            memory, address = fresh_mapping(1 << 26)
            with numa.bind_allocations(node):
                backend.register_host(address, 1 << 26)
            try:
                assert set(numa.page_nodes(address, 1 << 26, step_pages=64)) == {node}, f"registered memory, node {node}"
            finally:
                backend.unregister_host(address)
                memory.close()
    finally:
        backends.use(before.name)
