"""SGLang's JIT kernels as rows of the staged section: over a layer_first host pool of the
section's workload, a per-layer load from an idle GPU and every layer's back to back, each
checked once against the host's bytes; the per-layer loads for the rows beside compute.
Where SGLang's kernels cannot run here, one row of the pool says why (sglang_jit.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import portable_kv as pk

from .measure import Clock, gbps
from .rows import Row
from .sections import percent, with_clock
from .sglang_jit import KERNELS, REGISTER_QUOTA, SGLangKernels, kernels
from .workload import Workload

LABELS = {"default": "peer: SGLang JIT kernel as SGLang calls it", "register": f"peer: SGLang JIT register kernel, {REGISTER_QUOTA} blocks"}


class SGLangPeers:
    """SGLang's kernels over `host` (layer_first) and `w`'s pages, or the reason they cannot run."""

    def __init__(self, w: Workload, host: pk.AsymmetricHostPool | pk.MLAHostPool, found: SGLangKernels | None, reason: str) -> None:
        self.w, self.host, self.found, self.reason = w, host, found, reason
        self.kernels = KERNELS if found is not None else ()
        device = w.dev.device
        self.dev_idx, self.host_idx = (w.dev_idx.to(device), w.host_idx.to(device)) if found is not None else (w.dev_idx, w.host_idx)

    @classmethod
    def of(cls, w: Workload, host: pk.AsymmetricHostPool | pk.MLAHostPool) -> SGLangPeers:
        found, reason = kernels(cls.buffers(w.dev, 0), w.page_size)
        return cls(w, host, found, reason)

    @staticmethod
    def buffers(pool: object, layer: int) -> list[torch.Tensor]:
        """One layer's buffers of a device or host pool (K and V, or the latent), as SGLang's kernels take them."""
        return [getattr(pool, name)[layer] for name in pool.kind.buffers]

    def label(self, kernel: str) -> str:
        return LABELS[kernel]

    def layer_load(self, kernel: str) -> Callable[[int], None]:
        load = self.found.load(kernel)
        return lambda layer: load(self.buffers(self.w.dev, layer % self.w.layers), self.buffers(self.host, layer % self.w.layers),
                                  self.dev_idx, self.host_idx)

    def extra(self, kernel: str) -> dict:
        return {"sglang": self.found.version, "kernel": self.found.took(kernel)}

    def rows(self, clock: Clock, reps: int, ceil: dict, where: str) -> list[Row]:
        w = self.w
        if self.found is None:
            return [Row("staged", f"peer: SGLang JIT kernels, {where}", "-", w.page_size, extra={"absent": self.reason})]
        rows = []
        for kernel in self.kernels:
            load = self.layer_load(kernel)
            verified = self.verify(load)
            turn = iter(range(1 << 62))
            seconds, host_s = clock.time(lambda load=load, turn=turn: load(next(turn)), reps)
            rate = gbps(w.layer_bytes, seconds)
            extra = {**self.extra(kernel), "verified": verified, **with_clock(clock)}
            rows.append(Row("staged", f"{self.label(kernel)}, {where}", "h2d", w.page_size, rate, percent(rate, ceil, "h2d"), host_s * 1e6,
                            extra=extra))

            def every_layer(load=load) -> None:
                for layer in range(w.layers):
                    load(layer)

            seconds, host_s = clock.time(every_layer, max(3, reps // 2), warmup=1)
            rate = gbps(w.layer_bytes * w.layers, seconds)
            rows.append(Row("staged", f"{self.label(kernel)}, {where}, {w.layers} layers back to back", "h2d", w.page_size, rate,
                            percent(rate, ceil, "h2d"), host_s * 1e6 / w.layers, extra={**self.extra(kernel), **with_clock(clock)}))
        return rows

    def verify(self, load: Callable[[int], None]) -> bool:
        """Layer 0's rows after one load hold the host's bytes (random ones written first)."""
        gen = torch.Generator().manual_seed(3)
        for dev_buf, host_buf in zip(self.buffers(self.w.dev, 0), self.buffers(self.host, 0)):
            rows = host_buf[self.w.host_idx]
            host_buf[self.w.host_idx] = torch.randn(rows.shape, generator=gen).to(host_buf.dtype)
            dev_buf[self.dev_idx] = 0
        load(0)
        torch.cuda.synchronize()
        return all(torch.equal(dev_buf[self.dev_idx].cpu().view(torch.uint8), host_buf[self.w.host_idx].view(torch.uint8))
                   for dev_buf, host_buf in zip(self.buffers(self.w.dev, 0), self.buffers(self.host, 0)))
