"""The plan is the transfer: `host.prepare(...)`, and what every per-call transfer maps to
(docs/API.md, "Prepared transfers").

A plan owns everything about one pair of index tensors between one host pool and one
device pool on one io path: its own copies of the indices (the caller may change or
drop its tensors afterwards), validated once per direction; the launch each (direction,
layer span) needs, built by the io path's mover at its first call and kept here; and
the in-flight record of its calls, from which `ready(layer_id)` and the pool's device
time come.  A call checks its layer and the pool, sets the layer, launches and records:

    plan.load(layer) -> _call -> launch.run(layers, stream) -> the vendor's launch

A plan of `prepare()` holds the device pool's per-layer buffers as they were then and
raises once they are replaced; the plans the per-call API makes follow the device pool
each call passes (pool.py).
"""

from __future__ import annotations

import ctypes
import operator
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from .device_pool import DeviceGeometry
from .indices import IndexPair
from .io.context import IoContext, Landed
from .io.mover import Launch
from .stats import DELEGATING, StatsRow
from .transfer import TensorPair, Transfer
from .validation import IndexValidator, check_lengths, index_tensor, owned_int64

_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype, _memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Binding(NamedTuple):
    """The device pool an engine passes every call, checked once, with a tensor pair per buffer."""

    device_pool: Any
    geometry: DeviceGeometry
    pairs: tuple[TensorPair, ...]
    held: tuple[tuple[str, list[torch.Tensor]], ...]  # each buffer's name and the per-layer tensors the pairs hold

    def replaced(self, device_pool: Any, layers: range) -> str | None:
        """The first buffer of `device_pool` whose tensors are not the ones held, or None.

        The check is by identity of the per-layer tensors a call moves: an engine that
        swaps a buffer gets it caught when that layer next moves.  A per-layer call of the
        pool bound checks one tensor per buffer, not all of them: it is on the per-call
        host-time budget."""
        first, stop = layers.start, layers.stop
        same_pool, one = self.device_pool is device_pool, stop - first == 1
        for name, held in self.held:
            given = getattr(device_pool, name, None)
            if same_pool and type(given) is list and len(given) == len(held):
                if (given[first] is not held[first]) if one else not all(map(operator.is_, given[first:stop], held[first:stop])):
                    return name
            elif not _same_tensors(given, held):
                return name
        return None


class PlannedPool(Protocol):
    """What a plan asks of its host pool (pool.py's HostPool)."""

    closed: bool
    layer_num: int
    page_size: int
    _io_context: IoContext
    _validator: IndexValidator
    _layer_ranges: list[range]  # range(n, n + 1) for every layer n: a per-layer call's span

    def _layer(self, layer_id: int) -> range: ...


