"""Eager checks of user input, run before anything is traced.

Every message names the function and the argument, says what was given and what was expected,
and how to fix it, so a user mistake never surfaces as a JAX-internal traceback.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmcgrad._checks.row_coupling import Unjudged, rows_verdict, settle_rows
from vmcgrad._checks.tangent import once_per_signature

#: How many elements, items or characters :func:`describe` shows of a long input.
_MAX_ITEMS = 3
_MAX_CHARS = 80


def describe(x: Any) -> str:
    """A short description of a user's input for error messages: type, shape, dtype, a few elements.

    Arrays (and ``ShapeDtypeStruct``) are described by shape and dtype only, never by their values;
    lists, tuples and dicts by their length and first :data:`_MAX_ITEMS` elements; anything else
    by its ``repr``, cut to :data:`_MAX_CHARS` characters. So a message about a cotangent given as
    a list of 10^6 numbers stays one line.

    Examples:
        >>> import jax.numpy as jnp
        >>> describe(jnp.ones((3, 2), jnp.float32))
        'shape (3, 2) and dtype float32 (jax.Array)'
        >>> describe([0.5] * 1000)
        'a list of 1000 elements [0.5, 0.5, 0.5, ...]'
        >>> describe({"a": jnp.ones(8, jnp.float32), "b": 3})
        "{'a': float32[8], 'b': 3} (dict)"
    """
    if _is_array_like(x):
        kind = _array_kind(x)
        if _is_concrete_scalar(x):
            return f"{_short(x)} ({kind if isinstance(x, np.generic) else f'{kind} of dtype {x.dtype}'})"
        return f"shape {tuple(x.shape)} and dtype {x.dtype}" + (f" ({kind})" if kind else "")
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} element{'' if len(x) == 1 else 's'} {_items(x)}"
    if isinstance(x, dict):
        return f"{_items(x)} ({type(x).__name__})"
    return f"{_cut(repr(x))} ({type(x).__name__})"


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _is_concrete_scalar(x: Any) -> bool:
    return not isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) and np.ndim(x) == 0


def _array_kind(x: Any) -> str:
    if isinstance(x, jax.core.Tracer):
        return "a traced array"
    if isinstance(x, jax.Array):
        return "jax.Array"
    if isinstance(x, (np.ndarray, np.generic)):
        return f"numpy.{type(x).__name__}"
    return "" if isinstance(x, jax.ShapeDtypeStruct) else type(x).__name__


def _items(x: list | tuple | dict) -> str:
    """``[e0, e1, e2, ...]`` or ``{k0: e0, ...}`` with at most :data:`_MAX_ITEMS` shown."""
    if isinstance(x, dict):
        shown = [f"{k!r}: {_short(v)}" for k, v in list(x.items())[:_MAX_ITEMS]]
        open_, close = "{", "}"
    else:
        shown = [_short(e) for e in x[:_MAX_ITEMS]]
        open_, close = ("(", ")") if isinstance(x, tuple) else ("[", "]")
    more = ", ..." if len(x) > _MAX_ITEMS else ""
    return open_ + ", ".join(shown) + more + close


def _short(x: Any) -> str:
    """One element inside :func:`describe`: ``float64[8]``, a scalar's value, or a nested summary."""
    if _is_array_like(x):
        if _is_concrete_scalar(x):
            return _cut(repr(np.asarray(x).item()))
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    if isinstance(x, (list, tuple, dict)):
        return f"{type(x).__name__}[{len(x)}]"
    return _cut(repr(x))


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


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
        got = describe(out) if isinstance(out, jax.ShapeDtypeStruct) else f"a {type(out).__name__}"
        raise ValueError(
            f"{where}: `{arg}(params, samples)` must return one value per sample, an array of shape "
            f"({n},); it returned {got}. Fix: make `{arg}` map a batch of samples to a "
            "vector, e.g. reduce the per-sample outputs or use jax.vmap over single samples."
        )
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        raise TypeError(
            f"{where}: `{arg}(params, samples)` must return floating values (real or complex), since "
            f"vmcgrad differentiates them; it returned dtype {out.dtype}. An integer or boolean "
            "output has no derivative (JAX would give zeros). Fix: return the floating value "
            f"before any rounding or integer cast, or cast inside `{arg}`, e.g. "
            f"`lambda p, x: f(p, x).astype(jnp.float64)`."
        )
    return out


