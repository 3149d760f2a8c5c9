"""A vLLM cache-hit prefill: the whole hit loaded before the forward, against layer-wise loading.

vLLM 0.33.0's OffloadingConnector loads a same-step hit whole and then runs the
forward; portable_kv's PortableKVLayerwiseConnector enqueues every layer's load
at once and makes each layer's attention wait for its own and the next layer's
load (engines/vllm/connector.py), the first layer's before the forward.  Both
move the hit through the vLLM spec's host tier (`HostTier`: per-layer block
tensors of vLLM's page, one plan per transfer) on the vendor's default io path,
on `kernel`, and on NVIDIA on `direct` (the copy engines).

Per model at one GPU's share and cache hit (4K to 32K tokens) plus 512 new
tokens: the forward alone, the loads alone, then the time to first token of
each way, as ms and as x of max(forward alone, the hit's bytes at the run's
host-to-device ceiling).  The forward is each layer's matmuls at the model's
shapes (weights shared by the layers) and an SDPA of the new tokens over the
hit and themselves, keys and values in contiguous buffers (vLLM's paged
attention reads as much); DeepSeek-V3 is its TP8 share: 16 of 128 heads, the cached latents
expanded to keys and values as vLLM's MLA prefill does, 9 of 256 experts a
token spread over 8 GPUs.  On the CPU backend a scaled model runs so that CI
exercises the code; there are no streams and the numbers say nothing about a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from .. import backends
from ..engines.vllm import HostTier, choose_io
from ..engines.vllm.host_tier import Slot, TierTransfer
from .context import Context
from .engine_report import ceiling_rate
from .rows import Row

SECTION = "vllm-prefill"
BLOCK = 16  # vLLM's default block_size: a block tensor's row is 16 tokens of one layer
NEW_TOKENS = 512
CPU_NEW_TOKENS = 32


@dataclass(frozen=True)
class PrefillModel:
    """One GPU's share of a model's prefill: its layers' KV and matmuls."""

    name: str
    layers: int
    kv_bytes: int  # one token's KV in one layer, as vLLM's block tensors hold it
    heads: int  # attention heads on this GPU
    qk_dim: int
    v_dim: int
    # Per layer, in order: (rows, k, n) of each matmul; rows "new" (the new tokens), "context" (hit and new
    # tokens) or "experts" (new tokens x experts_per_token, the share of them on this GPU).
    matmuls: tuple[tuple[str, int, int], ...]
    attention_after: int  # the matmuls before the attention (the projections its KV write follows)
    experts_per_token: float = 1.0


LLAMA_3_8B = PrefillModel("Llama-3-8B", 32, 2 * 8 * 128 * 2, 32, 128, 128,
                          (("new", 4096, 6144), ("new", 4096, 4096), ("new", 4096, 2 * 14336), ("new", 14336, 4096)), 1)
DEEPSEEK_V3 = PrefillModel("DeepSeek-V3 TP8", 61, 576 * 2, 16, 192, 128,
                           (("new", 7168, 1536 + 576), ("new", 1536, 16 * 192), ("context", 512, 16 * (128 + 128)),
                            ("new", 16 * 128, 7168), ("experts", 7168, 2 * 2048), ("experts", 2048, 7168)), 3,
                           experts_per_token=9 / 8)
CPU_MODEL = PrefillModel("scaled (CPU)", 4, 2 * 2 * 32 * 2, 4, 32, 32,
                         (("new", 128, 256), ("new", 128, 128), ("new", 128, 512), ("new", 256, 128)), 1)
GPU_HITS = (4096, 8192, 16384, 32768)
CPU_HITS = (64, 256)


class Forward:
    """The model's forward over `hit` cached and `new` new tokens, a layer at a time."""

    def __init__(self, model: PrefillModel, hit: int, new: int, device: torch.device) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model, self.new, self.context = model, new, hit + new
        rows = {"new": new, "context": hit + new, "experts": max(1, round(new * model.experts_per_token))}
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = [torch.randn(k, n, device=device, dtype=dtype, generator=gen) * k**-0.5 for _, k, n in model.matmuls]
        self.inputs = [torch.randn(rows[r], k, device=device, dtype=dtype, generator=gen) for r, k, _ in model.matmuls]
        self.q = torch.randn(1, model.heads, new, model.qk_dim, device=device, dtype=dtype, generator=gen)
        # Keys and values a query head (grouped heads expanded): every SDPA backend takes them, flash attention too.
        self.k = torch.randn(1, model.heads, hit + new, model.qk_dim, device=device, dtype=dtype, generator=gen)
        self.v = torch.randn(1, model.heads, hit + new, model.v_dim, device=device, dtype=dtype, generator=gen)

    def projections(self) -> None:
        for i in range(self.model.attention_after):
            torch.matmul(self.inputs[i], self.weights[i])

    def rest(self) -> None:
        F.scaled_dot_product_attention(self.q, self.k, self.v)
        for i in range(self.model.attention_after, len(self.weights)):
            torch.matmul(self.inputs[i], self.weights[i])

    def __call__(self) -> None:
        for _ in range(self.model.layers):
            self.projections()
            self.rest()


