"""The engine section's schedule: one row's device pools, a backend's host pools, and a
cache-hit prefill as SGLang's cache controller runs it.

Every layer's load enqueued first on a load stream, an event recorded after each (as
SGLang's start_loading does); then the forward on the model's (current) stream, where
layer i waits on event i before it computes.  As SGLang's hybrid stack does, the
section keeps two device pools and two host pools, one pair per kind (full, SWA).
"""

from __future__ import annotations

import torch

import portable_kv as pk

from ..allocator import FreeListAllocator
from .engine_forward import Forward
from .engine_geometry import Model, pages, window_tokens
from .io_paths import AutoWatch
from .sglang_jit import Load
from .staged import REQUEST_TOKENS, churned_slots

# SGLang's default host layout for HiCache (--hicache-mem-layout).
HOST_LAYOUT = "layer_first"
HOST_RATIO = 4.0  # host pool : device pool, so that churn leaves the prefix's pages among others (as staged.py)
# ... and at least this many requests' worth of tokens, so that the churn's requests fit the SWA pool
HOST_REQUESTS = 2


class Pools:
    """One row's device pools (full, SWA) and the prefix's device slots; host pools per backend."""

    def __init__(self, model: Model, page_size: int, prefix: int, new: int, device: torch.device) -> None:
        self.model, self.page_size, self.prefix, self.new = model, page_size, prefix, new
        if prefix % page_size:
            raise ValueError(f"--page-size {page_size}: the engine section's prefix of {prefix} tokens is not whole pages")
        self.full_ids = list(model.full_layers)
        self.swa_ids = [i for i in range(model.layers) if not model.is_full(i)]
        self.tokens = {True: prefix, False: window_tokens(model, prefix, page_size)}
        device_pages = {}
        for full, keep in ((True, prefix + new), (False, pages(model.window, page_size) * page_size + new)):
            need = pages(keep, page_size)
            # spare pages, and page 0, which SGLang's allocator keeps for padded tokens
            device_pages[full] = need + max(8, need // 8) + 1
        self.dev = {
            True: pk.DeviceKVPool(len(self.full_ids), device_pages[True] * page_size, page_size, model.full_kv_heads, model.k_dim,
                                  model.v_dim, dtype=model.torch_dtype, device=device),
            False: pk.DeviceKVPool(len(self.swa_ids), device_pages[False] * page_size, page_size, model.swa_kv_heads, model.swa_k_dim,
                                   model.swa_v_dim, dtype=model.torch_dtype, device=device),
        }
        for pool in self.dev.values():
            for t in (*pool.k_buffer, *pool.v_buffer):
                t.normal_()  # data, not zeros: the forward's matmuls read these buffers
        # The prefix's device slots as SGLang's own allocator leaves them after churn (runs where a
        # freed request's pages are reused whole: direct io merges them with the host's runs).
        self.dev_idx = {full: churned_slots(device_pages[full] - 1, page_size, self.tokens[full] // page_size, seed=2 + int(full),
                                            allocator=FreeListAllocator) for full in (True, False)}
        # model layer -> (kind, index in its pool)
        self.slot = {i: (True, j) for j, i in enumerate(self.full_ids)} | {i: (False, j) for j, i in enumerate(self.swa_ids)}
        self.kv = [(self.dev[full].k_buffer[j], self.dev[full].v_buffer[j]) for full, j in (self.slot[i] for i in range(model.layers))]

    def bytes(self) -> tuple[int, int]:
        """Bytes one prefill's loads move, counted from the index tensors: (full layers, SWA layers)."""
        m = self.model
        return (len(self.full_ids) * self.dev_idx[True].numel() * m.token_layer_bytes(True),
                len(self.swa_ids) * self.dev_idx[False].numel() * m.token_layer_bytes(False))

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in self.dev.values() for t in (*pool.k_buffer, *pool.v_buffer))