class TransferPlan:
    """One pair of index tensors of one host pool and one device pool, on one io path."""

    def __init__(self, pool: PlannedPool, io: str, host_indices: Any, device_indices: Any, binding: Binding | None,
                 fixed: bool = True, background: bool = False, owned: bool = False) -> None:
        """`fixed`: bound to `binding` for good (prepare()); else rebound to the device pool a
        call passes.  `owned`: the indices are already the pool's own copies, which nobody writes."""
        host, dev = index_tensor("host_indices", host_indices), index_tensor("device_indices", device_indices)
        check_lengths(host, dev)
        self.pool, self.io, self.background, self.fixed, self.owned = pool, io, background, fixed, owned
        self._context: IoContext = pool._io_context
        # The plan's own copies: an engine that rewrites its tensors afterwards does not change
        # what the plan moves (and its inference tensors need no version counter).
        self.host_indices, self.device_indices = (host, dev) if owned else (owned_int64(host), owned_int64(dev))
        # CPU values the caller's tensors must still hold for the per-call API to reuse this
        # plan (version counters miss writes through .numpy(), .data or DLPack).
        snapshots = () if owned else tuple(_snapshot(given, copy) for given, copy in ((host, self.host_indices), (dev, self.device_indices)))
        self.snapshots = snapshots if any(s is not None for s in snapshots) else None
        self.tokens = int(host.numel())
        self._all = range(pool.layer_num)
        self._checked: IndexPair
        self._directions: set[bool] = set()
        self._launches: dict[tuple[bool, int], Launch] = {}
        self._rows: dict[bool, StatsRow] = {}
        self._landed: list[tuple[Any, int]] = [(None, 0)] * pool.layer_num
        self.binding: Binding | None = None
        if binding is not None:
            self.rebind(binding)

    # -- what the caller holds -------------------------------------------------------------

    def load(self, layer_id: int) -> None:
        """`load_to_device_per_layer` of the plan's indices: H2D, one layer."""
        pool = self.pool
        layers = pool._layer_ranges[layer_id] if type(layer_id) is int and 0 <= layer_id < pool.layer_num else pool._layer(layer_id)
        self._call(True, layers)

    def load_all(self) -> None:
        """`load_to_device_all_layer` of the plan's indices."""
        self._call(True, self._all)

    def backup(self, layer_id: int | None = None) -> None:
        """D2H: every layer (None, `backup_from_device_all_layer`), or one."""
        self._call(False, self._all if layer_id is None else self.pool._layer(layer_id))

    def ready(self, layer_id: int) -> Landed:
        """What completes when the latest call of this plan that moved `layer_id` has landed
        (at once where none did): `.query()`, `.synchronize()`, `.wait(stream=None)`."""
        layer = self.pool._layer(layer_id).start
        timing, generation = self._landed[layer]
        return Landed(self._context.streams, timing, generation)

    # -- one call ----------------------------------------------------------------------------

    def _call(self, to_device: bool, layers: range) -> None:
        context = self._context
        if self.pool.closed:
            raise ValueError("host pool: the pool is closed")
        started = time.perf_counter()
        try:
            if self.fixed:
                binding = self.binding
                name = binding.replaced(binding.device_pool, layers)  # type: ignore[union-attr]
                if name is not None:
                    raise ValueError(f"plan: the device pool's {name} was replaced after prepare(); prepare the transfer again")
            launch = self._launches.get((to_device, len(layers)))
            if launch is None:
                launch = self._build(to_device, layers)
            if not self.tokens:
                return
            flag = context.bad_index
            if flag.word[0]:
                flag.check()
            if not to_device:
                context.host_writes += 1
            stream = context.streams.current()
            timing = context.in_flight.begin(stream)
            launch.run(layers, stream)
        except (ValueError, TypeError, RuntimeError) as exc:
            context.stats.error(exc)
            raise
        row = self._rows[to_device]
        context.in_flight.end(timing, stream, row)
        if len(layers) == 1:
            self._landed[layers.start] = (timing, timing.generation)
        else:
            self._landed[layers.start:layers.stop] = [(timing, timing.generation)] * len(layers)
        row.calls += 1
        row.bytes += self._bytes_per_layer * len(layers)
        row.seconds += time.perf_counter() - started
        if launch.path != self.io or self.io in DELEGATING:
            context.stats.taken(self.io, launch.path, launch.reason)

    def _build(self, to_device: bool, layers: range) -> Launch:
        """The launch of one direction and layer span: validated and built at its first call."""
        pair = self._pair(to_device)
        assert self.binding is not None, "a plan is bound before its first call"
        transfer = Transfer(to_device, self.binding.pairs, pair, layers, self.pool.page_size, self._context.bad_index, self.background)
        launch = self._launches[(to_device, len(layers))] = self._context.mover(self.io).build(transfer)
        self._rows[to_device] = self._context.stats.row(to_device, self.io)
        return launch

    def _pair(self, to_device: bool) -> IndexPair:
        if to_device not in self._directions:
            self.pool._validator.check_direction(self._checked, to_device)
            self._directions.add(to_device)
        return self._checked

    # -- the device pool ---------------------------------------------------------------------

    def rebind(self, binding: Binding) -> None:
        """Move between the host pool and `binding`'s device pool from now on: launches made
        for another go.  The indices are checked against its tokens (ranges and whole pages)
        now, so bad input raises before anything moves; distinct destinations at the first
        call of each direction."""
        if self.binding is None or binding.geometry.tokens != self.binding.geometry.tokens:
            self._directions = set()
            self._checked = self.pool._validator.pair(self.host_indices, self.device_indices, binding.geometry.tokens)
        self.binding = binding
        self._bytes_per_layer = int(sum(self.tokens * p.device_token_bytes for p in binding.pairs))
        self._launches.clear()

    # -- the per-call API's reuse -------------------------------------------------------------

    def holds(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        """Whether the caller's CPU-resident tensors still hold the values this plan copied: one
        memcmp each where the caller's tensor is dense, a fraction of torch.equal's time."""
        for given, snapshot in zip((host_indices, device_indices), self.snapshots or ()):
            if snapshot is None:
                continue
            if given.dtype == snapshot.dtype and given.is_contiguous() and given.numel() == snapshot.numel():
                if _memcmp(given.data_ptr(), snapshot.data_ptr(), given.numel() * given.element_size()):
                    return False
            elif not torch.equal(given, snapshot):
                return False
        return True

    def __repr__(self) -> str:
        return f"TransferPlan(io={self.io!r}, tokens={self.tokens}, layers={len(self._all)})"


def _same_tensors(given: Any, bound: Sequence[torch.Tensor]) -> bool:
    # type() first: isinstance against the Sequence ABC costs a microsecond a call.
    return (type(given) in (list, tuple) or isinstance(given, Sequence)) and len(given) == len(bound) and all(map(operator.is_, given, bound))


def _snapshot(given: torch.Tensor, copy: torch.Tensor) -> torch.Tensor | None:
    """The values CPU-resident indices were copied with: the plan's own int64 copy where the
    caller's tensor is int64, else a dense copy in the caller's dtype."""
    if given.device.type != "cpu":
        return None
    return copy if given.dtype == copy.dtype else given.clone(memory_format=torch.contiguous_format)


# Plans the per-call API keeps: an engine interleaves a few transfers (a per-layer load, a
# backup of other pages, a prefetch, several requests), each a pair of index tensors it
# passes every call; the least recently used goes first.
PLANS_KEPT = 16


class PlanMemo:
    """The per-call API's one memo: the caller's index tensors (by identity, and version counter
    where they have one) and io path to a plan, which must still hold the tensors' CPU values.

    An entry refers to the tensors weakly, so it never keeps them alive, and a new tensor at
    a dead one's address is never mistaken for it.  GPU-resident indices made under
    torch.inference_mode() have neither a version counter nor values to compare without a
    device round trip: they get a new plan each call (`prepare()` keeps one).  The pool's
    own copies (SGLang's `prepare_transfer_indices`) are found by identity alone: nobody
    writes them."""

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple, tuple[weakref.ref, weakref.ref, tuple, TransferPlan]] = OrderedDict()

    def find(self, host_indices: Any, device_indices: Any, io: str, background: bool) -> TransferPlan | None:
        entry = self._plans.get((id(host_indices), id(device_indices), io, background))
        if entry is None or entry[0]() is not host_indices or entry[1]() is not device_indices:
            return None
        inference = host_indices.is_inference() or device_indices.is_inference()
        if entry[2] != (_stamp(host_indices, device_indices) if inference else (host_indices._version, device_indices._version)):
            return None
        plan = entry[3]
        return plan if plan.snapshots is None or plan.holds(host_indices, device_indices) else None

    def keep(self, host_indices: torch.Tensor, device_indices: torch.Tensor, plan: TransferPlan) -> None:
        stamp = _stamp(host_indices, device_indices)
        if stamp is None:
            return
        key = (id(host_indices), id(device_indices), plan.io, plan.background)
        plans = weakref.ref(self._plans)

        def forget(_: object) -> None:
            alive = plans()
            if alive is not None and alive.get(key, (None,) * 4)[3] is plan:
                del alive[key]

        self._plans[key] = (weakref.ref(host_indices, forget), weakref.ref(device_indices, forget), stamp, plan)
        self._plans.move_to_end(key)
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()


def _stamp(host_indices: Any, device_indices: Any) -> tuple | None:
    """The tensors' version counters; None where a plan of them cannot be found again (not
    tensors, or GPU-resident ones made under inference mode)."""
    if type(host_indices) is not torch.Tensor or type(device_indices) is not torch.Tensor:
        return None
    versions = []
    for t in (host_indices, device_indices):
        if not t.is_inference():
            versions.append(t._version)
        elif t.device.type == "cpu":
            versions.append(None)  # no counter: the CPU values are compared on every reuse
        else:
            return None
    return tuple(versions)