class Hit:
    """A cache hit in the vLLM spec's host tier: one block tensor a layer, its blocks' host copies."""

    def __init__(self, model: PrefillModel, hit: int, io: str, device: torch.device) -> None:
        page, blocks = BLOCK * model.kv_bytes, hit // BLOCK
        self.tensors = [torch.zeros(blocks, page, dtype=torch.int8, device=device) for _ in range(model.layers)]
        kv = SimpleNamespace(tensors=[SimpleNamespace(tensor=t, page_size_bytes=page) for t in self.tensors],
                             group_data_refs=[[SimpleNamespace(tensor_idx=i, page_size_bytes=page, mapping=None)
                                               for i in range(model.layers)]])
        self.tier = HostTier(kv, 1, blocks, {"store": io, "load": io})
        order = np.random.default_rng(0).permutation(blocks).astype(np.int64)
        self.transfer: TierTransfer = self.tier.prepare(self.tier.plan(order, [blocks], [0], np.arange(blocks)), True)
        self.slots = [Slot(0, layer) for layer in range(model.layers)]
        self.nbytes = hit * model.kv_bytes * model.layers

    def wait(self, *layers: int) -> None:
        """The current stream waits until these layers have landed."""
        for layer in layers:
            if layer < len(self.slots):
                for landed in self.transfer.ready(self.slots[layer]):
                    landed.wait()

    def close(self) -> None:
        self.tier.close()


class Prefill:
    """The two ways to run a prefill with a hit, on the current stream, the loads on a stream of their own."""

    def __init__(self, forward: Forward, hit: Hit, gpu: bool) -> None:
        self.forward, self.hit = forward, hit
        self.stream = torch.cuda.Stream() if gpu else None

    def loads(self, per_layer: bool) -> None:
        launch = (lambda: self.hit.transfer.run_layers(self.hit.slots)) if per_layer else self.hit.transfer.run
        if self.stream is None:
            launch()
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            launch()

    def loads_alone(self) -> None:
        self.loads(per_layer=False)
        self.join()

    def whole_hit(self) -> None:
        self.loads(per_layer=False)
        self.join()
        self.forward()

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def layerwise(self) -> None:
        self.loads(per_layer=True)
        self.hit.wait(0)
        for layer in range(self.forward.model.layers):
            self.forward.projections()
            self.hit.wait(layer, layer + 1)  # the connector's rule: a layer's attention waits for its own and the next load
            self.forward.rest()


def measure(ctx: Context) -> list[Row]:
    """Per model and hit: the forward alone, the loads alone, the whole hit then the forward, and layer-wise loading,
    per io path (the vendor's default, kernel, and direct on NVIDIA)."""
    backend = backends.current()
    models, hits = ((LLAMA_3_8B, DEEPSEEK_V3), GPU_HITS) if ctx.gpu else ((CPU_MODEL,), CPU_HITS[:1] if ctx.quick else CPU_HITS)
    new = NEW_TOKENS if ctx.gpu else CPU_NEW_TOKENS
    # The copy engines (direct) take no SMs from the forward; on AMD they are a loop of single copies (io_paths.py).
    ios = list(dict.fromkeys([choose_io(backend, None)["load"], "kernel", *(["direct"] if backend.vendor == "nvidia" else [])]))
    rate = ceiling_rate(ctx.ceil)
    rows = []
    ctx.progress.expect(len(models) * len(hits) * len(ios))
    for model in models:
        for hit in hits:
            ctx.progress(f"{SECTION}: {model.name}, {hit} cached + {new} new tokens")
            forward = Forward(model, hit, new, ctx.device)
            forward_s, _ = ctx.clock.time(forward, ctx.reps)
            nbytes = hit * model.kv_bytes * model.layers
            ceiling_s = nbytes / rate if rate else 0.0
            bound_s = max(forward_s, ceiling_s)
            base = f"{model.name} hit {hit} + {new}"
            shared = {"model": model.name, "hit_tokens": hit, "new_tokens": new, "layers": model.layers, "hit_bytes": nbytes,
                      "forward_ms": forward_s * 1e3, "loads_at_ceiling_ms": ceiling_s * 1e3, "bound_ms": bound_s * 1e3}
            rows.append(Row(SECTION, f"{base} forward alone", "-", BLOCK, extra={**shared, "ms": forward_s * 1e3,
                                                                               "x_bound": forward_s / bound_s}))
            for io in ios:
                hit_tier = Hit(model, hit, io, ctx.device)
                try:
                    prefill = Prefill(forward, hit_tier, ctx.gpu)
                    for name, fn in (("loads alone", prefill.loads_alone),
                                     ("whole hit, then the forward", prefill.whole_hit),
                                     ("layer-wise loads beside the forward", prefill.layerwise)):
                        seconds, host_s = ctx.clock.time(fn, ctx.reps)
                        rate_gbps = nbytes / seconds / 1e9 if name == "loads alone" else 0.0
                        pct = 100 * rate_gbps * 1e9 / rate if rate and rate_gbps else 0.0
                        rows.append(Row(SECTION, f"{base} {name} ({io})", "h2d", BLOCK, rate_gbps, pct, host_s * 1e6,
                                        extra={**shared, "io": io, "ms": seconds * 1e3, "x_bound": seconds / bound_s}))
                finally:
                    hit_tier.close()
                ctx.progress.done(f"{SECTION}: {model.name}, {hit} cached, {io}")
    return rows
