"""The engine section's forward pass on the device: each layer's matmuls (engine_geometry's plan),
K and V operands read from the layers' device pools; on a GPU a layer replays as one CUDA graph."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .engine_geometry import Model, layer_plan


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
