"""vmcgrad's one cache policy: bounded memos that keep no user function alive.

Every module-level memo of the package is a :class:`Cache`: a least-recently-used map with a fixed
bound, whose keys name the user's function through :func:`vmcgrad._function.cache_key` (a weak
reference for every callable in it). An entry whose function was collected can no longer be found
(its key equals only itself), holds nothing of it, and is the first dropped when the cache is full.
The values must not hold the function either: they are chunk sizes, shapes and verdicts.

jax.jit's own caches do hold the functions of compiled programs (as for any jitted function);
``jax.clear_caches()`` empties them. :func:`registry` lists every cache, for the test that checks
them all (tests/test_caches.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any

from vmcgrad._function import cache_key, is_dead

_REGISTRY: list[Cache] = []


class Cache:
    """A bounded least-recently-used map keyed through :func:`vmcgrad._function.cache_key`.

    A key of ``None`` stands for "do not cache" (an unhashable function or input): it is never
    found and never stored.

    Args:
        maxsize: the most entries kept; the least recently used goes first. 0 keeps nothing.
        name: what the cache remembers, for :func:`registry`; a named cache is registered (a
            module-level cache must be: the test of the policy finds unregistered ones).
    """

    def __init__(self, maxsize: int = 128, name: str | None = None):
        self.maxsize, self.name = maxsize, name
        self._data: collections.OrderedDict = collections.OrderedDict()
        if name is not None:
            _REGISTRY.append(self)

    @staticmethod
    def key(fun: Callable, *parts: Hashable) -> Hashable | None:
        """The key of ``fun`` with ``parts`` (which must not hold ``fun``), or None if unhashable."""
        key = (cache_key(fun), *parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def get(self, key: Hashable | None, default: Any = None) -> Any:
        """The value stored for ``key`` (now the most recently used), else ``default``."""
        if key is None or key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def __setitem__(self, key: Hashable | None, value: Any) -> None:
        """Stores ``value``; beyond the bound, drops the entries of collected functions first, then
        the least recently used."""
        if key is None:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.maxsize:
            for dead in [k for k in self._data if is_dead(k)]:
                del self._data[dead]
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __contains__(self, key: Hashable | None) -> bool:
        return key is not None and key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        """Forgets every entry."""
        self._data.clear()

    def snapshot(self) -> collections.OrderedDict:
        """A copy of the entries (for tests that fill a cache and put it back)."""
        return collections.OrderedDict(self._data)

    def restore(self, entries: collections.OrderedDict) -> None:
        """Puts back the entries of :meth:`snapshot`."""
        self._data = collections.OrderedDict(entries)

    def __repr__(self) -> str:
        return f"Cache({self.name!r}, {len(self)}/{self.maxsize})"


def registry() -> tuple[Cache, ...]:
    """Every named :class:`Cache` of the package (created at import of the module that owns it)."""
    return tuple(_REGISTRY)
