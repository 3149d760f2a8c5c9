"""NUMA-local host memory: the node a GPU hangs off, and allocating on it.

On a multi-socket server a host pool in the other socket's memory sends every
transfer across the socket link as well as PCIe.  `placement` decides the node
(an explicit one, or the GPU's own, read from sysfs through its PCI address)
and says why in one sentence; `bind_allocations` makes the calling thread's new
pages come from that node; `page_nodes` reads back where a buffer's pages are.
The kernel's memory-policy calls are made through libc's `syscall`, so no
libnuma is needed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import backends

SYSFS = Path("/sys")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
OFF = "off"  # numa_node=OFF: no placement, the kernel's default
MPOL_PREFERRED = 1
# Bits of the node masks passed to the kernel: CONFIG_NODES_SHIFT is at most 10,
# and get_mempolicy refuses a mask shorter than the kernel's node count.
MASK_BITS = 1024
_MASK_WORDS = MASK_BITS // (8 * ctypes.sizeof(ctypes.c_ulong))
# set_mempolicy, get_mempolicy, move_pages: the numbers differ per architecture.
_SYSCALLS = {
    "x86_64": (238, 239, 279),
    "aarch64": (237, 236, 239),
}


@dataclass(frozen=True)
class Placement:
    """Where a host pool's memory goes: a NUMA node, or None for the kernel's default."""

    node: int | None
    reason: str


def placement(device: torch.device, numa_node: int | str | None = None, sysfs: Path = SYSFS) -> Placement:
    """The NUMA node for host memory that `device` moves data to and from.

    An explicit `numa_node` wins (it must be a node of this machine, or "off" for
    the kernel's default placement); a CPU device or a single-node machine needs
    none; otherwise the GPU's PCI address is looked up in `sysfs` (a parameter so
    that tests can build a topology)."""
    if numa_node == OFF:
        return Placement(None, "numa_node='off': default placement")
    nodes = numa_nodes(sysfs)
    if numa_node is not None:
        return Placement(check_node(numa_node, nodes), f"explicit numa_node={numa_node}")
    if device.type == "cpu":
        return Placement(None, f"{host_backend()}: no device")
    if len(nodes) <= 1:
        return Placement(None, "one NUMA node: no placement needed")
    index = device.index if device.index is not None else torch.cuda.current_device()
    pci = gpu_pci_address(index)
    if pci is None:
        return Placement(None, f"torch does not report the PCI address of GPU {index}: default placement")
    node = pci_numa_node(pci, sysfs)
    if node is None:
        return Placement(None, f"no NUMA information for PCI {pci}: default placement")
    return Placement(node, f"node {node}: the NUMA node of GPU {index} (PCI {pci})")


def host_backend() -> str:
    """The backend whose device is the host, as a placement reason names it: the bound one
    where its device is the CPU (the triton backend under TRITON_INTERPRET=1 among them), else cpu."""
    bound = backends._current  # read, not bound: `portable-kv info` asks where none could be
    if bound is None or bound.device.type != "cpu" or bound.name == "cpu":
        return "cpu backend"
    return f"{bound.name} backend on the CPU"


def numa_nodes(sysfs: Path = SYSFS) -> list[int]:
    """The NUMA nodes of this machine, from /sys/devices/system/node/nodeN."""
    root = Path(sysfs) / "devices" / "system" / "node"
    if not root.is_dir():
        return []
    return sorted(int(entry.name[4:]) for entry in root.iterdir() if entry.name.startswith("node") and entry.name[4:].isdigit())


def check_node(numa_node: object, nodes: list[int]) -> int:
    """`numa_node` if it is one of `nodes`, else ValueError naming it."""
    if isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node not in nodes:
        raise ValueError(f"numa_node: expected one of this machine's NUMA nodes {nodes} (None to follow the GPU, or 'off'), got {numa_node!r}")
    return numa_node


def gpu_pci_address(index: int) -> str | None:
    """The sysfs name (domain:bus:device.function) of GPU `index`, as torch numbers GPUs."""
    properties = torch.cuda.get_device_properties(index)
    # Read by name: the PCI fields came in a later torch than the one typeshed's stubs describe.
    try:
        domain, bus, device = (getattr(properties, field) for field in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    except AttributeError:
        return None
    # A GPU is function 0 of its PCI device; torch does not report the function.
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_numa_node(pci: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of PCI device `pci`, or None where the firmware gives none (-1 or no file)."""
    try:
        node = int((Path(sysfs) / "bus" / "pci" / "devices" / pci.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def release_cached_host_memory() -> None:
    """Free the page-locked blocks torch's caching host allocator keeps for reuse.

    `torch.empty(..., pin_memory=True)` hands back a freed block of the same
    power-of-two size class when it has one, placed wherever it was first
    allocated; after this call the next pinned allocation is a fresh one, placed
    by the memory policy in force.  Blocks still awaiting a stream's event stay."""
    accelerator = getattr(torch, "accelerator", None)
    release = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


# -- the calling thread's memory policy ---------------------------------------------------


class _NodeMask(ctypes.Array):
    _type_ = ctypes.c_ulong
    _length_ = _MASK_WORDS


@dataclass(frozen=True)
class MemoryPolicy:
    """A thread's memory policy as get_mempolicy reports it: mode (with its flags) and nodes."""

    mode: int
    nodes: tuple[int, ...]


@contextmanager
def bind_allocations(node: int | None) -> Iterator[None]:
    """While active, pages first touched by this thread come from `node` (MPOL_PREFERRED:
    another node only when it is full).  The previous policy is restored after.  No-op for None.

    The policy is per thread and acts when a page is first touched, not when it is
    mapped: allocate and touch (pin, register, write) inside the block, in this thread."""
    if node is None:
        yield
        return
    previous = memory_policy()
    _set_mempolicy(MPOL_PREFERRED, (node,))
    try:
        yield
    finally:
        _set_mempolicy(previous.mode, previous.nodes)


def memory_policy() -> MemoryPolicy:
    """The calling thread's memory policy (get_mempolicy with no address)."""
    mode, mask = ctypes.c_int(), _NodeMask()
    _syscall(1, "get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(MASK_BITS), None, ctypes.c_ulong(0))
    words = list(mask)
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    return MemoryPolicy(mode.value, tuple(n for n in range(MASK_BITS) if words[n // bits] >> (n % bits) & 1))


def page_nodes(address: int, nbytes: int, step_pages: int = 1) -> list[int]:
    """The NUMA node of every `step_pages`-th page of [address, address + nbytes) (move_pages
    with no target nodes).  A negative entry is -errno: -ENOENT (-2) for a page not yet touched."""
    if nbytes <= 0:
        raise ValueError(f"nbytes: expected > 0, got {nbytes}")
    if step_pages < 1:
        raise ValueError(f"step_pages: expected >= 1, got {step_pages}")
    first = address - address % PAGE_BYTES
    pages = list(range(first, address + nbytes, PAGE_BYTES * step_pages))
    addresses = (ctypes.c_void_p * len(pages))(*pages)
    status = (ctypes.c_int * len(pages))()
    _syscall(2, "move_pages", 0, ctypes.c_ulong(len(pages)), addresses, None, status, 0)
    return list(status)


def tensor_page_nodes(tensor: torch.Tensor, step_pages: int = 1) -> list[int]:
    """`page_nodes` over the storage of a CPU tensor."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor: expected a host (CPU) tensor, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    return page_nodes(storage.data_ptr(), storage.nbytes(), step_pages)


def _set_mempolicy(mode: int, nodes: tuple[int, ...]) -> None:
    mask = _NodeMask()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    # The kernel reads maxnode - 1 bits of the mask (a historic off-by-one).
    _syscall(0, "set_mempolicy", ctypes.c_int(mode), mask, ctypes.c_ulong(MASK_BITS + 1))


def _syscall(which: int, name: str, *args: object) -> None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, f"{name}: NUMA placement is implemented for {', '.join(_SYSCALLS)}, not {platform.machine()}")
    if _libc().syscall(ctypes.c_long(numbers[which]), *args) < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{name}: {os.strerror(code)}")


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc
