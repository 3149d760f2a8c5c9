"""The decode section's step and its clock: one decode step of a dense GQA model, bound by
memory as an engine's decode is, on the compute stream (on a GPU one CUDA graph), and
`run_steps`, which times steps with the host tier's calls issued before each.

Each layer: the qkv projection, the new token's K and V appended to every request's context,
attention over that context as two batched matmuls (a KV head's query heads against its K,
the softmax, then V), the output projection and a gated MLP.  The step reads every layer's
weights and the batch's K and V once; its time against those bytes is the HBM rate the
section reports beside it.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeModel:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype: torch.dtype

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def weight_bytes(self, layers: int) -> int:
        per_layer = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden + 3 * self.hidden * self.intermediate
        return layers * per_layer * self.dtype.itemsize

    def kv_bytes(self, layers: int, batch: int, context: int) -> int:
        return layers * 2 * batch * context * self.kv_dim * self.dtype.itemsize


# Llama-3-8B's shape: 32 layers, GQA of 32 query heads over 8 KV heads of 128, MLP 14336, bf16;
# 14 GB of weights a step: a step at batch 64 / 4K context (34 GB of KV) took 14.5 ms on the H200 (3.3 TB/s).
GPU_MODEL = DecodeModel("Llama-3-8B shape", 32, 4096, 32, 8, 128, 14336, torch.bfloat16)
# The CPU backend's stand-in: the same structure small enough that a step takes a millisecond.
CPU_MODEL = DecodeModel("scaled for the CPU backend", 2, 256, 4, 2, 32, 512, torch.float32)
# (batch, context tokens) of the section's cases.
GPU_CASES = ((64, 4096), (16, 2048))
CPU_CASES = ((4, 256), (2, 128))
CPU_QUICK = ((2, 128),)
AHEAD = 1  # steps the host runs ahead of the GPU, as an engine's overlapped scheduler does


class DecodeStep:
    """`step()` enqueues one decode step of `batch` requests of `context` tokens on the current
    stream: `layers` layers of `model`, each with weights and a KV cache of its own."""

    def __init__(self, model: DecodeModel, batch: int, context: int, layers: int, device: torch.device) -> None:
        self.model, self.batch, self.context, self.layers = model, batch, context, layers
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            # Data, not zeros or empty memory: a matmul of zeros may run faster than one of data.
            return torch.randn(*shape, generator=gen, device=device, dtype=model.dtype)

        m = model
        self.w_qkv = [randn(m.hidden, m.q_dim + 2 * m.kv_dim) for _ in range(layers)]
        self.w_o = [randn(m.q_dim, m.hidden) for _ in range(layers)]
        self.w_gate_up = [randn(m.hidden, 2 * m.intermediate) for _ in range(layers)]
        self.w_down = [randn(m.intermediate, m.hidden) for _ in range(layers)]
        # A KV head's context is contiguous, so that its attention is a strided batched matmul
        # over views: (layer, request x KV head, token, head_dim).
        self.k = randn(layers, batch * m.kv_heads, context, m.head_dim)
        self.v = randn(layers, batch * m.kv_heads, context, m.head_dim)
        # Every layer reads the same hidden state: the step costs what it reads, whatever the values.
        self.x = randn(batch, m.hidden)
        self.y = torch.empty_like(self.x)
        self.step = self._graph(device) if device.type == "cuda" else self._run

    @property
    def bytes_read(self) -> int:
        """Bytes a step reads from memory at the least: the weights and the batch's K and V."""
        return self.model.weight_bytes(self.layers) + self.model.kv_bytes(self.layers, self.batch, self.context)

    def _layer(self, i: int) -> None:
        m, b = self.model, self.batch
        group = m.q_heads // m.kv_heads
        qkv = torch.mm(self.x, self.w_qkv[i])
        q = qkv[:, : m.q_dim].reshape(b * m.kv_heads, group, m.head_dim) * m.head_dim ** -0.5
        k, v = self.k[i], self.v[i]
        k[:, -1] = qkv[:, m.q_dim: m.q_dim + m.kv_dim].reshape(b * m.kv_heads, m.head_dim)
        v[:, -1] = qkv[:, m.q_dim + m.kv_dim:].reshape(b * m.kv_heads, m.head_dim)
        attn = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)
        h = torch.mm(attn.view(b, m.q_dim), self.w_o[i])
        gate_up = torch.mm(h, self.w_gate_up[i])
        torch.mm(F.silu(gate_up[:, : m.intermediate]) * gate_up[:, m.intermediate:], self.w_down[i], out=self.y)

    def _run(self) -> None:
        for i in range(self.layers):
            self._layer(i)

    def _graph(self, device: torch.device) -> Callable[[], None]:
        """The step as one CUDA graph, as SGLang and vLLM replay their decode steps: launching the
        step costs the host one call, so the host's time a step is the transfer calls' own."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # once outside capture: cuBLAS chooses its kernels and workspace
            self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run()
        return self.graph.replay


class Stamp:
    """A point in a stream's time: a CUDA event on a GPU; on the CPU, where steps and transfers
    run as they are called, the wall clock."""

    def __init__(self, gpu: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if gpu else None
        self.at = 0.0

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        if self.event is None:
            self.at = time.perf_counter()
        else:
            self.event.record(stream)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def ms_to(self, later: Stamp) -> float:
        return self.event.elapsed_time(later.event) if self.event is not None else (later.at - self.at) * 1e3


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run_steps(step: DecodeStep, steps: int, gpu: bool, issue: Callable[[int], None] | None = None, calls: float = 0.0,
              call_bytes: Callable[[int], int] = lambda n: 0, streams: Sequence[torch.cuda.Stream] = ()) -> dict[str, float]:
    """`steps` decode steps; before step i, `issue(n)` for the calls n (from 0) that bring the
    count to `calls` a step on average: a load where n is even, on `streams[0]`, a backup where
    it is odd, on `streams[1]`, as SGLang's controller keeps a load stream and a write stream.
    The steps' p50 and p99; with transfers, their GB/s over their span, the share of the bytes
    offered that was done by the last step's end, how long they ran on past it, and the
    caller's time a step in the calls."""
    if gpu:
        torch.cuda.synchronize()
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
    begin, ends = Stamp(gpu), [Stamp(gpu) for _ in range(steps)]
    done = [[Stamp(gpu) for _ in range(steps)] for _ in range(2)]  # per direction: after step i's calls
    begin.record()  # the streams start idle, so no transfer starts before it
    host_s = 0.0
    for i in range(steps):
        if i > AHEAD:
            ends[i - AHEAD - 1].wait()
        if issue is not None:
            t0 = time.perf_counter()
            for n in range(int(i * calls), int((i + 1) * calls)):
                with torch.cuda.stream(streams[n % 2]) if streams else contextlib.nullcontext():
                    issue(n)
            for direction, stamps in enumerate(done):
                stamps[i].record(streams[direction] if streams else None)
            host_s += time.perf_counter() - t0
        step.step()
        ends[i].record()
    if gpu:
        torch.cuda.synchronize()
    step_ms = [begin.ms_to(ends[0])] + [ends[i - 1].ms_to(ends[i]) for i in range(1, steps)]
    out = {"p50_ms": statistics.median(step_ms), "p99_ms": quantile(step_ms, 0.99)}
    if issue is None:
        return out
    last_end = begin.ms_to(ends[-1])
    moved, span_ms = 0, 0.0
    for direction, stamps in enumerate(done):
        kept = sum(1 for stamp in stamps if begin.ms_to(stamp) <= last_end)  # a stream runs its calls in turn
        moved += sum(call_bytes(n) for n in range(direction, int(kept * calls), 2))
        span_ms = max(span_ms, begin.ms_to(stamps[kept - 1]) if kept else 0.0)
    offered = sum(call_bytes(n) for n in range(int(steps * calls)))
    # On the CPU the transfers are the calls: their time is the caller's.
    span_s = span_ms / 1e3 if gpu else host_s
    return {**out, "gbps": moved / span_s / 1e9 if span_s > 0 else 0.0, "kept_pct": 100 * moved / offered,
            "ran_on_ms": max(0.0, *(begin.ms_to(stamps[-1]) - last_end for stamps in done)), "host_ms": host_s * 1e3 / steps,
            "bytes": float(offered)}
