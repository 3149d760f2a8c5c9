"""`portable-kv bench --section engine`: a cache-hit prefill of MiMo-V2-Flash as SGLang runs it.

A request whose prefix is in the host tier: every layer's K/V of the prefix is loaded
(host to GPU) while the forward pass computes the new tokens, layer i waiting for
layer i's load only.  As SGLang's cache controller issues them: every layer's load
enqueued first on a load stream, an event recorded after each; then the forward on
the model's (current) stream, where layer i waits on event i before it computes.

MiMo-V2-Flash is hybrid: 9 full-attention layers and 39 sliding-window (SWA) layers,
with different KV heads.  As SGLang's hybrid stack does, the section keeps two device
pools and two host pools, one pair per kind.  A full layer loads the whole prefix; an
SWA layer holds only the window (the last `sliding_window` tokens) per request, so it
loads only the pages of the prefix's last `window` tokens.

The forward is matmuls of each layer's FLOP count (bf16): the QKV and output
projections, attention of the new tokens (to the prefix and themselves on full layers,
causal; to the window on SWA layers; its scores and values read from the device pool),
the router and the active experts' FFN (top-k experts at moe_intermediate_size).
Softmax, norms, RoPE and the MoE's dispatch are left out, and so are the weight reads
of the experts that a batch of tokens touches beyond the top-k FLOPs: the real layer is
slower, so it would hide more of each load than this one does.  FLOPs of a layer, for N new
tokens after P cached ones, on one GPU (h hidden, q query heads, kv KV heads, dk/dv head dims):
    2·N·h·(q·dk + kv·(dk + dv))   QKV projection
  + 2·q·(dk + dv)·keys            scores and values; keys = N·P + N(N+1)/2 on a full layer,
                                  the sum of min(window, P + i + 1) over the new tokens on SWA
  + 2·N·q·dv·h                    output projection
  + 2·N·h·experts                 router (MoE layers)
  + 6·N·h·I                       gate, up and down; I = top_k x the expert's width (MoE), or the dense width

Per cached prefix and new-token count, per backend and io path: prefill (loads and
forward together), the forward alone, the loads alone, the load time left exposed
(prefill minus forward alone), the loads' effective bandwidth, recomputing the whole
prefix and the new tokens instead (the prefill without a cache, in SGLang's chunks of
the recipe's --chunked-prefill-size), and the bound:
    max(forward alone + the first layer's load, every load at the ceiling + the last layer's compute),
the loads at the ceiling (bulk page-locked memcpy) that the same run measured.

On the CPU backend the section runs a scaled geometry (CPU_MODEL) so CI exercises the
code; there are no streams, loads and compute run one after the other, and the numbers
say nothing about a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

import portable_kv as pk

from .. import backends
from ..allocator import FreeListAllocator
from .measure import Clock, gbps
from .rows import Row, ceiling_text, on_gpu
from .sections import percent
from .staged import REQUEST_TOKENS, auto_took, churned_slots

SECTION = "engine"
IOS = ("kernel", "direct", "staged", "auto")
# SGLang's default host layout for HiCache (--hicache-mem-layout).
HOST_LAYOUT = "layer_first"
HOST_RATIO = 4.0  # host pool : device pool, so that churn leaves the prefix's pages among others (as staged.py)
# ... and at least this many requests' worth of tokens, so that the churn's requests fit the SWA pool
HOST_REQUESTS = 2
# Score tiles of at most this many elements (128 MiB of bf16): the flash-attention way of
# bounding the scores' memory, here so that the 64K prefix and 16K recompute chunks fit.
SCORE_ELEMENTS = 1 << 26
QUERY_BLOCK = 512  # fewest new tokens per score tile: keeps a 64K-key tile's matmuls long enough
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Model:
    """One GPU's share of the model: the KV pools' geometry and the forward's matmul sizes."""

    name: str
    layers: int
    hidden: int
    q_heads: int  # attention heads on this GPU
    full_kv_heads: int
    swa_kv_heads: int
    k_dim: int
    v_dim: int
    swa_k_dim: int
    swa_v_dim: int
    window: int  # sliding_window, tokens
    dense_intermediate: int  # dense MLP width on this GPU (dense layers)
    expert_intermediate: int  # one expert's width on this GPU
    top_k: int
    experts: int  # router outputs (the router is replicated on every GPU)
    chunk: int  # chunked prefill: tokens per forward when nothing is cached
    dense_layers: tuple[int, ...] = (0,)
    dtype: str = "bf16"  # of the KV cache and of the matmuls, which read it
    sources: tuple[str, ...] = field(default=(), compare=False)

    @property
    def full_layers(self) -> tuple[int, ...]:
        # MiMo-V2-Flash's hybrid_layer_pattern: full attention at the first layer and at every
        # 6th (5 SWA + 1 full blocks), as transformers' MiMoV2FlashConfig writes its layer_types.
        return tuple(i for i in range(self.layers) if i == 0 or (i + 1) % 6 == 0)

    def is_full(self, layer: int) -> bool:
        return layer in self.full_layers

    def kv_heads(self, layer: int) -> int:
        return self.full_kv_heads if self.is_full(layer) else self.swa_kv_heads

    def dims(self, layer: int) -> tuple[int, int]:
        return (self.k_dim, self.v_dim) if self.is_full(layer) else (self.swa_k_dim, self.swa_v_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def token_layer_bytes(self, full: bool) -> int:
        """Bytes of one token's K and V in one layer of a kind, on this GPU."""
        itemsize = self.torch_dtype.itemsize
        if full:
            return self.full_kv_heads * (self.k_dim + self.v_dim) * itemsize
        return self.swa_kv_heads * (self.swa_k_dim + self.swa_v_dim) * itemsize

    def active_intermediate(self, layer: int) -> int:
        return self.dense_intermediate if layer in self.dense_layers else self.top_k * self.expert_intermediate


# MiMo-V2-Flash on one GPU of SGLang's recipe.
#   The model: XiaomiMiMo/MiMo-V2-Flash config.json, as transformers' MiMoV2FlashConfig reads it
#   (num_hidden_layers 48, hidden_size 4096, num_attention_heads 64 (swa_num_attention_heads 64),
#   num_key_value_heads 4, head_dim 192, v_head_dim 128, swa_num_key_value_heads 8 (transformers:
#   "SWA layers double the kv heads"), swa_head_dim 192, swa_v_head_dim 128, sliding_window 128,
#   full attention at layer 0 and every 6th layer, intermediate_size 16384 (layer 0, dense; the
#   rest MoE), n_routed_experts 256, num_experts_per_tok 8, moe_intermediate_size 2048, no shared expert).
#   The parallelism: SGLang's MiMo-V2-Flash recipe for H200 (SGLang cookbook and the SGLang
#   day-0 blog: --tp-size 8 --dp-size 2 --enable-dp-attention --chunked-prefill-size 16384):
#   attention TP = tp / dp = 4, so KV heads 4/4 = 1 (full) and 8/4 = 2 (SWA), 64/4 = 16 query
#   heads; the MoE and the dense MLP split over TP 8: 2048/8 = 256 per expert, 16384/8 = 2048.
MIMO_V2_FLASH = Model(
    name="MiMo-V2-Flash, one GPU of TP 8 with DP attention 2 (attention TP 4)",
    layers=48, hidden=4096, q_heads=64 // 4, full_kv_heads=4 // 4, swa_kv_heads=8 // 4,
    k_dim=192, v_dim=128, swa_k_dim=192, swa_v_dim=128, window=128,
    dense_intermediate=16384 // 8, expert_intermediate=2048 // 8, top_k=8, experts=256, chunk=16384,
    dtype="bf16",  # the recipe's KV cache (--kv-cache-dtype auto: the bf16 activations of the FP8 checkpoint)
    sources=(
        "model: XiaomiMiMo/MiMo-V2-Flash config.json (transformers MiMoV2FlashConfig): 48 layers, hidden 4096, 64 query heads, "
        "full layers 4 KV heads K 192 / V 128, SWA layers 8 KV heads K 192 / V 128, sliding_window 128, full attention at "
        "layer 0 and every 6th layer (9 full, 39 SWA), layer 0 dense (intermediate 16384), MoE 8 of 256 experts at "
        "moe_intermediate_size 2048",
        "per GPU: SGLang's MiMo-V2-Flash recipe for H200 (--tp-size 8 --dp-size 2 --enable-dp-attention "
        "--chunked-prefill-size 16384): attention TP 4 (tp/dp): 16 query heads, KV heads 1 (full) and 2 (SWA); "
        "MLP TP 8: 256 per expert (x 8 active = 2048), dense 2048; router 256 (replicated); recompute in chunks of 16384",
    ),
)

# The CPU backend's stand-in, so that CI runs the code in seconds: the same hybrid pattern
# and K/V head dims, everything else scaled down.  Its numbers mean nothing.
CPU_MODEL = Model(
    name="MiMo-V2-Flash scaled for the CPU backend (not the model: exercises the code only)",
    layers=6, hidden=256, q_heads=4, full_kv_heads=1, swa_kv_heads=2,
    k_dim=192, v_dim=128, swa_k_dim=192, swa_v_dim=128, window=16,
    dense_intermediate=128, expert_intermediate=16, top_k=8, experts=16, chunk=1024,
    dtype="fp32",  # x86 CPUs without bf16 matrix units run a bf16 matmul ~25x slower than fp32
    sources=("scaled: 6 layers (full at 0 and 5), hidden 256, 4 query heads, KV heads 1 (full) and 2 (SWA), "
             "K 192 / V 128, window 16, MLP 128, chunks of 1024 tokens",),
)

# (cached prefix, new tokens)
GPU_CASES = ((4096, 512), (16384, 512), (65536, 512), (16384, 4096))
GPU_QUICK = ((4096, 512), (65536, 512))
CPU_CASES = ((256, 32), (1024, 32), (4096, 32), (1024, 256))
CPU_QUICK = ((256, 32), (1024, 32))


# -- the forward's matmuls ----------------------------------------------------------------


@dataclass(frozen=True)
class Matmul:
    """One matmul of a layer: (m x k) @ (k x n).  `qk` and `pv` read kv head `head`'s keys
    (values) from token `key_start` of the layer's device buffer."""

    op: str  # qkv | qk | pv | o | router | gate_up | down
    m: int
    k: int
    n: int
    head: int = 0
    key_start: int = 0

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def attention_keys(model: Model, layer: int, prefix: int, first: int, last: int) -> int:
    """Keys per query row of new tokens [first, last): their mean under the causal mask (new
    token i sees the prefix and new tokens 0..i), at most the window on SWA layers."""
    keys = prefix + (first + last + 1) // 2
    return keys if model.is_full(layer) else min(keys, model.window)


def layer_plan(model: Model, layer: int, prefix: int, new: int, score_elements: int = SCORE_ELEMENTS) -> list[Matmul]:
    """The matmuls of one layer's forward for `new` tokens after `prefix` cached ones."""
    hidden, q = model.hidden, model.q_heads
    kv = model.kv_heads(layer)
    dk, dv = model.dims(layer)
    group = q // kv  # query heads per KV head (GQA): one score tile serves them all
    ops = [Matmul("qkv", new, hidden, q * dk + kv * (dk + dv))]
    span = prefix + new if model.is_full(layer) else min(prefix + new, model.window)
    block = min(new, max(QUERY_BLOCK, score_elements // (group * max(1, span))))
    for first in range(0, new, block):
        last = min(new, first + block)
        rows = group * (last - first)
        keys = attention_keys(model, layer, prefix, first, last)
        tile = max(1, score_elements // rows)
        for head in range(kv):
            for start in range(0, keys, tile):
                n = min(tile, keys - start)
                ops += [Matmul("qk", rows, dk, n, head, start), Matmul("pv", rows, n, dv, head, start)]
    ops.append(Matmul("o", new, q * dv, hidden))
    width = model.active_intermediate(layer)
    if layer not in model.dense_layers:
        ops.append(Matmul("router", new, hidden, model.experts))
    ops += [Matmul("gate_up", new, hidden, 2 * width), Matmul("down", new, width, hidden)]
    return ops


def attention_flops(model: Model, layer: int, prefix: int, new: int) -> int:
    """Scores and values of the new tokens, exactly: 2 x query heads x (K dim + V dim) x the keys
    each new token sees (prefix + its position + 1 on full layers, at most the window on SWA)."""
    dk, dv = model.dims(layer)
    if model.is_full(layer):
        keys = new * prefix + new * (new + 1) // 2
    else:
        keys = sum(min(model.window, prefix + i + 1) for i in range(new))
    return 2 * model.q_heads * (dk + dv) * keys


def plan_flops(ops: list[Matmul], only: tuple[str, ...] = ()) -> int:
    return sum(op.flops for op in ops if not only or op.op in only)


def forward_flops(model: Model, prefix: int, new: int) -> int:
    return sum(plan_flops(layer_plan(model, i, prefix, new)) for i in range(model.layers))


def recompute_chunks(model: Model, tokens: int) -> list[tuple[int, int]]:
    """(prefix, new) of each forward when `tokens` are prefilled from scratch, as chunked prefill splits them."""
    return [(start, min(model.chunk, tokens - start)) for start in range(0, tokens, model.chunk)]


class Forward:
    """The forward's matmuls on the device; K and V operands read from the layers' device pools."""

    def __init__(self, model: Model, device: torch.device) -> None:
        self.model, self.device = model, device
        gen = torch.Generator(device=device).manual_seed(0) if device.type != "cpu" else torch.Generator().manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            # Random operands: a matmul of zeros runs faster than one of data.
            return torch.randn(*shape, generator=gen, device=device, dtype=model.torch_dtype)

        h, q = model.hidden, model.q_heads
        self._randn = randn
        self.w_qkv = {full: randn(h, q * dk + kv * (dk + dv)) for full, kv, dk, dv in
                      ((True, model.full_kv_heads, model.k_dim, model.v_dim), (False, model.swa_kv_heads, model.swa_k_dim, model.swa_v_dim))}
        self.w_o = {full: randn(q * dv, h) for full, dv in ((True, model.v_dim), (False, model.swa_v_dim))}
        self.w_router = randn(h, model.experts)
        widths = {model.active_intermediate(i) for i in range(model.layers)}
        self.w_gate_up = {w: randn(h, 2 * w) for w in widths}
        self.w_down = {w: randn(w, h) for w in widths}
        self._rows = 0
        self.x = self.attn = self.act = self.query = None
        self._layers: dict[tuple[int, int, int], list[Callable[[], object]]] = {}
        # One memory pool for every layer's graph: they replay one at a time, and what a graph
        # allocates (score tiles, outputs) is freed inside it, so one tile's memory serves all.
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def _workspace(self, rows: int, query_rows: int) -> None:
        m = self.model
        if rows > self._rows:
            self._rows = rows
            self.x = self._randn(rows, m.hidden)
            self.attn = self._randn(rows, m.q_heads * max(m.v_dim, m.swa_v_dim))
            self.act = self._randn(rows, max(m.active_intermediate(i) for i in range(m.layers)))
        if self.query is None or query_rows > self.query.shape[0]:
            self.query = self._randn(query_rows, max(m.k_dim, m.swa_k_dim))

    def layers(self, kv: list[tuple[torch.Tensor, torch.Tensor]], prefix: int, new: int) -> list[Callable[[], object]]:
        """Per layer, one call that enqueues its matmuls for `new` tokens after `prefix`, reading
        K and V from `kv` (per layer: the device pool's K and V buffers).

        On a GPU each layer's matmuls replay as one CUDA graph: the emulation's matmuls are
        more and smaller launches than an engine's fused kernels, and issued one by one from
        Python they kept the GPU waiting on the host (on the H200, a forward of 512 new tokens
        took as long to enqueue as to run)."""
        key = (id(kv), prefix, new)
        if key not in self._layers:
            layers = self._calls(kv, prefix, new)
            self._layers[key] = self._graphs(layers) if self._pool is not None else [partial(run_layer, calls) for calls in layers]
        return self._layers[key]

    def _graphs(self, layers: list[list[Callable[[], object]]]) -> list[Callable[[], object]]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # once outside capture: cuBLAS chooses its kernels and workspace
            for calls in layers:
                run_layer(calls)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for calls in layers:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                run_layer(calls)
            graphs.append(graph)
        return [graph.replay for graph in graphs]

    def _calls(self, kv: list[tuple[torch.Tensor, torch.Tensor]], prefix: int, new: int) -> list[list[Callable[[], object]]]:
        """Per layer, the calls of its matmuls; views made once, so a call costs a launch."""
        m = self.model
        plans = [layer_plan(m, i, prefix, new) for i in range(m.layers)]
        self._workspace(new, max((op.m for plan in plans for op in plan if op.op == "qk"), default=1))
        layers = []
        for i, plan in enumerate(plans):
            k_buf, v_buf = kv[i]
            full = m.is_full(i)
            calls = []
            for op in plan:
                if op.op == "qkv":
                    calls.append(_mm(self.x[: op.m], self.w_qkv[full]))
                elif op.op == "qk":
                    scores_of = (self.query[: op.m], k_buf[op.key_start: op.key_start + op.n, op.head].t())
                elif op.op == "pv":
                    calls.append(_attend(*scores_of, v_buf[op.key_start: op.key_start + op.k, op.head]))
                elif op.op == "o":
                    calls.append(_mm(self.attn[: op.m, : op.k], self.w_o[full]))
                elif op.op == "router":
                    calls.append(_mm(self.x[: op.m], self.w_router))
                elif op.op == "gate_up":
                    calls.append(_mm(self.x[: op.m], self.w_gate_up[op.n // 2]))
                else:
                    calls.append(_mm(self.act[: op.m, : op.k], self.w_down[op.k]))
            layers.append(calls)
        return layers

    def forget(self) -> None:
        """Drop the layers' graphs and views (they hold the device pools' buffers)."""
        self._layers.clear()
        if self._pool is not None:
            # torch releases a graph memory pool once its last graph is gone, and asserts if
            # a capture names it again: the next graphs share a new one.
            self._pool = torch.cuda.graph_pool_handle()


def _mm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    return lambda: torch.mm(a, b)


def _attend(query: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor) -> Callable[[], object]:
    return lambda: torch.mm(torch.mm(query, keys_t), values)


def run_layer(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


# -- one row's pools and the engine's schedule ----------------------------------------------


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def window_tokens(model: Model, prefix: int, page_size: int) -> int:
    """Tokens an SWA layer loads: the pages holding the prefix's last `window` tokens."""
    return min(prefix, pages(model.window, page_size) * page_size)


def expected_bytes(model: Model, prefix: int, page_size: int) -> tuple[int, int]:
    """Bytes one cache-hit prefill loads: (full layers: the whole prefix, SWA layers: the window)."""
    full = len(model.full_layers) * prefix * model.token_layer_bytes(True)
    swa = (model.layers - len(model.full_layers)) * window_tokens(model, prefix, page_size) * model.token_layer_bytes(False)
    return full, swa


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
        # As SGLang's cache controller passes them: on the GPU for kernel io, host-resident otherwise.
        on = device if io == "kernel" else torch.device("cpu")
        return {full: (self.host_idx[full].to(on), self.pools.dev_idx[full].to(on)) for full in (True, False)}

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.host.values() for t in (h.k_buffer, h.v_buffer))

    def auto_took(self) -> dict[str, str]:
        """The path `auto` took for each pool's latest load (a full and an SWA layer's)."""
        return {"full" if full else "swa": auto_took(host) for full, host in self.host.items()}

    def close(self) -> None:
        for host in self.host.values():
            host.close()


class Engine:
    """The schedule of a cache-hit prefill: loads on a load stream, the forward on the current one."""

    def __init__(self, pools: Pools, side: HostSide, forward: Forward, io: str, gpu: bool) -> None:
        self.pools, self.side, self.io, self.gpu = pools, side, io, gpu
        device = pools.dev[True].device
        self.idx = side.indices(io, device)
        self.layers = forward.layers(pools.kv, pools.prefix, pools.new)
        n = pools.model.layers
        # SGLang's controller: its own load stream, an event per layer (LayerDoneCounter).
        self.stream = torch.cuda.Stream(device) if gpu else None
        self.events = [torch.cuda.Event() for _ in range(n)] if gpu else []

    def load(self, layer: int) -> None:
        full, j = self.pools.slot[layer]
        host_idx, dev_idx = self.idx[full]
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


# -- the section ------------------------------------------------------------------------------


def bound(compute_s: float, first_load_s: float, all_loads_s: float, last_compute_s: float) -> float:
    """The fastest a layer-wise overlapped prefill can be: the forward cannot start before the
    first layer's load, and the last layer cannot compute before every load is in."""
    return max(compute_s + first_load_s, all_loads_s + last_compute_s)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; through the origin for a single point."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def break_even_tokens(load_fixed_s: float, load_per_token_s: float, recompute_per_token_s: float) -> float | None:
    """Prefix length from which loading (fixed + per-token cost) beats recomputing (per-token
    cost): fixed / (recompute - load per token); None where recomputing a token is no dearer
    than loading it (loading never wins)."""
    margin = recompute_per_token_s - load_per_token_s
    if margin <= 0:
        return None
    return max(0.0, load_fixed_s) / margin


def ceiling_rate(ceil: dict) -> float:
    """Bytes per second of the run's host-to-device ceiling (host memcpy on the CPU backend)."""
    return ceil.get("h2d", ceil.get("memcpy", 0.0)) * 1e9


def flops_summary(model: Model, prefix: int, new: int) -> dict[str, float]:
    full = next(i for i in model.full_layers if i not in model.dense_layers)
    swa = next(i for i in range(model.layers) if not model.is_full(i))
    out = {}
    for key, layer in (("full", full), ("swa", swa), ("layer0", 0)):
        plan = layer_plan(model, layer, prefix, new)
        out[f"gflop_{key}_layer"] = plan_flops(plan) / 1e9
        out[f"gflop_{key}_attention"] = plan_flops(plan, ("qk", "pv")) / 1e9
    out["gflop_forward"] = forward_flops(model, prefix, new) / 1e9
    out["gflop_recompute"] = sum(forward_flops(model, p, n) for p, n in recompute_chunks(model, prefix + new)) / 1e9
    return out


def measure(clock: Clock, sizes: list[int], names: list[str], reps: int, quick: bool, ceil: dict, device: torch.device,
            progress: Callable[[str], None]) -> list[Row]:
    """The section: per (prefix, new) row, the forward alone and recomputing once, then per
    backend and io path the loads alone and the prefill; the break-even prefix per io path."""
    threads = torch.get_num_threads()
    if not clock.gpu:
        # The scaled geometry's matmuls are too small to split: OpenMP's hand-offs cost more than
        # the work (one 32x256x1088 matmul: 0.4 ms on one thread, 19 ms on two of a busy 2-core runner).
        torch.set_num_threads(1)
    try:
        return _measure(clock, sizes, names, reps, quick, ceil, device, progress)
    finally:
        torch.set_num_threads(threads)


def _measure(clock: Clock, sizes: list[int], names: list[str], reps: int, quick: bool, ceil: dict, device: torch.device,
             progress: Callable[[str], None]) -> list[Row]:
    gpu = clock.gpu
    model = MIMO_V2_FLASH if gpu else CPU_MODEL
    cases = (GPU_QUICK if quick else GPU_CASES) if gpu else (CPU_QUICK if quick else CPU_CASES)
    page_size = sizes[0]
    rate = ceiling_rate(ceil)
    progress(f"engine: {model.name}, page {page_size}, {len(cases)} rows")
    forward = Forward(model, device)
    rows = [Row(SECTION, "geometry", "-", page_size, extra={**{k: v for k, v in asdict(model).items() if k != "sources"},
                                                            "sources": list(model.sources), "full_layers": list(model.full_layers),
                                                            "host_layout": HOST_LAYOUT, "page_size": page_size,
                                                            "cases": [list(c) for c in cases]})]
    for prefix, new in cases:
        pools = Pools(model, page_size, prefix, new, device)
        full_bytes, swa_bytes = pools.bytes()
        total = full_bytes + swa_bytes
        progress(f"  prefix {prefix} + {new} new: {total / 1e6:.1f} MB a prefill ({full_bytes / 1e6:.1f} full, {swa_bytes / 1e6:.2f} SWA)")
        layers = forward.layers(pools.kv, prefix, new)
        compute_s, compute_host_s = clock.time(lambda layers=layers: [layer() for layer in layers], reps)
        last_s, _ = clock.time(layers[-1], reps)
        chunks = [forward.layers(pools.kv, p, n) for p, n in recompute_chunks(model, prefix + new)]
        progress(f"  recompute of {prefix + new} tokens in {len(chunks)} chunk(s)")
        recompute_s, _ = clock.time(lambda chunks=chunks: [layer() for layers in chunks for layer in layers], max(3, reps // 4), warmup=1)
        first_bytes = pools.dev_idx[model.is_full(0)].numel() * model.token_layer_bytes(model.is_full(0))
        limit = bound(compute_s, first_bytes / rate, total / rate, last_s)
        common = {"prefix": prefix, "new": new, "bytes_loaded": total, "full_bytes": full_bytes, "swa_bytes": swa_bytes,
                  "compute_ms": compute_s * 1e3, "compute_host_ms": compute_host_s * 1e3, "last_layer_ms": last_s * 1e3, "recompute_ms": recompute_s * 1e3,
                  "bound_ms": limit * 1e3, "device_pool_mb": pools.device_bytes() / 1e6, **flops_summary(model, prefix, new)}
        for name in names:
            backend = backends.use(name)
            side = HostSide(pools)
            try:
                for io in (io for io in IOS if io in backend.io_backends):
                    engine = Engine(pools, side, forward, io, gpu)
                    engine.clear_loaded()
                    loads_s, loads_host_s = clock.time(engine.loads, reps)
                    verified = engine.loaded_correctly()
                    prefill_s, host_s = clock.time(engine.prefill, reps)
                    took = side.auto_took() if io == "auto" else {}
                    progress(f"    {name} {io}: prefill {prefill_s * 1e3:.2f} ms, forward alone {compute_s * 1e3:.2f}, "
                             f"loads alone {loads_s * 1e3:.2f}, bound {limit * 1e3:.2f}"
                             + "".join(f", {kind} layers {path}" for kind, path in took.items()))
                    eff = gbps(total, loads_s)
                    rows.append(Row(SECTION, f"{name} {io}", "h2d", page_size, eff, percent(eff, ceil, "h2d"),
                                    host_s * 1e6, extra={**common, "io": io, "backend": name, "prefill_ms": prefill_s * 1e3,
                                                         "loads_ms": loads_s * 1e3, "exposed_ms": (prefill_s - compute_s) * 1e3,
                                                         "prefill_host_ms": host_s * 1e3, "loads_host_ms": loads_host_s * 1e3,
                                                         "prefill_vs_bound": prefill_s / limit, "vs_recompute": recompute_s / prefill_s,
                                                         "host_pool_mb": side.host_bytes() / 1e6, "verified": verified,
                                                         **({"auto_took": took} if took else {})}))
                    del engine
            finally:
                side.close()
        forward.forget()
        del pools, layers, chunks  # the graphs and the pools go before the next row's are made
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows + break_even_rows(rows, model)


def break_even_rows(rows: list[Row], model: Model) -> list[Row]:
    """Per path: loads alone against the prefix (fit: a fixed and a per-token cost), recomputing
    per prefix token (the recompute minus the forward alone, over the prefix, at the shortest
    prefix: the cheapest per token), and the prefix from which loading wins."""
    measured = [r for r in rows if r.section == SECTION and "prefill_ms" in r.extra]
    if not measured:
        return []
    news = [r.extra["new"] for r in measured]
    new = max(set(news), key=news.count)
    out = []
    for name in dict.fromkeys(r.name for r in measured):
        mine = sorted((r for r in measured if r.name == name and r.extra["new"] == new), key=lambda r: r.extra["prefix"])
        fixed_s, per_token_s = fit_line([r.extra["prefix"] for r in mine], [r.extra["loads_ms"] / 1e3 for r in mine])
        shortest = mine[0].extra
        recompute_s = max(0.0, shortest["recompute_ms"] - shortest["compute_ms"]) / 1e3 / shortest["prefix"]
        tokens = break_even_tokens(fixed_s, per_token_s, recompute_s)
        link = model.token_layer_bytes(True) * len(model.full_layers) / per_token_s / 1e9 if per_token_s > 0 else 0.0
        out.append(Row(SECTION, f"{name} break-even", "-", mine[0].page_size,
                       extra={"new": new, "break_even_tokens": tokens, "load_fixed_ms": fixed_s * 1e3, "load_ns_per_token": per_token_s * 1e9,
                              "recompute_ns_per_token": recompute_s * 1e9, "link_gbps": link}))
    return out


# -- what the run leaves --------------------------------------------------------------------


def _geometry(rows: list) -> dict:
    return next((r.extra for r in rows if r.section == SECTION and r.name == "geometry"), {})


def header(rows: list, meta: dict) -> list[str]:
    g = _geometry(rows)
    lines = [f"engine: a cache-hit prefill as SGLang runs it, {g.get('name', '')}"]
    lines += [f"  source, {s}" for s in g.get("sources", [])]
    if g:
        swa = g["layers"] - len(g["full_layers"])
        lines.append(f"  {g['layers']} layers: {len(g['full_layers'])} full attention {tuple(g['full_layers'])}, {swa} SWA (window {g['window']}); "
                     f"pools: full {g['full_kv_heads']} KV head(s) K {g['k_dim']} / V {g['v_dim']}, SWA {g['swa_kv_heads']} KV head(s) "
                     f"K {g['swa_k_dim']} / V {g['swa_v_dim']}, {g['dtype']}, host layout {g['host_layout']}, page {g['page_size']}")
    lines.append("  loads: a full layer moves the whole prefix; an SWA layer holds the window only, so it moves the pages of the prefix's "
                 "last `window` tokens; the prefix's pages lie where the allocators leave them after churn, host pages by "
                 "portable_kv's, device pages by SGLang's (its model, FreeListAllocator)")
    seen = set()
    for r in rows:
        e = r.extra
        if "prefill_ms" in e and (e["prefix"], e["new"]) not in seen:
            seen.add((e["prefix"], e["new"]))
            lines.append(f"  FLOPs per layer, prefix {e['prefix']} + {e['new']} new: full {e['gflop_full_layer']:.2f} GFLOP "
                         f"(attention {e['gflop_full_attention']:.2f}), SWA {e['gflop_swa_layer']:.2f} (attention {e['gflop_swa_attention']:.3f}), "
                         f"layer 0 (full, dense MLP) {e['gflop_layer0_layer']:.2f}; forward {e['gflop_forward'] / 1e3:.3f} TFLOP, "
                         f"recompute {e['gflop_recompute'] / 1e3:.3f} TFLOP")
    lines.append(f"  {ceiling_text(meta)}")
    if not on_gpu(meta):
        lines.append("  CPU backend: a scaled geometry, no streams (loads, then compute), no link: these numbers are not meaningful; "
                     "run it on a GPU (--backends cuda)")
    return lines


LEGEND = ("prefill: loads on the load stream and the forward on the model's stream, layer i waiting for its own load; forward: the "
          "forward alone (on a GPU each layer's matmuls as one CUDA graph); loads: every layer's load alone; exposed: prefill - forward; GB/s: bytes loaded / loads alone "
          "(%ceil: of the H2D bulk memcpy); recompute: the whole prefix + new tokens computed, in chunked-prefill chunks; "
          "bound: max(forward + first layer's load, all loads at the ceiling + last layer's compute); x bound: prefill / bound; "
          "x faster: recompute / prefill; host: the host's time to enqueue the prefill, of it issue: the loads' (all layers); "
          "ok: every loaded slot held the host's K and V after the loads; medians, ms.")


def table(rows: list, meta: dict) -> str:
    """The section's terminal table: the header says where every number comes from."""
    lines = header(rows, meta) + [""]
    lines.append(f"{'path':<16} {'prefix':>7} {'new':>5} {'MB':>8} {'prefill':>9} {'forward':>9} {'loads':>8} {'exposed':>8} {'GB/s':>7} "
                 f"{'%ceil':>6} {'recompute':>10} {'bound':>8} {'x bound':>8} {'x faster':>9} {'host':>8} {'issue':>7} {'ok':>3}")
    for r in rows:
        e = r.extra
        if "prefill_ms" not in e:
            continue
        lines.append(f"{r.name:<16} {e['prefix']:>7} {e['new']:>5} {e['bytes_loaded'] / 1e6:>8.2f} {e['prefill_ms']:>9.3f} {e['compute_ms']:>9.3f} "
                     f"{e['loads_ms']:>8.3f} {e['exposed_ms']:>8.3f} {r.gbps:>7.1f} {r.pct_ceiling or 0:>6.1f} {e['recompute_ms']:>10.2f} "
                     f"{e['bound_ms']:>8.3f} {e['prefill_vs_bound']:>8.2f} {e['vs_recompute']:>9.1f} {e['prefill_host_ms']:>8.3f} "
                     f"{e['loads_host_ms']:>7.3f} {'yes' if e['verified'] else 'NO':>3}")
    lines += ["", LEGEND, ""]
    lines += [break_even_line(r) for r in rows if "break_even_tokens" in r.extra]
    return "\n".join(lines)


def break_even_line(r: Row) -> str:
    e = r.extra
    tokens = e["break_even_tokens"]
    when = "recomputing is never slower (loading never wins)" if tokens is None else f"loading beats recomputing from a prefix of {tokens:.0f} tokens"
    return (f"{r.name.removesuffix(' break-even')}: {when} at the measured link rate ({e['link_gbps']:.1f} GB/s of full-layer KV; "
            f"loads {e['load_fixed_ms']:.3f} ms + {e['load_ns_per_token']:.1f} ns a prefix token, recompute {e['recompute_ns_per_token']:.1f} ns "
            f"a prefix token, {e['new']} new tokens)")


def markdown(rows: list, meta: dict) -> str:
    lines = header(rows, meta) + ["", "| path | prefix | new | MB | prefill | forward | loads | exposed | GB/s | recompute | bound | x bound |",
                                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r.extra
        if "prefill_ms" in e:
            lines.append(f"| {r.name} | {e['prefix']} | {e['new']} | {e['bytes_loaded'] / 1e6:.2f} | {e['prefill_ms']:.3f} | {e['compute_ms']:.3f} | "
                         f"{e['loads_ms']:.3f} | {e['exposed_ms']:.3f} | {r.gbps:.1f} | {e['recompute_ms']:.2f} | {e['bound_ms']:.3f} | "
                         f"{e['prefill_vs_bound']:.2f} |")
    lines += ["", LEGEND, ""] + [break_even_line(r) for r in rows if "break_even_tokens" in r.extra]
    return "\n".join(lines) + "\n"
