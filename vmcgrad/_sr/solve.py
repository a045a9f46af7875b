r"""Preconditioned conjugate gradient for Hermitian positive-definite operators on pytrees.

``jax.scipy.sparse.linalg.cg`` (and ``gmres``) work on vmcgrad's QGT products too, real and complex,
jitted, transposed and differentiated (checked with jax 0.10.2); this one is written here for what
they do not report: a :class:`CGInfo` with the iteration count, the residual, and ``converged``
decided on the true residual (below), where ``jax.scipy``'s ``info`` is None. The iteration is the
textbook preconditioned one, the same as ``jax.scipy``'s (given the same ``M``), so that solves
compare iterate for iterate (``tests/test_solve.py::test_cg_iterates_equal_jax_scipy``): with
:math:`z = M r` (:math:`M \approx A^{-1}` Hermitian positive definite; the identity when no
preconditioner is given)

.. math::

    r_0 = b - A x_0,\quad z_0 = M r_0,\quad p_0 = z_0,\quad \gamma_k = \mathrm{Re}\langle r_k, z_k\rangle,

    \alpha_k = \frac{\gamma_k}{\mathrm{Re}\,\langle p_k, A p_k\rangle},\quad
    x_{k+1} = x_k + \alpha_k p_k,\quad r_{k+1} = r_k - \alpha_k A p_k,\quad
    p_{k+1} = z_{k+1} + \frac{\gamma_{k+1}}{\gamma_k} p_k ,

with :math:`\langle a, b\rangle = \sum_j \bar a_j b_j` over all leaves (complex-safe). The loop
stops when the recursion residual meets :math:`\lVert r_k\rVert \le \tau = \max(\mathrm{tol}\,
\lVert b\rVert, \mathrm{atol})` or after ``maxiter`` iterations. With ``x0=None`` the start is
:math:`x_0 = 0` and no product is spent on :math:`A x_0`.

**Converged means the true residual.** The recursion residual :math:`r_k` drifts from
:math:`b - A x_k` in floating point, and it says nothing when the iteration breaks down (a
singular :math:`A`, an indefinite one, a NaN). So after the loop, when the recursion claims
convergence, the residual is measured once more with one extra product,
:math:`\lVert b - A x\rVert \le \tau`, and only that (finite) value makes ``converged`` true. When
the recursion itself misses the tolerance the solve is reported as not converged and the extra
product is skipped (``lax.cond``): a solve is never reported converged on a wrong answer, and a
solve that ran out of iterations costs no more than before.
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
        residual_norm: :math:`\\lVert r_k\\rVert_2`, the residual as updated by the recursion (what
            the loop stops on).
        converged: whether the returned ``x`` meets the tolerance, measured on the true residual
            :math:`\\lVert b - A x\\rVert_2` (False when stopped by ``maxiter`` short of it, or on
            a NaN).
        true_residual_norm: :math:`\\lVert b - A x\\rVert_2` recomputed after the loop; NaN when
            not measured (the recursion residual already missed the tolerance).
    """

    iterations: jax.Array
    residual_norm: jax.Array
    converged: jax.Array
    true_residual_norm: jax.Array


