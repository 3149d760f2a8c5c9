"""The engine section's model on one GPU: MiMo-V2-Flash's KV pools and the forward's matmuls.

MiMo-V2-Flash is hybrid: 9 full-attention layers and 39 sliding-window (SWA) layers,
with different KV heads.  A full layer loads the whole prefix; an SWA layer holds only
the window (the last `sliding_window` tokens) per request, so it loads only the pages
of the prefix's last `window` tokens.

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

On the CPU backend the section runs a scaled geometry (CPU_MODEL) so that CI exercises
the code in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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

# (cached prefix, new tokens): prefixes of 4K, 16K and 64K tokens under 512 new ones, and a 16K
# prefix under 4096 new ones; --quick runs them all on a GPU (each is a few seconds there).
GPU_CASES = ((4096, 512), (16384, 512), (65536, 512), (16384, 4096))
CPU_CASES = ((256, 32), (1024, 32), (4096, 32), (1024, 256))
CPU_QUICK = ((256, 32), (1024, 32))


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

