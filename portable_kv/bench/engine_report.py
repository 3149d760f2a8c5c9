"""The engine section's arithmetic and what it leaves: the bound, the break-even prefix,
and the table, header and markdown of its rows."""

from __future__ import annotations

import statistics

from .engine_geometry import Model
from .rows import Row, ceiling_text, on_gpu

SECTION = "engine"


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
    lines.append(f"{'path':<18} {'prefix':>7} {'new':>5} {'MB':>8} {'prefill':>9} {'(spread)':>15} {'forward':>9} {'(spread)':>15} "
                 f"{'loads':>8} {'exposed':>8} {'GB/s':>7} {'%ceil':>6} {'recompute':>10} {'bound':>8} {'x bound':>8} {'x faster':>9} "
                 f"{'host':>8} {'issue':>7} {'ok':>3}")
    for r in rows:
        e = r.extra
        if "prefill_ms" not in e:
            continue
        lines.append(f"{r.name:<18} {e['prefix']:>7} {e['new']:>5} {e['bytes_loaded'] / 1e6:>8.2f} {e['prefill_ms']:>9.3f} {spread(e, 'prefill_ms'):>15} "
                     f"{e['compute_ms']:>9.3f} {spread(e, 'compute_ms'):>15} {e['loads_ms']:>8.3f} {e['exposed_ms']:>8.3f} {r.gbps:>7.1f} "
                     f"{r.pct_ceiling or 0:>6.1f} {e['recompute_ms']:>10.2f} {e['bound_ms']:>8.3f} {e['prefill_vs_bound']:>8.2f} "
                     f"{e['vs_recompute']:>9.1f} {e['prefill_host_ms']:>8.3f} {e['loads_host_ms']:>7.3f} {'yes' if e['verified'] else 'NO':>3}")
    lines += ["", LEGEND + DRAWN, ""]
    lines += [f"{r.name}: not measured: {r.extra['absent']}" for r in rows if "absent" in r.extra]
    kernels = {r.name: r.extra["kernel"] for r in rows if "kernel" in r.extra and "prefill_ms" in r.extra}
    lines += [f"{name}: " + "; ".join(f"{kind} layers: {which}" for kind, which in kernel.items()) for name, kernel in kernels.items()]
    lines += [break_even_line(r) for r in rows if "break_even_tokens" in r.extra]
    return "\n".join(lines)


DRAWN = (" Prefill and forward drawn several times, the paths in turn: the median, (spread) the least and the most of the draws;"
         " SGLang JIT: its kernel as its host pools call it (TMA where its rows and the page fit), SGLang JIT reg 2: its register"
         " kernel at 2 blocks, K and V as two calls where their rows differ, indices on the device.")


def spread(e: dict, key: str) -> str:
    return f"{e[key + '_min']:.2f}-{e[key + '_max']:.2f}" if key + "_min" in e else ""


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