def vdot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_j \\bar a_j b_j` over all leaves of two pytrees of the same structure."""
    terms = [jnp.sum(jnp.conj(x) * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return sum(terms[1:], terms[0])


def _axpy(alpha: jax.Array, x: Any, y: Any) -> Any:
    return jax.tree.map(lambda a, b: (alpha * a + b).astype(b.dtype), x, y)


def _sub(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: (x - y).astype(x.dtype), a, b)


def cg(
    matvec: Callable[[Any], Any],
    b: Any,
    x0: Any = None,
    *,
    tol: float | jax.Array = 1e-5,
    atol: float | jax.Array = 0.0,
    maxiter: int | jax.Array,
    M: Callable[[Any], Any] | None = None,
) -> tuple[Any, CGInfo]:
    """Solves ``matvec(x) = b`` for Hermitian positive-definite ``matvec`` by (preconditioned) CG.

    Args:
        matvec: linear, Hermitian positive-definite map on pytrees shaped like ``b``.
        b: right-hand side, a pytree of real or complex arrays.
        x0: initial guess shaped like ``b``, or None for zeros (saves one product).
        tol, atol: relative and absolute tolerances on the residual 2-norm (of the original system
            ``matvec(x) = b``, also with a preconditioner).
        maxiter: maximum number of iterations (may be traced).
        M: preconditioner ``r -> M r`` (an approximation of the inverse of ``matvec``, Hermitian
            positive definite), as ``jax.scipy.sparse.linalg.cg``'s ``M``; None for none.

    Returns:
        ``(x, info)`` with ``info`` a :class:`CGInfo`; ``info.converged`` refers to the residual
        :math:`\\lVert b - \\mathrm{matvec}(x)\\rVert` recomputed after the loop.
    """
    real = jnp.real
    precondition = M if M is not None else (lambda r: r)
    bnorm2 = real(vdot(b, b))
    thresh2 = jnp.maximum(jnp.square(tol) * bnorm2, jnp.square(atol))
    if x0 is None:
        x0 = jax.tree.map(jnp.zeros_like, b)
        r0 = b
    else:
        r0 = _sub(b, matvec(x0))
    z0 = precondition(r0)
    gamma0 = real(vdot(r0, z0))
    rnorm0 = gamma0 if M is None else real(vdot(r0, r0))

    def cond(state):
        *_, rnorm2, k = state
        return (rnorm2 > thresh2) & (k < maxiter)

    def body(state):
        x, r, p, gamma, _, k = state
        ap = matvec(p)
        alpha = gamma / real(vdot(p, ap))
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, ap, r)
        z = precondition(r)
        gamma_new = real(vdot(r, z))
        p = _axpy(gamma_new / gamma, p, z)
        rnorm2 = gamma_new if M is None else real(vdot(r, r))
        return x, r, p, gamma_new, rnorm2, k + 1

    init = (x0, r0, z0, gamma0, rnorm0, jnp.zeros((), jnp.int32))
    x, _, _, _, rnorm2, k = jax.lax.while_loop(cond, body, init)
    claimed = rnorm2 <= thresh2  # False for NaN

    def true_residual2(x):
        r = _sub(b, matvec(x))
        return real(vdot(r, r))

    true2 = jax.lax.cond(claimed, true_residual2, lambda x: jnp.full_like(rnorm2, jnp.nan), x)
    converged = claimed & (true2 <= thresh2)
    return x, CGInfo(
        iterations=k, residual_norm=jnp.sqrt(rnorm2), converged=converged, true_residual_norm=jnp.sqrt(true2)
    )


def differentiable_cg(
    matvec: Any, b: Any, x0: Any, *, iterate: Any = None, **options: Any
) -> tuple[Any, CGInfo]:
    r""":func:`vmcgrad._sr.solve.cg` as ``jax.lax.custom_linear_solve``: :math:`x = A^{-1} b` is
    differentiated implicitly, not through the iterations.

    ``iterate`` (default ``matvec``) is the product the iterations run: the same matrix, computed
    another way (from kept linearisations); derivatives take ``matvec`` only.

    The tangent of :math:`x` is :math:`A^{-1}(\dot b - \dot A x)` (one more solve), its transpose a
    solve with :math:`A^T`; for the Hermitian :math:`A` of a QGT, :math:`A^T y = \overline{A \bar y}`,
    so the transposed solve is the same CG on conjugated vectors. ``jax.vmap`` batches the CG loop
    (a batched stopping rule runs every lane until the last one stops; each lane's ``x`` stops
    changing when its own residual does).
    """

    iterate = matvec if iterate is None else iterate

    def solve(mv, rhs):
        del mv  # matvec; the iterations run `iterate`, the same matrix
        return cg(iterate, rhs, x0, **options)

    def transpose_solve(vecmat, rhs):
        del vecmat
        x, info = cg(iterate, _conj(rhs), None if x0 is None else _conj(x0), **options)
        return _conj(x), info

    return jax.lax.custom_linear_solve(matvec, b, solve, transpose_solve, has_aux=True)


def _conj(tree: Any) -> Any:
    return jax.tree.map(jnp.conj, tree)
