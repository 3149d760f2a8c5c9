"""LocalStore: pages as files in one directory; the embedded default, no server.

One file per page, `{name}.bin`, holding the page's K block then its V block
(an MLA page: its latent block), SGLang's flat page.  A file appears whole or not at all (written under a
temporary name, then renamed), so several processes can share the directory.
"""

from __future__ import annotations

import ctypes
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .base import PageStore


def _memory(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class LocalStore(PageStore):
    """Pages of `host` as files under `path` (created if missing); namespaced by model and rank like MooncakeStore."""

    def __init__(self, host: Any, path: str | os.PathLike, *, model_name: str = "", tp_rank: int = 0, pp_rank: int | None = None, backend_tag: str = "") -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a directory path, got {type(path).__name__}")
        super().__init__(host, model_name=model_name, tp_rank=tp_rank, pp_rank=pp_rank, backend_tag=backend_tag)
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"path: expected a directory, got the file {str(self.path)!r}")
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, name: str) -> Path:
        # Percent-encoded: a key is any string (a '/', a '..', a NUL byte), a file name is
        # one path component inside the directory.  Keys of letters, digits and _-.~ (SGLang's
        # hashes) are their own file names.
        return self.path / f"{quote(name, safe='')}.bin"

    def _exist(self, names: list[str]) -> list[bool]:
        return [self._file(name).is_file() for name in names]

    def _put(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]:
        return [self._write(name, page) for name, page in zip(names, zip(*ptrs))]

    def _get(self, names: list[str], ptrs: tuple[list[int], ...]) -> list[bool]:
        return [self._read(name, page) for name, page in zip(names, zip(*ptrs))]

    def _write(self, name: str, page: tuple[int, ...]) -> bool:
        """One page from its objects' addresses, in object order."""
        final = self._file(name)
        if final.is_file():
            return True
        partial = final.with_name(f".{final.name}.{uuid.uuid4().hex}")
        try:
            with open(partial, "wb") as out:
                for ptr, nbytes in zip(page, self.object_bytes):
                    out.write(_memory(ptr, nbytes))
            os.replace(partial, final)
            return True
        except OSError:
            # A full or read-only disk refuses this page; the caller sees False and may retry later.
            partial.unlink(missing_ok=True)
            return False
        except BaseException:  # an interrupt: no partial file is left behind
            partial.unlink(missing_ok=True)
            raise

    def _read(self, name: str, page: tuple[int, ...]) -> bool:
        try:
            with open(self._file(name), "rb") as src:
                if os.fstat(src.fileno()).st_size != self.page_bytes:
                    return False
                return all(src.readinto(_memory(ptr, nbytes)) == nbytes for ptr, nbytes in zip(page, self.object_bytes))
        except OSError:
            return False

    def _close(self) -> None:
        """Nothing is held between calls: every file is closed when its call returns."""

    def __repr__(self) -> str:
        return f"LocalStore({str(self.path)!r}, layout={self.host.layout!r}, page_size={self.page_size})"
