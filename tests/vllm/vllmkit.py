"""vLLM 0.33.0's offloading classes on the CPU, for the spec's tests (`tox -e vllm`).

KV caches are vLLM's own `CanonicalKVCaches` over CPU block tensors of random
bytes.  The reference is vLLM's own `CPUOffloadingWorker` run on the same
blocks: its handler checks `is_cuda` of its block tensors, and records CUDA
events on CUDA streams; here the tensors say they are device tensors, streams
and events are host stand-ins that have nothing to order, and the compiled
`swap_blocks_batch` op is a host memmove of each descriptor it is given.
Everything that decides which bytes go where is vLLM's own code.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm 0.33.0 is not installed here (tox -e vllm installs it)")

from vllm import _custom_ops  # noqa: E402
from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu import gpu_worker  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

BLOCK_TOKENS = 16
__all__ = ["CPULoadStoreSpec", "SharedOffloadRegion", "gpu_worker"]  # vLLM's, for the tests: this module skips them without vllm


class DeviceLike(torch.Tensor):
    """A CPU tensor that vLLM's handler takes for a device tensor (its checks read `is_cuda`)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


class _Event:
    """Host copies are done when the op returns: the event is always reached."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


class _Platform:
    Stream = _Stream

    @staticmethod
    def current_stream() -> _Stream:
        return _Stream()

    @staticmethod
    def stream(stream: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False


def memmove_batch(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False) -> None:
    """`swap_blocks_batch` on the host: each descriptor one plain copy."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


@contextlib.contextmanager
def vllm_on_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run vLLM's CPU worker on host tensors: the stand-ins of the module docstring."""
    monkeypatch.setattr(gpu_worker, "current_platform", _Platform)
    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)  # no driver to page-lock with
    monkeypatch.setattr(gpu_worker, "HAS_TRITON", False)  # the Triton copy kernel is the other compiled op
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(_custom_ops, "swap_blocks_batch", memmove_batch)
    yield


@dataclass
class Geometry:
    """Block tensors (page bytes each) and, per KV cache group, the tensors its layers use."""

    pages: Sequence[int]
    groups: Sequence[Sequence[int]]
    num_blocks: int = 96


PER_LAYER = Geometry(pages=[2048] * 4, groups=[[0, 1, 2, 3]])  # 4 layers, a block of each
CROSS_LAYER = Geometry(pages=[8192], groups=[[0]])  # one tensor: a block holds every layer
HYBRID = Geometry(pages=[2048, 2048, 2048, 1024], groups=[[0, 1], [1, 2, 3]])  # two groups, shared tensors, two page sizes
MLA = Geometry(pages=[576 * 2 * BLOCK_TOKENS] * 3, groups=[[0, 1, 2]])  # DeepSeek's latent rows, bf16


def block_tensors(geometry: Geometry, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (geometry.num_blocks, page), dtype=torch.int8, generator=gen) for page in geometry.pages]


def kv_caches(tensors: Sequence[torch.Tensor], geometry: Geometry, mappings: dict[int, base.CanonicalPageMapping] | None = None,
              device_like: bool = False) -> base.CanonicalKVCaches:
    """vLLM's CanonicalKVCaches over `tensors` (as its connector worker builds them in register_kv_caches)."""
    wrap = (lambda t: t.as_subclass(DeviceLike)) if device_like else (lambda t: t)
    mappings = mappings or {}
    return base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(wrap(t), int(t.shape[1])) for t in tensors],
        group_data_refs=[[base.CanonicalKVCacheRef(t, geometry.pages[t], mappings.get(t)) for t in group] for group in geometry.groups],
    )


def whole_page_mapping(page: int) -> base.CanonicalPageMapping:
    """The canonical mapping of one rank without parallelism: the page is its own canonical page."""
    run = base.CopyRun(0, 0, page, 1, page, page)
    return base.CanonicalPageMapping(page, page, (run,), num_writers=1, writer_index=0, parallelism_agnostic=True)


def offloading_config(geometry: Geometry, blocks_per_chunk: int, cpu_bytes: int, **extra: object) -> OffloadingConfig:
    """vLLM's OffloadingConfig for one worker (what build_offloading_config makes of a single-GPU engine)."""
    per_block = sum(geometry.pages[t] for group in geometry.groups for t in group)
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(BLOCK_TOKENS, tuple(f"layer.{t}" for t in group), g) for g, group in enumerate(geometry.groups)),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=True,
        extra_config={"spec_name": "PortableKVOffloadingSpec", "spec_module_path": "portable_kv.engines.vllm", "cpu_bytes_to_use": cpu_bytes,
                      **extra},
        engine_id="portable-kv-test",
        model=OffloadingModelConfig(name="test", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def gpu_spec(blocks_per_group: Sequence[Sequence[int]], first_logical: Sequence[int]) -> base.GPULoadStoreSpec:
    flat = [b for blocks in blocks_per_group for b in blocks]
    return base.GPULoadStoreSpec(flat, [len(b) for b in blocks_per_group], list(first_logical))
