"""One host region per node that every rank of an engine maps: a file in /dev/shm.

Naming: `/dev/shm/portable_kv_<engine id>.kv`.  vLLM's engine id is unique per
data-parallel replica, so replicas on one node never share a file; the
`portable_kv_` prefix keeps it apart from vLLM's own `vllm_offload_<id>.mmap`.

Ownership: the owner (the lowest rank of the engine on the node) unlinks any
file of that name a crashed start left behind, creates it and sizes it; every
other rank opens it only after the first barrier, so never a stale one.  Each
rank reserves its share of the file's pages (posix_fallocate: a full /dev/shm
fails here, by name, instead of raising SIGBUS at the first store), all ranks
at once.  After the second barrier, when every rank has mapped it, the owner
unlinks the name: the kernel frees the memory when the last rank exits, however
it exits, and nothing is left for the next start.

Pinning: the region is page-locked through the backend's `register_host`
segment by segment (whole chunk rows, about 1 GiB), the first time a transfer
touches a segment, so start-up does not wait for hundreds of GB to be locked.
A segment the driver refuses stays pageable: copies still run, slower.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SHM_DIR = "/dev/shm"
PIN_SEGMENT_BYTES = 1 << 30


def region_path(engine_id: str) -> str:
    """The region's file for vLLM's engine id (characters a file name cannot hold become `_`)."""
    return os.path.join(SHM_DIR, f"portable_kv_{re.sub(r'[^A-Za-z0-9._-]', '_', engine_id)}.kv")


class NodeRegion:
    """The node's region: `num_chunks` rows of `row_bytes`, mapped shared by every rank that builds one.

    Every rank of the engine on the node builds it at once with the same
    `path`, `num_chunks` and `row_bytes`; `owner` is True on exactly one of
    them; `barrier()` returns when every rank has reached it (each rank calls
    it twice, also when it fails, so that no peer waits on it).  `share` is
    `(index, count)`: this rank reserves the index-th of count slices.
    """

    def __init__(self, path: str, num_chunks: int, row_bytes: int, *, owner: bool, barrier: Callable[[], None],
                 share: tuple[int, int] = (0, 1)) -> None:
        if num_chunks < 1 or row_bytes < 1:
            raise ValueError(f"num_chunks, row_bytes: expected at least one chunk of at least one byte, got {num_chunks} x {row_bytes}")
        self.path, self.num_chunks, self.row_bytes, self.owner = path, num_chunks, row_bytes, owner
        self.nbytes = num_chunks * row_bytes
        self.fd: int | None = None
        self._named = False  # the owner still has the path to unlink
        self.map: mmap.mmap | None = None
        self.base: torch.Tensor | None = None
        self._pinned: dict[int, int | None] = {}  # segment -> registered address, None where refused
        barriers_left = 2
        try:
            if owner:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a crashed start's region: never joined, never reused
                self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                self._named = True
                os.ftruncate(self.fd, self.nbytes)
            barriers_left -= 1
            barrier()
            if not owner:
                try:
                    self.fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    raise RuntimeError(f"{path}: the node region's owner did not create it (it failed at start; see its error)") from None
            if os.fstat(self.fd).st_size != self.nbytes:
                raise RuntimeError(f"{path}: {os.fstat(self.fd).st_size} bytes, expected {self.nbytes}: ranks disagree on num_chunks "
                                   f"or row_bytes")
            index, count = share
            piece = -(-num_chunks // count) * row_bytes
            start = min(index * piece, self.nbytes)
            if start < self.nbytes:
                try:
                    os.posix_fallocate(self.fd, start, min(piece, self.nbytes - start))
                except OSError as exc:
                    raise OSError(exc.errno, f"{path}: cannot reserve {self.nbytes / 2**30:.1f} GiB in {SHM_DIR} "
                                             f"({os.strerror(exc.errno)}); lower cpu_bytes_to_use or enlarge {SHM_DIR}") from None
            self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            barriers_left -= 1
            barrier()
        except BaseException:
            for _ in range(barriers_left):
                with contextlib.suppress(Exception):
                    barrier()
            self.close()
            raise
        if owner:
            os.unlink(path)  # every rank has it mapped (module docstring)
            self._named = False
        self.base = torch.frombuffer(memoryview(self.map), dtype=torch.uint8)

    @property
    def address(self) -> int:
        """The host address of chunk 0."""
        if self.base is None:
            raise RuntimeError(f"{self.path}: the region is closed")
        return self.base.data_ptr()

    def rows(self) -> torch.Tensor:
        """The region as `(num_chunks, row_bytes)` uint8, a view of the shared memory."""
        if self.base is None:
            raise RuntimeError(f"{self.path}: the region is closed")
        return self.base.view(self.num_chunks, self.row_bytes)

    def pin(self, chunks: np.ndarray, backend: Any) -> None:
        """Page-lock, through `backend.register_host`, the segments of `chunks` not locked yet."""
        rows = max(1, PIN_SEGMENT_BYTES // self.row_bytes)
        for segment in np.unique(np.asarray(chunks, dtype=np.int64) // rows).tolist():
            if segment in self._pinned:
                continue
            first = segment * rows
            address = self.address + first * self.row_bytes
            try:
                backend.register_host(address, min(rows, self.num_chunks - first) * self.row_bytes)
            except RuntimeError:
                self._pinned[segment] = None
            else:
                self._pinned[segment] = address

    def pinned_bytes(self) -> int:
        """Bytes page-locked so far."""
        rows = max(1, PIN_SEGMENT_BYTES // self.row_bytes)
        return sum(min(rows, self.num_chunks - s * rows) * self.row_bytes for s, a in self._pinned.items() if a is not None)

    def close(self, backend: Any = None) -> None:
        """Unlock, unmap and close; the owner also unlinks a name still there (a start that failed)."""
        for address in self._pinned.values():
            if address is not None and backend is not None:
                backend.unregister_host(address)
        self._pinned.clear()
        self.base = None
        if self.map is not None:
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._named = False
