"""A request's recurrent state in Qwen3-Next's geometry: its load and backup through portable_kv's
state pool (the pools `install()` gives SGLang's Mamba host tier: one `SlotRowsHostPool` per state
tensor), and SGLang's own JIT Mamba kernels as the peer where `sglang.kernels.ops.mamba` imports.

Qwen3-Next-80B-A3B has 36 Gated DeltaNet layers (48, every fourth full attention); per layer and
request a float32 temporal state of 32 value heads x 128 x 128 (2 MiB) and a bf16 conv state of
2 x 16 x 128 + 32 x 128 channels x 3 taps (48 KiB), at tensor parallelism 1: 75 MiB a request.
A load is every layer's per-layer call for the requests' slots (H2D), as SGLang's load stream
issues them; a backup one all-layer call (D2H).  The host pool is page_first, the layout SGLang's
Mamba JIT kernels move.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .. import backends
from ..engines.sglang.slots import SlotRows, SlotRowsHostPool
from .context import Context
from .measure import Clock, gbps
from .rows import Row
from .sections import percent

SECTION = "state"
IO_PATHS = ("kernel", "bulk", "direct", "auto")
LINEAR_LAYERS = 36
TEMPORAL = ((32, 128, 128), torch.float32)
CONV = ((2 * 16 * 128 + 32 * 128, 3), torch.bfloat16)
MAMBA_OPS = "sglang.kernels.ops.mamba.transfer_mamba"


def measure(ctx: Context) -> list[Row]:
    """Each io path's rows, then SGLang's JIT Mamba kernels' (once); a few layers and requests on the CPU."""
    layers, requests = (LINEAR_LAYERS, 8) if ctx.gpu else (2, 2)
    rows: list[Row] = []
    ctx.progress.expect(len(IO_PATHS))
    for io in IO_PATHS:
        rows += state_rows(backends.current().name, layers=layers, requests=requests, io=io, reps=ctx.reps, peers=io == IO_PATHS[0])
        ctx.progress.done(f"state: {requests} requests' recurrent state, {layers} layers, io {io}")
    for row in rows:
        row.pct_ceiling = percent(row.gbps, ctx.ceil, row.direction)
    return rows


def state_rows(backend: str, *, layers: int = LINEAR_LAYERS, requests: int = 8, io: str | None = None, reps: int = 10,
               peers: bool = True) -> list[Row]:
    """Rows of GB/s for `requests` requests' state load (H2D) and backup (D2H) on `backend`, with bytes moved,
    and with `peers` SGLang's JIT Mamba kernels' rows beside them (or one row saying why they cannot run here)."""
    previous = backends.current().name
    backend_obj = backends.use(backend)
    try:
        device = backend_obj.device
        slots = 2 * requests + 1  # the host keeps twice the device's slots and SGLang's padding slot
        states = [torch.randn(layers, requests + 1, *shape, device=device).to(dtype) for shape, dtype in (TEMPORAL, CONV)]
        pools = [SlotRowsHostPool(SlotRows(state.unbind(0)), (), slots=slots, layout="page_first", pin_memory=True, io_backend=io,
                                  pool_label=f"state_{i}") for i, state in enumerate(states)]
        try:
            host = torch.arange(1, requests + 1)
            dev = torch.arange(requests, device=device)
            nbytes = sum(pool.layer_num * pool.row_bytes * requests for pool in pools)
            rows_of = [SlotRows(state.unbind(0)) for state in states]
            path = io or pools[0].io_backend

            def load() -> None:
                for layer in range(layers):
                    for pool, rows in zip(pools, rows_of):
                        pool.load_to_device_per_layer(rows, host, dev, layer, path)

            def backup() -> None:
                for pool, rows in zip(pools, rows_of):
                    pool.backup_from_device_all_layer(rows, host, dev, path)

            clock = Clock(device)
            extra = {"bytes": nbytes, "bytes_per_request": nbytes // requests, "requests": requests, "layers": layers, "io": path}
            out = [_row(f"state load ({path})", "h2d", clock, load, nbytes, reps, extra),
                   _row(f"state backup ({path})", "d2h", clock, backup, nbytes, reps, extra)]
            if peers:
                out += _sglang_rows(clock, states, pools, host.to(device), dev, nbytes, reps, extra)
            return out
        finally:
            for pool in pools:
                pool.close()
    finally:
        backends.use(previous)


def _row(name: str, direction: str, clock: Clock, fn: Callable[[], None], nbytes: int, reps: int, extra: dict) -> Row:
    seconds, host_s = clock.time(fn, reps)
    return Row(SECTION, name, direction, page_size=1, gbps=gbps(nbytes, seconds), host_us=host_s * 1e6, extra=dict(extra))


def _sglang_rows(clock: Clock, states: list[torch.Tensor], pools: list[SlotRowsHostPool], host: torch.Tensor, dev: torch.Tensor,
                 nbytes: int, reps: int, extra: dict) -> list[Row]:
    """SGLang's Mamba JIT kernels on the same page_first host buffers, as its MambaPoolHost calls them with kernel io."""
    reason = None
    if not torch.cuda.is_available() or torch.version.hip:
        reason = "SGLang's Mamba JIT kernels are measured on NVIDIA GPUs only"
    else:
        try:
            ops = importlib.import_module(MAMBA_OPS)
        except ImportError as exc:
            reason = f"{MAMBA_OPS} does not import here: {exc}"
    if reason is not None:
        return [Row(SECTION, "state load/backup (SGLang JIT Mamba kernels)", "-", extra={"skipped": reason})]
    layers = states[0].shape[0]
    items = [state[0, 0].numel() * state.element_size() for state in states]
    tables = [torch.tensor([layer.data_ptr() for layer in state.unbind(0)], dtype=torch.uint64, device=state.device) for state in states]

    def load() -> None:
        for layer in range(layers):
            for state, pool, item in zip(states, pools, items):
                ops.transfer_kv_mamba_pf_lf(src=pool.kv_buffer, dst=state[layer], src_indices=host, dst_indices=dev, layer_id=layer,
                                            item_size=item, src_layout_dim=item * layers)

    def backup() -> None:
        for table, pool, item in zip(tables, pools, items):
            ops.transfer_kv_mamba_lf_pf(src_ptrs=table, dst=pool.kv_buffer, src_indices=dev, dst_indices=host, item_size=item,
                                        dst_layout_dim=item * layers, num_layers=layers)

    peer = dict(extra, io="sglang-jit")
    return [_row("state load (SGLang JIT Mamba)", "h2d", clock, load, nbytes, reps, peer),
            _row("state backup (SGLang JIT Mamba)", "d2h", clock, backup, nbytes, reps, peer)]