class HostSide:
    """The host pools of one backend (one per kind), the prefix's host slots, random data in them."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.host = {full: pk.AsymmetricHostPool(pools.dev[full], layout=HOST_LAYOUT, io_backend="kernel",
                                                 host_to_device_ratio=max(HOST_RATIO, HOST_REQUESTS * REQUEST_TOKENS / pools.dev[full].size))
                     for full in (True, False)}
        p = pools.page_size
        self.host_idx = {full: churned_slots(self.host[full].page_num, p, pools.tokens[full] // p, seed=int(full)) for full in (True, False)}
        gen = torch.Generator().manual_seed(2)
        for full, host in self.host.items():
            idx = self.host_idx[full]
            for buf in (host.k_buffer, host.v_buffer):
                buf[:, idx] = torch.randn(buf.shape[0], idx.numel(), *buf.shape[2:], generator=gen).to(buf.dtype)

    def indices(self, io: str, device: torch.device) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        # As SGLang's cache controller passes them: on the GPU for its kernel io (which portable_kv's
        # kernel and bulk paths serve), host-resident otherwise.
        on = device if io in ("kernel", "bulk") else torch.device("cpu")
        return {full: (self.host_idx[full].to(on), self.pools.dev_idx[full].to(on)) for full in (True, False)}

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.host.values() for t in (h.k_buffer, h.v_buffer))

    def auto_watch(self) -> dict[str, AutoWatch]:
        """Per kind of pool ("full", "swa"), which paths its auto loads take from now on."""
        return {"full" if full else "swa": AutoWatch(host) for full, host in self.host.items()}

    def close(self) -> None:
        for host in self.host.values():
            host.close()


class Engine:
    """The schedule of a cache-hit prefill: loads on a load stream, the forward on the current one.
    A layer's load goes through the host pool's io path `io`, or where `sglang` is given (per kind
    of pool, full or SWA), through SGLang's kernel, with the indices on the device."""

    def __init__(self, pools: Pools, side: HostSide, forward: Forward, io: str, gpu: bool, sglang: dict[bool, Load] | None = None) -> None:
        self.pools, self.side, self.io, self.gpu, self.sglang = pools, side, io, gpu, sglang
        device = pools.dev[True].device
        self.idx = side.indices("kernel" if sglang is not None else io, device)
        self.layers = forward.layers(pools.kv, pools.prefix, pools.new)
        n = pools.model.layers
        # SGLang's controller: its own load stream, an event per layer (LayerDoneCounter).
        self.stream = torch.cuda.Stream(device) if gpu else None
        self.events = [torch.cuda.Event() for _ in range(n)] if gpu else []

    def load(self, layer: int) -> None:
        full, j = self.pools.slot[layer]
        host_idx, dev_idx = self.idx[full]
        if self.sglang is not None:
            pool, host = self.pools.dev[full], self.side.host[full]
            self.sglang[full]([pool.k_buffer[j], pool.v_buffer[j]], [host.k_buffer[j], host.v_buffer[j]], dev_idx, host_idx)
            return
        self.side.host[full].load_to_device_per_layer(self.pools.dev[full], host_idx, dev_idx, j, io_backend=self.io)

    def loads(self) -> None:
        """Every layer's load alone, on the load stream; the current stream waits for the last."""
        if not self.gpu:
            for i in range(len(self.layers)):
                self.load(i)
            return
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for i in range(len(self.layers)):
                self.load(i)
        current.wait_stream(self.stream)

    def prefill(self) -> None:
        """Every load enqueued first, then the forward; layer i waits for its own load only."""
        if not self.gpu:
            self.loads()
            for layer in self.layers:
                layer()
            return
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)  # the previous forward's reads of these slots come first
        with torch.cuda.stream(self.stream):
            for i, event in enumerate(self.events):
                self.load(i)
                event.record(self.stream)
        for event, layer in zip(self.events, self.layers):
            current.wait_event(event)
            layer()

    def clear_loaded(self) -> None:
        """Overwrite the prefix's device slots, so that a check after the loads sees their data."""
        for full, pool in self.pools.dev.items():
            slots = self.pools.dev_idx[full].to(pool.device)
            for t in (*pool.k_buffer, *pool.v_buffer):
                t.index_fill_(0, slots, 0)

    def loaded_correctly(self) -> bool:
        """The prefix's device slots hold the host slots' K and V, every layer of both pools."""
        for full, pool in self.pools.dev.items():
            host = self.side.host[full]
            host_idx, dev_idx = self.side.host_idx[full], self.pools.dev_idx[full]
            for j in range(len(pool.k_buffer)):
                for dev_buf, host_buf in ((pool.k_buffer[j], host.k_buffer[j]), (pool.v_buffer[j], host.v_buffer[j])):
                    if not torch.equal(dev_buf[dev_idx.to(dev_buf.device)].cpu(), host_buf[host_idx]):
                        return False
        return True
