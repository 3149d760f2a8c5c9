"""MooncakeStore: pages in a Mooncake Store cluster, shared across processes, hosts and SGLang.

The host pool's buffers (K and V, or the latent) are registered with the Mooncake client once;
pages then move zero-copy between the pool and the cluster
(`batch_put_from` / `batch_get_into`).  Objects are named and laid out as
SGLang 0.5.23's Mooncake backend names and lays them out (base.py).

Bounded waits: the constructor probes the master's RPC port (TCP connect,
MASTER_PROBE_S) before Mooncake's own setup, which would retry for about
90 s.  Once set up, failed pages are reported False, never raised, and:

- The call that finds the master gone returns within Mooncake's RPC timeout:
  at once where the port refuses (a killed master: <= 12 ms measured), after
  MC_RPC_TIMEOUT_MS where the master hangs (30 s by default; 30.0 s measured
  with the master SIGSTOPped, 2.0 s with MC_RPC_TIMEOUT_MS=2000).
- It marks the master unreachable.  Until a probe finds it answering again,
  every call reports every page failed (0 hits) without calling the client:
  ~1 ms measured (a first call up to ~55 ms), instead of the ~4.4 s for each
  lookup or get and ~8.8 s for each put that the client took once the master
  was gone.  A background thread probes every PROBE_INTERVAL_S: a TCP
  connect (PROBE_CONNECT_S), then one lookup through the client; a master
  restarted on the same address was used again 0.6-2 s after it started
  (loopback, test_mooncake_faults.py).
- `close()` with the master gone waits out the client's own unmount retries
  (2-20 s measured), and first for a probe under way (at most Mooncake's
  RPC timeout).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from typing import Any

from . import mooncake_logs
from .base import PageStore
from .master import answers, split_address

log = logging.getLogger(__name__)

MASTER_PROBE_S = 5.0
# While the master is marked unreachable, one probe every PROBE_INTERVAL_S checks whether it is back:
# a TCP connect bounded by PROBE_CONNECT_S, then one lookup through the client.
PROBE_INTERVAL_S = 1.0
PROBE_CONNECT_S = 0.5
# close() waits this long for a probe under way: a lookup, bounded by Mooncake's RPC timeout (30 s by default).
PROBE_JOIN_S = 40.0
PROBE_OBJECT = "portable_kv-master-probe"
# Mooncake's per-client transfer buffer; the zero-copy calls do not use it, but setup requires one.
LOCAL_BUFFER_BYTES = 16 << 20
# Mooncake refuses to mount a segment smaller than this (seen with 0.3.13).
MIN_SEGMENT_BYTES = 16 << 20
# The transports Mooncake's transfer engine names (0.3.13); tests and loopback use tcp.
PROTOCOLS = ("tcp", "rdma", "nvlink", "nvlink_intra", "hip", "cxl", "efa", "ascend", "barex", "nvmeof", "ubshmem")

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that a page operation reports.
ERRORS = {
    -200: "no space (NO_AVAILABLE_HANDLE)",
    -600: "invalid parameters (INVALID_PARAMS)",
    -703: "replica not ready (REPLICA_IS_NOT_READY)",
    -704: "not found (OBJECT_NOT_FOUND)",
    -707: "lease expired during the transfer (LEASE_EXPIRED)",
    -800: "transfer failed (TRANSFER_FAIL)",
    -900: "master unreachable (RPC_FAIL)",
    -901: "master timed out (RPC_TIMEOUT)",
}
# The codes that say the master did not answer, rather than refused one object.
UNREACHABLE = (-900, -901)


def describe(code: int) -> str:
    """Mooncake's name for a negative result code."""
    return ERRORS.get(code, f"Mooncake error {code}")


