"""The user's function as a jit argument: static code keyed by identity, traced data.

``fun`` is split as equinox's ``partition``/``combine`` split a module: its pytree leaves that are
array-like — JAX and NumPy arrays, NumPy scalars, Python ``float`` and ``complex`` — are traced
arguments of the compiled program, so new values (a model state, a coupling, a mutated NumPy
array) neither compile again nor go stale. Everything else is static and is the program's key:

- callables and other objects (a plain function, a callable instance, a ``Partial``'s function, a
  bound method's instance) by **identity**, as ``jax.jit`` keys the function it wraps: two
  instances whose ``__eq__`` ignores a constant get their own programs, and an unhashable callable
  is accepted. The key holds the object, so its ``id`` cannot be reused by a new object while any
  compiled program or cache entry keyed by it exists (a collected callable never aliases a new
  one); a bound method is keyed by its instance and function, not by the fresh method object
  every attribute access makes;
- Python ``int``, ``bool``, ``str``, ``bytes``, ``None``, types and dtypes by value: they are
  static on purpose (shapes, loop counts, flags in Python control flow) and equal values give the
  same program;
- the pytree structure by value (``PyTreeDef``'s equality), except that callables inside its node
  data (a ``Partial``'s function, an equinox static field holding a function) are also keyed by
  identity.

A plain callable that is not a pytree is wholly static: its attributes are read once, when it is
traced (as in ``jax.jit``); values that change between calls belong in a pytree (``Partial``, an
equinox ``Module``, a flax ``struct.dataclass``) to be traced.
"""

from __future__ import annotations

import enum
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_ARRAYS = (jax.Array, np.ndarray, np.generic)
_SCALARS = (float, complex)
_VALUES = (type(None), bool, int, str, bytes, type, np.dtype, enum.Enum)


class _Id:
    """An object keyed by identity (holding it: its id cannot be reused while this key exists)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Id and other.obj is self.obj

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


def _key(obj: Any) -> Any:
    """The cache key of one static object (module docstring)."""
    if isinstance(obj, _VALUES) and not isinstance(obj, _ARRAYS):
        return (type(obj), obj)
    if isinstance(obj, types.MethodType):
        return (types.MethodType, _key(obj.__self__), _key(obj.__func__))
    return _Id(obj)


def _node_callables(treedef: Any, out: list) -> list:
    """Identity keys of the callables in the node data of ``treedef``'s nodes."""
    node = treedef.node_data()
    if node is not None:
        _collect(node[1], out)
    for child in treedef.children():
        _node_callables(child, out)
    return out


def _collect(aux: Any, out: list) -> None:
    if isinstance(aux, (tuple, list)):
        for a in aux:
            _collect(a, out)
    elif isinstance(aux, dict):
        for a in aux.values():
            _collect(a, out)
    elif type(aux).__name__ == "_HashableCallableShim" and hasattr(aux, "fun"):
        # jax.tree_util.Partial wraps a functools.partial function in a new shim each time, equal
        # by the wrapped function's __eq__: the wrapped function is the key
        _collect(aux.fun, out)
    elif callable(aux) and not isinstance(aux, type):
        out.append(_key(aux))


def is_traced(x: Any) -> bool:
    """Whether a leaf of ``fun`` is a traced argument (array-like) rather than static."""
    return isinstance(x, _ARRAYS) or type(x) in _SCALARS


class StaticFun:
    """The static part of ``fun``: its structure and static leaves, hashed and compared as keys.

    Attributes:
        treedef: ``fun``'s pytree structure.
        static: per leaf, the static leaf, or None where the leaf is traced.
        traced: per leaf, whether it is traced.
    """

    __slots__ = ("_hash", "_key", "static", "traced", "treedef")

    def __init__(self, treedef: Any, static: tuple, traced: tuple):
        self.treedef, self.static, self.traced = treedef, static, traced
        leaf_keys = tuple(None if t else _key(x) for x, t in zip(static, traced))
        self._key = (treedef, traced, leaf_keys, tuple(_node_callables(treedef, [])))
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return type(other) is StaticFun and (other is self or other._key == self._key)

    def __repr__(self) -> str:
        return f"StaticFun({self.treedef}, {self._key[2]})"


def split_fun(fun: Callable) -> tuple[StaticFun, tuple]:
    """Returns ``(static, leaves)``: the hashable static part and the array-like leaves to trace."""
    leaves, treedef = jax.tree.flatten(fun)
    traced = tuple(is_traced(x) for x in leaves)
    static = tuple(None if t else x for x, t in zip(leaves, traced))
    data = tuple(jnp.asarray(x) if type(x) in _SCALARS else x for x, t in zip(leaves, traced) if t)
    key = StaticFun(treedef, static, traced)
    return key, data


def join_fun(static: StaticFun, leaves: tuple) -> Callable:
    """Inverse of :func:`split_fun`, inside the traced program."""
    it = iter(leaves)
    return jax.tree.unflatten(
        static.treedef, [next(it) if t else x for x, t in zip(static.static, static.traced)]
    )


def on_chunks(fun: Callable, name: str, n: int, chunk_size: Any) -> Callable:
    """``fun`` as the loop body calls it: an exception raised while tracing it on a chunk carries
    vmcgrad's context (the estimator, the chunk's shape, the fix) as a note, its type unchanged."""

    def chunk_fun(params, x, *args, **kwargs):
        try:
            return fun(params, x, *args, **kwargs)
        except Exception as err:
            err.add_note(_context(name, x, n, chunk_size))
            raise

    return chunk_fun


def _context(name: str, x: Any, n: int, chunk_size: Any) -> str:
    shapes = ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in jax.tree.leaves(x) if hasattr(a, "shape"))
    rows = {a.shape[0] for a in jax.tree.leaves(x) if getattr(a, "ndim", 0) >= 1}
    rows_text = f"{rows.pop()} rows" if len(rows) == 1 else "a chunk of rows"
    return (
        f"{name}: the error above was raised by `fun` while vmcgrad traced it on one chunk of the "
        f"samples: fun(params, x) with x of shape {shapes}. vmcgrad calls fun on chunks of {rows_text} "
        f"(chunk_size={chunk_size!r} rows per chunk on each device), not necessarily on all N={n} "
        "samples at once, and each row of fun's output must depend on its own sample only. Fix: "
        "write fun for any number of rows (x.shape[0] or -1 instead of a hard-coded batch size, or "
        "jax.vmap over single samples); chunk_size=None runs one chunk of each device's rows."
    )


def cache_key(fun: Callable) -> Any:
    """A key for vmcgrad's own bounded caches (validation, jaxpr analyses) that keeps nothing alive:
    a weak reference for a plain function (a dead reference equals only itself, so a new function
    at the same address never aliases it), else the static part of :func:`split_fun`."""
    if isinstance(fun, types.FunctionType):
        return weakref.ref(fun)
    return split_fun(fun)[0]
