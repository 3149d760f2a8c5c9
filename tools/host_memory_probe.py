"""Whether dropped and closed host pools give their host memory back, per backend and io
path, one step at a time (construct; + a per-layer load; + an all-layer backup), and
where a buffer outlives its pool: who refers to it, from Python or from C++.

Run on a GPU host: python3 tools/host_memory_probe.py [--backends cuda,triton]
Under compute-sanitizer, pass --show-backtrace no: the sanitizer keeps the Python frames
of every kernel launch for its reports, and with them the pool each frame's `self` is.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import types
import weakref

import torch

import portable_kv as pk
from portable_kv import backends

STEPS = ("construct", "load", "load+backup")


def referrers(obj: object, depth: int = 0, seen: set[int] | None = None, limit: int = 4) -> list[str]:
    """The chain of Python objects that refer to `obj`, a few levels up."""
    # Frames by id only: a frame bound to a local would refer to itself, and keep `obj` alive.
    here = inspect.currentframe()
    caller = id(here.f_back) if here is not None else None
    seen = seen if seen is not None else {id(here)}
    del here
    lines = []
    for ref in gc.get_referrers(obj):
        if id(ref) in seen:
            continue
        if isinstance(ref, types.FrameType):  # a frame that outlived its call: held by a traceback or a generator
            if id(ref) != caller and ref.f_code.co_name not in ("probe", "referrers", "main"):
                lines.append("  " * depth + f"<- frame {ref.f_code.co_filename}:{ref.f_lineno} {ref.f_code.co_name}")
                seen.add(id(ref))
                if depth < limit:
                    lines += referrers(ref, depth + 1, seen, limit)
            continue
        seen.add(id(ref))
        text = type(ref).__name__
        if isinstance(ref, dict):
            text += f" keys={[k for k, v in ref.items() if v is obj][:3]}"
        lines.append("  " * depth + "<- " + text[:160])
        if depth < limit and not isinstance(ref, types.ModuleType):
            lines += referrers(ref, depth + 1, seen, limit)
    return lines


def sharing(buffer: torch.Tensor) -> list[str]:
    """Live tensors that view the same memory (a view keeps its base's TensorImpl)."""
    begin = buffer.data_ptr()
    end = begin + buffer.numel() * buffer.element_size()
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj is not buffer and obj.device.type == "cpu":
            try:
                if begin <= obj.data_ptr() < end:
                    # torch's `_base` is its one way to tell a view (which keeps its base's memory)
                    # from a tensor made over the same memory; no public name says it.
                    found.append(f"tensor {tuple(obj.shape)} {obj.dtype} base={'yes' if obj._base is not None else 'no'}: "
                                 + "; ".join(referrers(obj, limit=2)[:6]))
            except RuntimeError:
                continue
    return found


def pinned_in_use() -> int:
    """Bytes torch's caching host allocator has handed out and not had back (0 where it does not say)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0))


def in_ranges(ranges: list[tuple[int, int]]) -> list[str]:
    """Live Python tensors whose memory lies in one of `ranges` (a dropped pool's buffers)."""
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                address = obj.data_ptr()
            except RuntimeError:
                continue
            if any(begin <= address < end for begin, end in ranges):
                found.append(f"tensor {tuple(obj.shape)} {obj.dtype} on {obj.device}: " + "; ".join(referrers(obj, limit=3)[:10]))
    return found


def probe(backend: str, io: str, step: str, rounds: int = 6) -> bool:
    dev = pk.DeviceKVPool(2, 4096, 16, 4, 192, 128, dtype=torch.bfloat16)
    idx = torch.arange(512)
    buffers, pools, ranges = [], [], []
    pinned_before = pinned_in_use()
    pool_bytes = 0
    for n in range(rounds):
        host = pk.AsymmetricHostPool(dev, layout="page_first_direct", io_backend=io)
        if step != "construct":
            host.load_to_device_per_layer(dev, idx, idx, n % 2)
        if step == "load+backup":
            host.backup_from_device_all_layer(dev, idx, idx)
        buffers.append(weakref.ref(host.k_buffer))
        ranges += [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (host.k_buffer, host.v_buffer)]
        pool_bytes = sum(t.numel() * t.element_size() for t in (host.k_buffer, host.v_buffer))
        pools.append(weakref.ref(host))
        if n % 2:
            host.close()
        del host
    backends.current().synchronize()
    gc.collect()
    alive = [r() for r in buffers if r() is not None]
    pools_alive = sum(r() is not None for r in pools)
    left = pinned_in_use() - pinned_before
    print(f"{backend:7s} {io:7s} {step:12s} buffers alive {len(alive)}/{rounds}, pools alive {pools_alive}/{rounds}, "
          f"pinned bytes left {left}")
    if left > 0:
        for line in in_ranges(ranges)[:10]:
            print("    holds dropped memory: " + line)
    if alive:
        k = alive[0]
        # torch's `_use_count()` counts the TensorImpl's C++ owners too (a frame the sanitizer or
        # an extension holds), which `sys.getrefcount` cannot see; no public name gives it.
        print(f"    refcount {sys.getrefcount(k) - 2}, TensorImpl uses {k._use_count()}, gc.garbage {len(gc.garbage)}")
        for line in referrers(k)[:30]:
            print("    " + line)
        for line in sharing(k)[:10]:
            print("    shares memory: " + line)
        pool = next((r() for r in pools if r() is not None), None)
        if pool is not None:
            print(f"    pool referrers (refcount {sys.getrefcount(pool) - 2}):")
            for line in referrers(pool)[:30]:
                print("    " + line)
    # A few bytes left once per process (the first 4-byte bad-index flags) are not a pool's memory.
    released = not alive and pools_alive == 0 and left < pool_bytes
    del alive
    return released


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cuda,triton")
    args = parser.parse_args()
    clean = True
    first = True
    for name in args.backends.split(","):
        if backends.unavailable_reason(name) is not None:
            print(f"{name}: unavailable ({backends.unavailable_reason(name)})")
            continue
        backend = backends.use(name)
        for io in backend.io_backends:
            for step in STEPS:
                if first:  # what the process's first pool leaves, once, is reported apart
                    print("warm-up: ", end="")
                    probe(name, io, step, rounds=1)
                    first = False
                clean &= probe(name, io, step)
    print("every pool released" if clean else "SOME POOLS OUTLIVE THEIR DROP")


if __name__ == "__main__":
    main()