class MooncakeStore(PageStore):
    """A Mooncake Store client over the pages of `host`.

    `master` is the master's RPC "host:port"; `local_hostname` the address
    this client's transfer engine announces; `protocol` "tcp" or "rdma" (with
    `device_name`, e.g. "mlx5_0", for RDMA); `segment_size_gb` the memory this
    client contributes to the cluster (0: none, a pure client; otherwise at
    least 16 MiB and at least one page's largest object).  `model_name`, `tp_rank`,
    `pp_rank` and `backend_tag` make the key namespace, as in SGLang.
    """

    # Declared here: they are set in __init__ after the client's module is imported there, which type checkers do not follow.
    master: str
    _client: Any  # Mooncake's MooncakeDistributedStore, which ships no type information
    _lock: threading.Lock
    _stopping: threading.Event

    def __init__(
        self,
        host: Any,
        master: str = "127.0.0.1:50051",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        metadata_server: str = "P2PHANDSHAKE",
        segment_size_gb: float = 1.0,
        model_name: str = "",
        tp_rank: int = 0,
        pp_rank: int | None = None,
        backend_tag: str = "",
        device_name: str = "",
    ) -> None:
        super().__init__(host, model_name=model_name, tp_rank=tp_rank, pp_rank=pp_rank, backend_tag=backend_tag)
        self.closed = True  # until the client is set up, close() has nothing to release
        for name, value in (("local_hostname", local_hostname), ("protocol", protocol), ("metadata_server", metadata_server), ("device_name", device_name)):
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
        if protocol not in PROTOCOLS:
            # Mooncake's setup would retry a misspelt one for ~20 s and then say only "error -1".
            raise ValueError(f"protocol: expected one of Mooncake's transports ({', '.join(PROTOCOLS)}), got {protocol!r}")
        split_address(master)
        if isinstance(segment_size_gb, bool) or not isinstance(segment_size_gb, numbers.Real) or not math.isfinite(segment_size_gb) or segment_size_gb < 0:
            raise ValueError(f"segment_size_gb: expected a finite number >= 0, got {segment_size_gb!r}")
        self.segment_bytes = int(segment_size_gb * (1 << 30))
        largest = max(self.object_bytes)
        if self.segment_bytes and self.segment_bytes < max(MIN_SEGMENT_BYTES, largest):
            raise ValueError(
                f"segment_size_gb: expected 0 or at least {max(MIN_SEGMENT_BYTES, largest) / (1 << 30):.4f} GiB "
                f"(Mooncake's minimum segment, and one page's object of {largest} bytes must fit), got {segment_size_gb}"
            )
        mooncake_logs.client_environment()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("MooncakeStore: the Mooncake client is not installed; pip install 'portable-kv[mooncake]'") from exc
        if not answers(master, timeout_s=MASTER_PROBE_S):
            raise ConnectionError(f"master: no Mooncake master answers at {master} (TCP connect, {MASTER_PROBE_S:.0f} s); start mooncake_master there or fix the address")
        self.master = master
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic time the master was last found unreachable
        self._prober: threading.Thread | None = None
        self._stopping = threading.Event()
        self._client = MooncakeDistributedStore()
        code = self._client.setup(local_hostname, metadata_server, self.segment_bytes, LOCAL_BUFFER_BYTES, protocol, device_name, master)
        if code != 0:
            raise ConnectionError(f"master: Mooncake client setup against {master} failed: {describe(code)} (protocol {protocol!r}, local_hostname {local_hostname!r})")
        self._registered: list[int] = []
        try:
            for buffer in (*host.buffers, self._stage):
                if buffer is not None:
                    self._register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        except BaseException:
            self._release()
            raise
        self.closed = False

    def _register(self, ptr: int, nbytes: int) -> None:
        code = self._client.register_buffer(ptr, nbytes)
        if code != 0:
            raise RuntimeError(f"host: Mooncake refused to register {nbytes} bytes at {ptr:#x}: {describe(code)}")
        self._registered.append(ptr)

    @property
    def master_unreachable(self) -> bool:
        """True from a call that found the master gone until a probe finds it answering again."""
        return self._down_since is not None

    def _exist(self, names: list[str]) -> list[bool]:
        if self.master_unreachable:
            return [False] * len(names)
        codes = self._client.batch_is_exist([f"{name}_{part}" for name in names for part in self.objects])
        if self._unreachable(codes):
            return [False] * len(names)
        self._warn("lookup", [c for c in codes if c < 0 and c not in UNREACHABLE])
        return [all(code == 1 for code in page) for page in self._by_page(codes)]

    def _objects(self, names: list[str], ptrs: tuple[list[int], ...]) -> tuple[list[str], list[int], list[int]]:
        """Mooncake's objects of the pages, each page's in turn (K then V; or its one latent object): names, addresses, sizes."""
        objects = [f"{name}_{part}" for name in names for part in self.objects]
        return objects, [p for page in zip(*ptrs) for p in page], list(self.object_bytes) * len(names)

    def _by_page(self, codes: list[int]) -> list[tuple[int, ...]]:
        """Per-object codes grouped by page."""
        n = len(self.objects)
        return [tuple(codes[i : i + n]) for i in range(0, len(codes), n)]

    def _put(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]:
        if self.master_unreachable:
            return [False] * len(names)
        objects, addresses, sizes = self._objects(names, ptrs)
        # A put to a stored key succeeds without copying (Mooncake), so only the missing objects are sent.
        present = self._client.batch_is_exist(objects)
        if self._unreachable(present):
            # Sending the objects anyway would wait out Mooncake's RPC timeout a second time.
            return [False] * len(names)
        missing = [i for i, code in enumerate(present) if code != 1]
        codes = [0] * len(objects)
        if missing:
            sent = self._client.batch_put_from([objects[i] for i in missing], [addresses[i] for i in missing], [sizes[i] for i in missing])
            for i, code in zip(missing, sent):
                codes[i] = code
            self._unreachable(sent)
        self._warn("put", [c for c in codes if c < 0 and c not in UNREACHABLE])
        return [all(code == 0 for code in page) for page in self._by_page(codes)]

    def _get(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]:
        if self.master_unreachable:
            return [False] * len(names)
        objects, addresses, sizes = self._objects(names, ptrs)
        codes = self._client.batch_get_into(objects, addresses, sizes)
        self._unreachable(codes)
        self._warn("get", [c for c in codes if c < 0 and c != -704 and c not in UNREACHABLE])
        return [tuple(page) == self.object_bytes for page in self._by_page(codes)]

    def _warn(self, what: str, failures: list[int]) -> None:
        if failures:
            log.warning("MooncakeStore %s at %s: %d objects failed, first: %s", what, self.master, len(failures), describe(failures[0]))

    def _unreachable(self, codes: list[int]) -> bool:
        """Whether `codes` say the master did not answer; if so, mark it unreachable and start the prober.

        Once the master is gone, each call into the client waits out Mooncake's RPC timeout
        (~4.4 s, a put twice that), so calls fail at once instead until a probe finds it back.
        """
        if not any(code in UNREACHABLE for code in codes):
            return False
        with self._lock:
            if self._down_since is None and not self._stopping.is_set():
                self._down_since = time.monotonic()
                log.warning(
                    "MooncakeStore: the master at %s did not answer (%s); calls report every page failed at once "
                    "until it answers again (probed every %.0f s)", self.master, describe(next(c for c in codes if c in UNREACHABLE)), PROBE_INTERVAL_S,
                )
                self._prober = threading.Thread(target=self._probe, name="portable_kv-mooncake-probe", daemon=True)
                self._prober.start()
        return True

    def _probe(self) -> None:
        while not self._stopping.wait(PROBE_INTERVAL_S):
            # The TCP connect fails at once while nothing listens, sparing the client's slower RPC.
            if not answers(self.master, timeout_s=PROBE_CONNECT_S):
                continue
            try:
                codes = self._client.batch_is_exist([PROBE_OBJECT])
            except Exception:  # a probe that raises must not end the probing: the mark would never clear
                log.debug("MooncakeStore: probing the master at %s raised", self.master, exc_info=True)
                continue
            if codes and not any(code < 0 for code in codes):
                with self._lock:
                    down, self._down_since = self._down_since, None
                log.warning("MooncakeStore: the master at %s answers again after %.1f s", self.master, time.monotonic() - (down or time.monotonic()))
                return

    def _close(self) -> None:
        self._release()

    def _release(self) -> None:
        self._stopping.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=PROBE_JOIN_S)
            if prober.is_alive():
                log.warning("MooncakeStore: a probe of the master at %s still runs after %.0f s; closing the client anyway", self.master, PROBE_JOIN_S)
        for ptr in self._registered:
            self._client.unregister_buffer(ptr)
        self._registered = []
        self._client.close()

    def __repr__(self) -> str:
        return f"MooncakeStore(master={self.master!r}, layout={self.host.layout!r}, page_size={self.page_size}, namespace={self.object_names(['<key>'])[0]!r})"