def check_callable(where: str, name: str, fun: Any) -> None:
    """``fun`` must be callable (checked before anything calls it)."""
    if not callable(fun):
        raise TypeError(
            f"{where}: `{name}` must be a function `{name}(params, samples) -> (N,) array`; got "
            f"{describe(fun)}, which is not callable. Fix: pass the function itself, e.g. "
            f"`lambda params, x: model.apply(params, x)`, or jax.tree_util.Partial(f, state)."
        )


def check_cotangent(where: str, name: str, ct: Any, out: jax.ShapeDtypeStruct) -> None:
    """The cotangent must be an array with the output's shape and dtype."""
    if not isinstance(ct, jax.Array) or ct.shape != out.shape or ct.dtype != out.dtype:
        raise TypeError(
            f"{where}: `{name}` must match the output of `fun`, shape {tuple(out.shape)} and "
            f"dtype {out.dtype}; got {describe(ct)}. "
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
                f"shape {tuple(p.shape)} and dtype {p.dtype} of the parameter; got {describe(t)}. "
                "Fix: build `tangent` with jax.tree.map over `params` (e.g. jnp.zeros_like)."
            )


def check_local_values(where: str, local_values: Any, n: int) -> None:
    """Local values: one real or complex number per sample, an array of shape ``(n,)``."""
    fix = (
        "Fix: pass the local estimators E_loc(σ_i) of the N samples as one vector, e.g. "
        "local_values.reshape(-1) if they come per chain."
    )
    if not isinstance(local_values, jax.Array) or not jnp.issubdtype(local_values.dtype, jnp.number):
        raise TypeError(
            f"{where}: `local_values` must be a real or complex numeric array; got "
            f"{describe(local_values)}. {fix}"
        )
    if local_values.shape != (n,):
        raise ValueError(
            f"{where}: `local_values` must have one value per sample, shape ({n},); got "
            f"{describe(local_values)}. {fix}"
        )


def check_problem(
    where: str, fun: Callable, params: Any, samples: Any, *, arg: str = "fun"
) -> tuple[Any, Any, int, jax.ShapeDtypeStruct]:
    """The checks every entry point shares: parameters, samples and the function's output.

    Returns:
        ``(params, samples, n, out)``: the inputs as JAX arrays, the sample count and the shape and
        dtype of ``fun(params, samples)``.
    """
    check_callable(where, arg, fun)
    params = as_arrays(where, "params", params)
    samples = as_arrays(where, "samples", samples)
    check_params(where, params)
    n = check_samples(where, samples)
    out = check_output(where, fun, params, samples, n, arg=arg)
    check_rows_independent(where, fun, params, samples, arg=arg)
    return params, samples, n, out


def check_rows_independent(where: str, fun: Callable, params: Any, samples: Any, *, arg: str = "fun") -> None:
    r"""Refuses a ``fun`` whose rows provably depend on other samples' rows.

    Every estimator calls ``fun`` on chunks of rows, so it needs
    :math:`\partial f(\theta, X)_i / \partial\theta = \partial f(\theta, \sigma_i)/\partial\theta`:
    row :math:`i`'s derivative may depend on sample :math:`i` only. A batch mean, max or logsumexp of
    log ψ subtracted without ``jax.lax.stop_gradient`` breaks it (the mean becomes a chunk mean).
    The tangent map's jaxpr is analysed on an abstract batch
    (:func:`vmcgrad._checks.row_coupling.row_coupling`), once per function and input shapes. A primitive
    the analysis has no rule for is checked numerically on concrete rows, else warned about
    (:func:`vmcgrad._checks.row_coupling.settle_rows`).
    """

    def compute():
        return rows_verdict(fun, params, samples)

    how = once_per_signature("rows", fun, params, samples, compute)
    if isinstance(how, Unjudged):
        how = settle_rows(where, arg, fun, params, samples, how)
    if how is not None:
        raise ValueError(
            f"{where}: the rows of `{arg}(params, samples)` depend on each other: its derivative in "
            f"`params` passes through {how} (axis 0), so row i's derivative depends on other samples "
            f"than sample i. vmcgrad calls `{arg}` on chunks of rows (chunk_size rows per call, and "
            "per device), so such a batch statistic would silently become a per-chunk one and the "
            "result would depend on the chunk size. Fix: make each row depend on its own sample "
            "only: wrap a normalising constant in jax.lax.stop_gradient (e.g. `y - "
            "jax.lax.stop_gradient(jnp.max(y))`, which leaves every derivative unchanged), or write "
            f"`{arg}` for one sample and batch it with jax.vmap."
        )


