"""The user's function as a jit argument: static code keyed by identity, traced data.

``fun`` is split as equinox's ``partition``/``combine`` split a module: its pytree leaves that are
array-like — JAX and NumPy arrays, NumPy scalars, Python ``float`` and ``complex`` — are traced
arguments of the compiled program, so new values (a model state, a coupling, a mutated NumPy
array) neither compile again nor go stale. Everything else is static and is the program's key:

- callables and other objects (a plain function, a callable instance, a ``Partial``'s function, a
  bound method's instance) by **identity**, as ``jax.jit`` keys the function it wraps: two
  instances whose ``__eq__`` ignores a constant get their own programs, and an unhashable callable
  is accepted. A compiled program's key holds the object, so its ``id`` cannot be reused by a new
  object while the program exists; vmcgrad's own caches key it by :func:`cache_key`, which holds
  it weakly and, once it is collected, equals only itself (a collected callable never aliases a
  new one either way). A bound method is keyed by its instance and function, not by the fresh
  method object every attribute access makes;
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

import dataclasses
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

    def weak_key(self) -> Any:
        """:func:`cache_key` of this function: its key, holding no callable."""
        treedef, traced, leaf_keys, node_callables = self._key
        if treedef.num_nodes == treedef.num_leaves == 1 and not traced[0]:  # a lone static leaf
            return _weak_obj(self.static[0])
        return (
            weak_structure(treedef),
            traced,
            tuple(_weak_of_key(k) for k in leaf_keys),
            tuple(_weak_of_key(k) for k in node_callables),
        )


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


class _WeakId:
    """An object keyed by identity without holding it: equal only to a key of the same live object
    (a key whose object died equals only itself, so a new object at the same address never aliases
    it)."""

    __slots__ = ("_hash", "ref")

    def __init__(self, obj: Any):
        self.ref, self._hash = weakref.ref(obj), id(obj)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if other is self:
            return True
        if type(other) is not _WeakId:
            return False
        obj = self.ref()
        return obj is not None and obj is other.ref()

    def __repr__(self) -> str:
        obj = self.ref()
        return "<dead>" if obj is None else f"<weak {type(obj).__name__} at {self._hash:#x}>"


def _weak(obj: Any) -> Any:
    """A key of ``obj`` that does not hold it where Python allows a weak reference, else :func:`_key`."""
    if isinstance(obj, _VALUES) and not isinstance(obj, _ARRAYS):
        return (type(obj), obj)
    try:
        return _WeakId(obj)
    except TypeError:  # no weak references to it (a builtin, a class with __slots__)
        return _key(obj)


def _weak_obj(obj: Any) -> Any:
    """:func:`_weak`, a bound method by its parts (a new method object at every attribute access)."""
    if isinstance(obj, types.MethodType):
        return (types.MethodType, _weak(obj.__self__), _weak(obj.__func__))
    return _weak(obj)


def _weak_of_key(key: Any) -> Any:
    """A :func:`_key` with its identity keys made weak."""
    if type(key) is _Id:
        return _weak(key.obj)
    if type(key) is tuple and len(key) == 3 and key[0] is types.MethodType:
        return (types.MethodType, _weak_of_key(key[1]), _weak_of_key(key[2]))
    return key


def _weak_aux(aux: Any) -> Any:
    """A pytree node's static data as a key holding no callable: callables by :func:`_weak_obj`,
    containers and frozen dataclasses (a static ``Problem``) field by field, values as they are."""
    if isinstance(aux, StaticFun):
        return aux.weak_key()
    if type(aux).__name__ == "_HashableCallableShim" and hasattr(aux, "fun"):
        return _weak_aux(aux.fun)  # a Partial's function (see _collect)
    if isinstance(aux, (tuple, list)):
        return (type(aux), tuple(_weak_aux(a) for a in aux))
    if isinstance(aux, dict):
        return (dict, tuple((k, _weak_aux(v)) for k, v in aux.items()))
    params = getattr(type(aux), "__dataclass_params__", None)
    if params is not None and params.frozen and params.eq:
        fields = dataclasses.fields(aux)
        return (type(aux), tuple(_weak_aux(getattr(aux, f.name)) for f in fields if f.compare))
    if callable(aux) and not isinstance(aux, type):
        return _weak_obj(aux)
    return aux


def weak_structure(treedef: Any) -> Any:
    """``treedef`` as a key that holds nothing of its node data but values (:func:`_weak_aux`):
    equal for equal structures whose callables are the same live objects."""
    data = treedef.node_data()
    if data is None:  # a leaf
        return None
    kind, aux = data
    return kind, _weak_aux(aux), tuple(weak_structure(child) for child in treedef.children())


def cache_key(fun: Callable | StaticFun) -> Any:
    """A key of ``fun`` for vmcgrad's own caches (:mod:`vmcgrad._cache`) that keeps it alive nowhere.

    The key equals another as :class:`StaticFun` does (callables by identity, values by value,
    the pytree structure), but holds every callable and object by weak reference: while it lives,
    by identity; once it is collected the key equals only itself, so the entry can no longer be
    found (and :class:`vmcgrad._cache.Cache` drops it). An object Python cannot reference weakly
    (a builtin, a class with ``__slots__``) is held, up to the cache's bound. ``fun`` may also be
    the static part of :func:`split_fun`: the key is the same.
    """
    if isinstance(fun, types.FunctionType):  # the common case, without flattening
        return _weak(fun)
    if isinstance(fun, types.MethodType):
        return _weak_obj(fun)
    static = fun if isinstance(fun, StaticFun) else split_fun(fun)[0]
    return static.weak_key()


def is_dead(key: Any) -> bool:
    """Whether a key made by :func:`cache_key` (or a tuple holding one), or a weak reference, names
    a collected object."""
    if type(key) is _WeakId:
        return key.ref() is None
    if type(key) is weakref.ref:
        return key() is None
    if type(key) is tuple:
        return any(is_dead(k) for k in key if type(k) in (_WeakId, weakref.ref, tuple))
    return False
