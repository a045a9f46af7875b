r"""The tangent map of the user's function as a jaxpr, and its analyses remembered per signature.

Two properties of the user's function are read from its jaxpr (abstract: no FLOPs, no values).

Both analyses trace the tangent map of ``fun`` in the parameters,

.. math::

    t \mapsto \dot f(\theta, X)[t] = \frac{\partial f(\theta, X)}{\partial \theta}\, t ,

on an abstract batch :math:`X` of ``B`` rows (``jax.make_jaxpr`` of ``jax.jvp``), and follow its
data flow equation by equation, into ``jit``, ``scan``, ``while``, ``cond``, ``custom_jvp`` and
``checkpoint`` bodies. Only the *tangent* output is judged: a value under
``jax.lax.stop_gradient`` has no tangent, so a stop-gradient'ed batch statistic is not a coupling.

- :func:`~vmcgrad._checks.row_coupling.row_coupling` — does row :math:`i` of the tangent depend on
  other rows than row :math:`i` of the samples? Every chunked estimator assumes it does not
  (:math:`\partial f(\theta, X)_i/\partial\theta = \partial f(\theta, \sigma_i)/\partial\theta`):
  it calls ``fun`` on chunks of rows, so a batch mean inside ``fun`` becomes a chunk mean. Each
  value carries where its sample axis is (as ``jax.vmap``'s batching rules do): a reduction, a
  cumulative op, a sort, an FFT or a contraction *over* that axis is a proven coupling. A known
  primitive used in a way the rules do not follow (a partial slice of the sample axis) makes the
  value *unknown*, which is not reported (a false alarm would block a correct model; a missed one
  is what the docstrings' contract covers). A primitive the analysis has *no rule* for is never
  passed silently (:func:`~vmcgrad._checks.row_coupling.rows_verdict`,
  :func:`~vmcgrad._checks.row_coupling.settle_rows`): on concrete inputs a numerical
  check on the first rows decides; on traced ones vmcgrad warns that it assumed row-wise.
- :func:`~vmcgrad._checks.holomorphy.non_holomorphic_op` — for complex parameters: is the tangent
  map complex-linear (:math:`\dot f[i t] = i\, \dot f[t]`, the Cauchy–Riemann equations)? It is
  when no tangent value passes through ``conj``, ``real``, ``imag``, ``abs``, ``complex`` or a complex-to-real
  cast; the first such operation is returned. A holomorphic function written through them (e.g.
  ``log(sign) + logabsdet`` of ``slogdet``) is reported too: the caller then checks numerically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmcgrad import _jax_private as jcore  # the JAX internals, checked at import
from vmcgrad._cache import Cache
from vmcgrad._function import split_fun

# --- the abstract batch -------------------------------------------------------------------------


def abstract_batch_size(*trees: Any) -> int:
    """A prime batch size ``B >= 7`` that is no dimension of any leaf of ``trees``.

    A prime that appears nowhere else keeps the sample axis distinguishable through reshapes.
    """
    dims = {int(d) for tree in trees for leaf in jax.tree.leaves(tree) for d in np.shape(leaf)}
    b = 7
    while b in dims or any(b % p == 0 for p in range(2, int(b**0.5) + 1)):
        b += 1
    return b


def _abstract(tree: Any, rows: int | None = None) -> Any:
    def one(x):
        shape = tuple(np.shape(x))
        if rows is not None:
            shape = (rows, *shape[1:])
        return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

    return jax.tree.map(one, tree)


def tangent_jaxpr(fun: Callable, params: Any, samples: Any, rows: int) -> jcore.ClosedJaxpr:
    """The jaxpr of ``(params, tangent, samples) -> jvp`` on ``rows`` abstract samples.

    Its inputs are the leaves of ``params``, then of the tangent, then of ``samples``; its one
    output is the tangent of ``fun(params, samples)``.
    """

    def tangent(p, t, x):
        return jax.jvp(lambda q: fun(q, x), (p,), (t,))[1]

    p = _abstract(params)
    return jax.make_jaxpr(tangent)(p, p, _abstract(samples, rows))


# --- walking the bodies of higher-order primitives -----------------------------------------------


def body_of(j: Any) -> tuple[jcore.Jaxpr, list]:
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, [None] * len(j.jaxpr.constvars)
    return j, [None] * len(j.constvars)


CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


# --- once per signature -----------------------------------------------------------------------------


_CACHE_SIZE = 512
#: The analyses' verdicts per function and input signature (:func:`signature_key`).
_CACHE = Cache(maxsize=_CACHE_SIZE, name="jaxpr analyses per function and input signature")


def _avals(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def signature_key(kind: str, fun: Callable, params: Any, samples: Any) -> Any:
    """The cache key of ``kind`` for ``fun`` (:func:`vmcgrad._function.cache_key`: held weakly
    where it can be) and the shapes and dtypes of ``fun``'s arrays, ``params`` and ``samples``;
    None if unhashable."""
    _, data = split_fun(fun)
    return Cache.key(fun, kind, _avals(data), _avals(params), _avals(samples))


MISSING = object()


def recall(key: Any) -> Any:
    """The value remembered for ``key``, or ``MISSING``."""
    return _CACHE.get(key, MISSING)


def remember(key: Any, value: Any) -> None:
    _CACHE[key] = value


def once_per_signature(kind: str, fun: Callable, params: Any, samples: Any, compute: Callable) -> Any:
    """``compute()``, remembered per :func:`signature_key` (a ``fun`` that cannot be hashed is
    analysed at every call; the estimator then refuses it)."""
    key = signature_key(kind, fun, params, samples)
    value = recall(key)
    if value is MISSING:
        value = compute()
        remember(key, value)
    return value


def analyse(fun: Callable, params: Any, samples: Any, analysis: Callable) -> Any:
    """``analysis(jaxpr)`` of ``fun``'s tangent map on an abstract batch, or None when ``fun`` cannot
    be traced on it (an error of ``fun`` itself surfaces where the estimator traces it)."""
    rows = abstract_batch_size(params, samples)
    try:
        return analysis(tangent_jaxpr(fun, params, samples, rows))
    except Exception:
        return None  # do not expect: no verdict (an error of fun surfaces where the estimator traces it)