# --- numbers: shifts, tolerances, iteration caps, memory budgets -----------------------------------


def _real_scalar(x: Any) -> Any:
    """``x`` as a 0-d real (integer or floating, not bool) array, or None if it is not one.

    Concrete values go through numpy, so that their value can be checked also when the call is
    being traced (``jnp.asarray`` of a Python float under ``jax.jit`` is already a tracer).
    """
    if isinstance(x, jax.core.Tracer):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError, OverflowError):
            return None
    real = jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)
    return arr if np.ndim(arr) == 0 and real else None


def check_nonnegative_scalar(
    where: str, name: str, x: Any, dtype: Any = None, *, example: str = "1e-3"
) -> jax.Array:
    """``x`` as a 0-d array (of ``dtype`` if given) after checking it is a finite real number >= 0
    (:func:`check_nonnegative_number`).

    Raises:
        TypeError: not a real scalar (strings, bools, arrays with axes, complex numbers).
        ValueError: negative, NaN or infinite.
    """
    out = jnp.asarray(check_nonnegative_number(where, name, x, example=example))
    # (a jnp op: placed like other results under a context mesh, no recompile)
    return out if dtype is None else out.astype(dtype)


def check_nonnegative_number(where: str, name: str, x: Any, *, example: str = "1e-3") -> Any:
    """``x`` itself after checking it is a finite real number >= 0 (a Python number, a 0-d array):
    no array is made, so that a caller passing it on to ``jax.jit`` (a driver's hyperparameters, each
    step) runs no op for it.

    A traced ``x`` (an operator rebuilt inside ``jax.jit``) is checked for shape and dtype only;
    its value cannot be seen before tracing.

    Raises:
        TypeError: not a real scalar (strings, bools, arrays with axes, complex numbers).
        ValueError: negative, NaN or infinite.
    """
    fix = f"Fix: pass a finite float >= 0, e.g. {name}={example}."
    if _real_scalar(x) is None:
        raise TypeError(f"{where}: `{name}` must be a real scalar; got {describe(x)}. {fix}")
    _check_finite_nonnegative(where, name, x, fix)
    return x


def check_diag_shift(where: str, shift: Any, params: Any) -> Any:
    """``diag_shift``: a real scalar (:func:`check_nonnegative_scalar`), or one shift per parameter.

    A per-parameter shift is a pytree like ``params`` whose leaves are arrays of the parameters'
    shapes, real or complex with a zero imaginary part (a shift built with a complex parameter's
    dtype), each entry finite and >= 0 (checked where concrete). Returns the shift as given; None
    means 0.0, as in NetKet.

    Raises:
        TypeError: neither a real scalar nor a pytree of numeric arrays like ``params``.
        ValueError: a negative, NaN or infinite entry, or a non-zero imaginary part.
    """
    if shift is None:
        return 0.0
    p_def, s_def = jax.tree.structure(params), jax.tree.structure(shift)
    if s_def != p_def and jax.tree_util.treedef_is_leaf(s_def) and np.ndim(shift) == 0:
        check_nonnegative_scalar(where, "diag_shift", shift)
        return shift
    if s_def != p_def:
        expected = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        raise TypeError(
            f"{where}: `diag_shift` must be a real scalar or a pytree like the parameters "
            f"({_cut(repr(expected))}); got {describe(shift)}. Fix: pass e.g. diag_shift=0.01, or "
            "jax.tree.map(lambda p: 0.01 * jnp.ones(p.shape), params)."
        )
    fix = "Fix: build it with jax.tree.map over the parameters, e.g. lambda p: 0.01 * jnp.ones(p.shape)."
    for (path, p), d in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shift)):
        name = f"diag_shift{jax.tree_util.keystr(path)}"
        dtype = getattr(d, "dtype", None)
        if np.shape(d) != p.shape or dtype is None or not jnp.issubdtype(dtype, jnp.number):
            raise TypeError(
                f"{where}: `{name}` must be a real array of the parameter's shape {tuple(p.shape)}; "
                f"got {describe(d)}. {fix}"
            )
        _check_finite_nonnegative(where, name, d, fix)
    return shift


