"""One cache helper for every fact the package keeps about an engine's tensors.

The rule, everywhere: an entry is found by the identity of the objects it was
computed for and an optional key compared by value (entries of different keys
are kept side by side); a stamp, if given, must compare equal too (e.g. tensor
versions: an entry with another stamp is replaced); at most `limit` entries are
kept, and the least recently used one goes first.  Keys are held by weak reference where the object allows it: a
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
    """Which objects an entry was computed for, without keeping them alive where possible.

    A tuple among the objects stands for its elements (an engine's K/V pair of tensor
    pairs is a tuple, which cannot be weakly referenced): they are referred to one by one.
    When one of them dies, `on_death` drops the entry, so that the cached value, which may
    hold tensors of its own, goes with it and not at some later eviction."""

    __slots__ = ("_refs",)

    def __init__(self, flat: list[object], on_death: Callable[[object], None] | None = None) -> None:
        self._refs = [_ref(o, on_death) for o in flat]

    def matches(self, flat: list[object]) -> bool:
        return len(flat) == len(self._refs) and all(ref() is o for ref, o in zip(self._refs, flat))


def _flat(objects: Sequence[object]) -> list[object]:
    """The objects, with a tuple among them replaced by its elements."""
    return [leaf for o in objects for leaf in (o if type(o) is tuple else (o,))]


def _ref(obj: object, on_death: Callable[[object], None] | None) -> Callable[[], object]:
    try:
        return weakref.ref(obj, on_death)
    except TypeError:  # ints, strings: compared by identity while the entry lives
        return lambda: obj


class IdentityCache(Generic[Value]):
    """At most `limit` values, keyed by the identity of a sequence of objects and a value key; LRU eviction."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: expected >= 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[tuple, tuple[_Identity, Hashable, Value]] = OrderedDict()

    def lookup(self, objects: Sequence[object], stamp: Hashable = None, key: Hashable = None) -> Value | None:
        flat = _flat(objects)
        key = (key, *map(id, flat))
        entry = self._entries.get(key)
        if entry is None or entry[1] != stamp or not entry[0].matches(flat):
            return None
        self._entries.move_to_end(key)
        return entry[2]

    def store(self, objects: Sequence[object], value: Value, stamp: Hashable = None, key: Hashable = None) -> Value:
        flat = _flat(objects)
        key = (key, *map(id, flat))
        cache = weakref.ref(self)  # the callback must not keep the cache alive

        def on_death(_: object) -> None:
            alive = cache()
            if alive is not None:
                entry = alive._entries.get(key)
                if entry is not None and entry[0] is identity:  # not a newer entry that reuses the ids
                    del alive._entries[key]

        identity = _Identity(flat, on_death)
        self._entries[key] = (identity, stamp, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        return value

    def get(self, objects: Sequence[object], build: Callable[[], Value], stamp: Hashable = None, key: Hashable = None) -> Value:
        value = self.lookup(objects, stamp, key)
        return value if value is not None else self.store(objects, build(), stamp, key)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
