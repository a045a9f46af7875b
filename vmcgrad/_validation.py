"""Eager checks of user input, run before anything is traced.

Every message names the function and the argument, says what was given and what was expected,
and how to fix it, so a user mistake never surfaces as a JAX-internal traceback.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def describe(x: Any) -> str:
    """A short description of a value for messages: shape and dtype, or an abbreviated repr."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (list, tuple, dict)) or jax.tree.leaves(x) != [x]:
        leaves = jax.tree.leaves(x)
        text = repr(x)
        short = text if len(text) <= 80 else text[:60] + " ... " + text[-15:]
        return f"a {type(x).__name__} with {len(leaves)} leaves: {short}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 80 else text[:60] + ' ...'}"


_describe = describe


def check_chunk_size(where: str, chunk_size: Any) -> int | None:
    """Returns ``chunk_size`` as an int, None or ``"auto"`` after checking it."""
    if chunk_size is None or (isinstance(chunk_size, str) and chunk_size == "auto"):
        return chunk_size
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(
            f"{where}: `chunk_size` must be a positive int, None or 'auto'; got {chunk_size!r} "
            f"of type {type(chunk_size).__name__}. Fix: pass e.g. chunk_size=1024, "
            "chunk_size=None for one chunk per device, or chunk_size='auto'."
        )
    if chunk_size <= 0:
        raise ValueError(
            f"{where}: `chunk_size` must be a positive int, None or 'auto'; got {chunk_size}. "
            "Fix: pass e.g. chunk_size=1024, chunk_size=None for one chunk per device, or "
            "chunk_size='auto'."
        )
    return operator.index(chunk_size)


def as_arrays(where: str, name: str, tree: Any) -> Any:
    """Converts the leaves of ``tree`` to JAX arrays, naming ``name`` if one cannot be."""
    try:
        return jax.tree.map(jnp.asarray, tree)
    except TypeError as err:
        raise TypeError(
            f"{where}: every leaf of `{name}` must be an array; converting one failed with: {err}. "
            f"Fix: pass numbers or arrays as the leaves of `{name}`."
        ) from None


def check_params(where: str, params: Any) -> None:
    """Parameters must be a non-empty pytree of inexact (real or complex floating) arrays."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError(
            f"{where}: `params` has no array leaves; got {params!r}. Fix: pass the model's parameter pytree."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"{where}: every leaf of `params` must be a real or complex floating array; "
                f"the leaf at {jax.tree_util.keystr(path)} has dtype {leaf.dtype}. Fix: cast it "
                "(e.g. jnp.asarray(x, jnp.float64)) or close over it in `fun` instead."
            )


def check_samples(where: str, samples: Any) -> int:
    """Returns the common leading size N >= 1 of the sample leaves."""
    leaves_with_path = jax.tree_util.tree_leaves_with_path(samples)
    if not leaves_with_path:
        raise ValueError(
            f"{where}: `samples` has no array leaves; got {samples!r}. "
            "Fix: pass an array (or pytree of arrays) with the samples along axis 0."
        )
    sizes = {}
    for path, leaf in leaves_with_path:
        if leaf.ndim == 0:
            raise ValueError(
                f"{where}: every leaf of `samples` needs a leading sample axis; the leaf at "
                f"{jax.tree_util.keystr(path) or 'the root'} is a scalar. "
                "Fix: stack the samples along axis 0."
            )
        sizes[jax.tree_util.keystr(path) or "<root>"] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{where}: the leaves of `samples` must share their leading (sample) size; got "
            f"{sizes}. Fix: give every leaf the same number of samples along axis 0."
        )
    n = next(iter(sizes.values()))
    if n == 0:
        raise ValueError(f"{where}: `samples` is empty (N = 0 along axis 0). Fix: pass at least one sample.")
    return n


def check_output(
    where: str, fun: Callable, params: Any, samples: Any, n: int, *, arg: str = "fun"
) -> jax.ShapeDtypeStruct:
    """Evaluates the shape of ``fun(params, samples)`` (no FLOPs) and checks it is ``(n,)``.

    ``arg`` is the function's argument name in the caller's signature (``fun``, ``logpsi``).
    """
    # shapes only, without shardings: with Explicit-axis types a parameter-sharded leaf and the
    # samples split over the same axis would make the full-batch product a sharding type error,
    # while the per-device body sees them gathered and local
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, samples))
    out = jax.eval_shape(fun, *bare)
    if not isinstance(out, jax.ShapeDtypeStruct) or tuple(out.shape) != (n,):
        got = _describe(out) if isinstance(out, jax.ShapeDtypeStruct) else f"a {type(out).__name__}"
        raise ValueError(
            f"{where}: `{arg}(params, samples)` must return one value per sample, an array of shape "
            f"({n},); it returned {got}. Fix: make `{arg}` map a batch of samples to a "
            "vector, e.g. reduce the per-sample outputs or use jax.vmap over single samples."
        )
    return out


def check_cotangent(where: str, name: str, ct: Any, out: jax.ShapeDtypeStruct) -> None:
    """The cotangent must be an array with the output's shape and dtype."""
    if not isinstance(ct, jax.Array) or ct.shape != out.shape or ct.dtype != out.dtype:
        raise TypeError(
            f"{where}: `{name}` must match the output of `fun`, shape {tuple(out.shape)} and "
            f"dtype {out.dtype}; got {_describe(ct) if hasattr(ct, 'shape') else repr(ct)}. "
            f"Fix: pass one {out.dtype} value per sample, e.g. jnp.asarray(v, {out.dtype})."
        )