def _check_finite_nonnegative(where: str, name: str, x: Any, fix: str) -> None:
    """ValueError unless the number or array ``x`` is real (a complex one with a zero imaginary
    part counts), finite and >= 0 in every entry; a traced ``x`` passes (its values are unknown
    before tracing)."""
    if isinstance(x, jax.core.Tracer):
        return
    arr = np.asarray(x)
    if np.iscomplexobj(arr):
        if np.any(arr.imag != 0):
            raise ValueError(
                f"{where}: `{name}` must be real; got {describe(x)} with a non-zero imaginary part. "
                f"Fix: pass its real part, jnp.real({name})."
            )
        arr = arr.real
    if not (np.all(np.isfinite(arr)) and np.all(arr >= 0)):
        if arr.ndim == 0:
            raise ValueError(f"{where}: `{name}` must be a finite number >= 0; got {describe(x)}. {fix}")
        raise ValueError(
            f"{where}: `{name}` must be finite and >= 0 in every entry; got {describe(x)} with a "
            f"negative, NaN or infinite entry. {fix}"
        )


def check_tolerances(where: str, tol: Any, atol: Any) -> tuple[jax.Array, jax.Array]:
    """``(tol, atol)`` of an iterative solve, each a finite real number >= 0 (see
    :func:`check_nonnegative_scalar`)."""
    return (
        check_nonnegative_scalar(where, "tol", tol, example="1e-5"),
        check_nonnegative_scalar(where, "atol", atol, example="0.0"),
    )


def check_maxiter(where: str, maxiter: Any, default: int) -> int | jax.Array:
    """``maxiter`` as an int >= 0 (``default`` for None); an integer tracer is passed through."""
    fix = "Fix: pass e.g. maxiter=100, or maxiter=None for the default."
    if maxiter is None:
        return default
    if isinstance(maxiter, jax.core.Tracer):
        if maxiter.ndim == 0 and jnp.issubdtype(maxiter.dtype, jnp.integer):
            return maxiter
    elif not isinstance(maxiter, (bool, np.bool_)):
        try:
            value = operator.index(maxiter)
        except TypeError:
            value = None
        if value is not None:
            if value < 0:
                raise ValueError(f"{where}: `maxiter` must be an int >= 0; got {describe(maxiter)}. {fix}")
            return value
    raise TypeError(f"{where}: `maxiter` must be an int >= 0 or None; got {describe(maxiter)}. {fix}")


def check_memory_budget(where: str, memory_budget: Any) -> int | float | None:
    """``memory_budget`` (bytes per device) after checking it is a finite number > 0, or None.

    Any real number is accepted (``2**30``, ``1e9``, ``np.int64(2**30)``, a 0-d array); bools are
    refused rather than taken as 0 or 1 byte. Returns an int when the value is integral.
    """
    fix = "Fix: pass e.g. memory_budget=2**30 (1 GiB per device), or None for the default."
    if memory_budget is None:
        return None
    if isinstance(memory_budget, (numbers.Real, np.ndarray, jax.Array)) and not isinstance(
        memory_budget, (bool, np.bool_, jax.core.Tracer)
    ):
        arr = _real_scalar(memory_budget)
        if arr is not None:
            value = float(arr)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{where}: `memory_budget` must be a positive number of bytes; got "
                    f"{describe(memory_budget)}. {fix}"
                )
            return int(value) if value.is_integer() else value
    raise TypeError(
        f"{where}: `memory_budget` must be a positive number of bytes or None; got "
        f"{describe(memory_budget)}. {fix}"
    )


def check_design(where: str, design: Any, designs: Any) -> None:
    """``design``: None or one of the names ``designs`` (ValueError otherwise, before anything is traced)."""
    if design is not None and (not isinstance(design, str) or design not in designs):
        raise ValueError(
            f"{where}: `design` must be one of {tuple(designs)} or None; got {design!r}. Fix: pass "
            "design=None to let chunk_size='auto' choose from the memory budget, or design='fused'."
        )
