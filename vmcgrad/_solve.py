r"""Conjugate gradient for Hermitian positive-definite operators on pytrees, in one ``lax.while_loop``.

Written here rather than taken from ``jax.scipy.sparse.linalg.cg`` because the latter fails on
jax 0.10.2 when a *complex* mat-vec accumulates into refs (``DynamicJaxprTracer has no attribute
ref``), which is exactly what the QGT product does. The iteration is the textbook one (and the
same as ``jax.scipy``'s, so that solves compare iterate for iterate):

.. math::

    r_0 = b - A x_0,\quad p_0 = r_0,\quad
    \alpha_k = \frac{\langle r_k, r_k\rangle}{\mathrm{Re}\,\langle p_k, A p_k\rangle},\quad
    x_{k+1} = x_k + \alpha_k p_k,\quad r_{k+1} = r_k - \alpha_k A p_k,\quad
    p_{k+1} = r_{k+1} + \frac{\langle r_{k+1}, r_{k+1}\rangle}{\langle r_k, r_k\rangle} p_k ,

with :math:`\langle a, b\rangle = \sum_j \bar a_j b_j` over all leaves (complex-safe), stopping when
:math:`\lVert r_k\rVert \le \max(\mathrm{tol}\,\lVert b\rVert, \mathrm{atol})` or after ``maxiter``
iterations. With ``x0=None`` the start is :math:`x_0 = 0` and no product is spent on :math:`A x_0`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class CGInfo(NamedTuple):
    """What a conjugate-gradient solve did.

    Attributes:
        iterations: number of iterations run (= operator products after the first residual).
        residual_norm: :math:`\\lVert b - A x\\rVert_2` of the returned ``x`` (as updated by the
            recursion, not recomputed).
        converged: whether the tolerance was met (False when stopped by ``maxiter``).
    """

    iterations: jax.Array
    residual_norm: jax.Array
    converged: jax.Array


def vdot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_j \\bar a_j b_j` over all leaves of two pytrees of the same structure."""
    terms = [jnp.sum(jnp.conj(x) * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return sum(terms[1:], terms[0])


def _axpy(alpha: jax.Array, x: Any, y: Any) -> Any:
    return jax.tree.map(lambda a, b: (alpha * a + b).astype(b.dtype), x, y)


def cg(
    matvec: Callable[[Any], Any],
    b: Any,
    x0: Any = None,
    *,
    tol: float | jax.Array = 1e-5,
    atol: float | jax.Array = 0.0,
    maxiter: int | jax.Array,
) -> tuple[Any, CGInfo]:
    """Solves ``matvec(x) = b`` for Hermitian positive-definite ``matvec`` by conjugate gradient.

    Args:
        matvec: linear, Hermitian positive-definite map on pytrees shaped like ``b``.
        b: right-hand side, a pytree of real or complex arrays.
        x0: initial guess shaped like ``b``, or None for zeros (saves one product).
        tol, atol: relative and absolute tolerances on the residual 2-norm.
        maxiter: maximum number of iterations (may be traced).

    Returns:
        ``(x, info)`` with ``info`` a :class:`CGInfo`.
    """
    real = jnp.real
    bnorm2 = real(vdot(b, b))
    thresh2 = jnp.maximum(jnp.square(tol) * bnorm2, jnp.square(atol))
    if x0 is None:
        x0 = jax.tree.map(jnp.zeros_like, b)
        r0 = b
    else:
        r0 = jax.tree.map(lambda bb, ax: bb - ax, b, matvec(x0))
    gamma0 = real(vdot(r0, r0))

    def cond(state):
        _, _, _, gamma, k = state
        return (gamma > thresh2) & (k < maxiter)

    def body(state):
        x, r, p, gamma, k = state
        ap = matvec(p)
        alpha = gamma / real(vdot(p, ap))
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, ap, r)
        gamma_new = real(vdot(r, r))
        p = _axpy(gamma_new / gamma, p, r)
        return x, r, p, gamma_new, k + 1

    init = (x0, r0, r0, gamma0, jnp.zeros((), jnp.int32))
    x, _, _, gamma, k = jax.lax.while_loop(cond, body, init)
    return x, CGInfo(iterations=k, residual_norm=jnp.sqrt(gamma), converged=gamma <= thresh2)
