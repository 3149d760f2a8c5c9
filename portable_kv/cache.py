"""One cache helper for every fact the package keeps about an engine's tensors.

The rule, everywhere: an entry is found by the identity of the objects it was
computed for (and an optional stamp that must compare equal, e.g. tensor
versions), at most `limit` entries are kept, and the least recently used one
goes first.  Keys are held by weak reference where the object allows it: a
cached fact never keeps an engine's tensor (or a host pool's memory) alive,
and the id of a freed tensor, reused by a new one, is never mistaken for it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

Value = TypeVar("Value")


class _Identity:
    """Which objects an entry was computed for, without keeping them alive where possible."""

    __slots__ = ("_refs",)

    def __init__(self, objects: Sequence[object]) -> None:
        self._refs = [_ref(o) for o in objects]

    def matches(self, objects: Sequence[object]) -> bool:
        return len(objects) == len(self._refs) and all(ref() is o for ref, o in zip(self._refs, objects))


def _ref(obj: object) -> Callable[[], object]:
    try:
        return weakref.ref(obj)
    except TypeError:  # ints, tuples: compared by identity while the entry lives
        return lambda: obj


class IdentityCache(Generic[Value]):
    """At most `limit` values, keyed by the identity of a sequence of objects; LRU eviction."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: expected >= 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[tuple, tuple[_Identity, Hashable, Value]] = OrderedDict()

    def lookup(self, objects: Sequence[object], stamp: Hashable = None) -> Value | None:
        key = tuple(map(id, objects))
        entry = self._entries.get(key)
        if entry is None or entry[1] != stamp or not entry[0].matches(objects):
            return None
        self._entries.move_to_end(key)
        return entry[2]

    def store(self, objects: Sequence[object], value: Value, stamp: Hashable = None) -> Value:
        key = tuple(map(id, objects))
        self._entries[key] = (_Identity(objects), stamp, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        return value

    def get(self, objects: Sequence[object], build: Callable[[], Value], stamp: Hashable = None) -> Value:
        value = self.lookup(objects, stamp)
        return value if value is not None else self.store(objects, build(), stamp)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