def check_tangent(where: str, tangent: Any, params: Any) -> None:
    """The tangent must have the pytree structure, shapes and dtypes of ``params``."""
    p_def, t_def = jax.tree.structure(params), jax.tree.structure(tangent)
    if p_def != t_def:
        raise TypeError(
            f"{where}: `tangent` must have the pytree structure of `params`; got {t_def}, "
            f"expected {p_def}. Fix: build it with jax.tree.map over `params`."
        )
    for (path, p), t in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(tangent)):
        if p.shape != t.shape or p.dtype != t.dtype:
            raise TypeError(
                f"{where}: the leaf of `tangent` at {jax.tree_util.keystr(path)} must have the "
                f"shape {tuple(p.shape)} and dtype {p.dtype} of the parameter; got {_describe(t)}. "
                "Fix: build `tangent` with jax.tree.map over `params` (e.g. jnp.zeros_like)."
            )


def check_local_values(where: str, local_values: Any, n: int) -> None:
    """Local values: one real or complex number per sample, an array of shape ``(n,)``."""
    fix = (
        "Fix: pass the local estimators E_loc(σ_i) of the N samples as one vector, e.g. "
        "local_values.reshape(-1) if they come per chain."
    )
    if not isinstance(local_values, jax.Array) or not jnp.issubdtype(local_values.dtype, jnp.number):
        got = _describe(local_values) if hasattr(local_values, "dtype") else repr(local_values)
        raise TypeError(f"{where}: `local_values` must be a real or complex numeric array; got {got}. {fix}")
    if local_values.shape != (n,):
        raise ValueError(
            f"{where}: `local_values` must have one value per sample, shape ({n},); got "
            f"{_describe(local_values)}. {fix}"
        )


def check_problem(
    where: str, fun: Callable, params: Any, samples: Any, *, arg: str = "fun"
) -> tuple[Any, Any, int, jax.ShapeDtypeStruct]:
    """The checks every entry point shares: parameters, samples and the function's output.

    Returns:
        ``(params, samples, n, out)``: the inputs as JAX arrays, the sample count and the shape and
        dtype of ``fun(params, samples)``.
    """
    params = as_arrays(where, "params", params)
    samples = as_arrays(where, "samples", samples)
    check_params(where, params)
    n = check_samples(where, samples)
    return params, samples, n, check_output(where, fun, params, samples, n, arg=arg)


def check_memory_budget(where: str, memory_budget: Any) -> int | None:
    """A memory budget: None, or any positive finite real number of bytes (returned as an int)."""
    if memory_budget is None:
        return None
    ok = isinstance(memory_budget, (int, float, np.integer, np.floating)) and not isinstance(
        memory_budget, (bool, np.bool_)
    )
    if not ok or not np.isfinite(memory_budget) or memory_budget < 1:
        raise ValueError(
            f"{where}: `memory_budget` must be a positive number of bytes; got {memory_budget!r} "
            "(expected bytes per device, a positive finite int or float). Fix: pass e.g. "
            "memory_budget=2**30 (1 GiB), or None for the default."
        )
    return int(memory_budget)
