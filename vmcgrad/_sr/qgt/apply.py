r"""What applies a QGT operator, any of them (:class:`vmcgrad.QGTOperator`, :class:`vmcgrad.LinearizedQGT`):
the compiled product :math:`S_\text{eff} v` and the compiled conjugate-gradient solve of
:math:`S_\text{eff} x = b`.

An operator passed here is a :class:`vmcgrad._sr.qgt.abstract.AbstractQGT`: it provides ``problem``,
``views`` (the vectors it takes), the shifts, ``_at(prob)`` (itself at the chunk of ``prob``) and
``_apply_rep(v)`` (the product on vectors in its internal representation).

The programs are written once for both operator classes, as module-level jitted functions that
take the operator as a pytree argument (its problem static), so that more than the classes' methods
can call them: :func:`vmcgrad.QGT` sizes :func:`matmul_program` for each candidate design when it
picks the design from the memory budget (:mod:`vmcgrad._sr.qgt.qgt`), and the tests lower it to read its
compiled bytes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Problem, call
from vmcgrad._sr.solve import CGInfo, differentiable_cg


@partial(jax.jit, static_argnums=(0, 3))
def matmul_program(prob: Problem, op: Any, v: Any, kind: str) -> Any:
    op = op._at(prob)
    views = op.views
    return views.from_rep(op._apply_rep(views.to_rep(v, kind)), kind)


def solve(A: Any, b: Any, *, x0: Any, tol: Any, atol: Any, maxiter: Any) -> tuple[Any, CGInfo]:
    """``A.solve`` of a QGT operator: checks the vectors, then runs the compiled solve."""
    name = A._builder
    where = f"{name}.solve"
    views = A.views
    b, kind = views.kind(f"{name} (b)", "b", b)
    if x0 is not None:
        x0, kind0 = views.kind(f"{name} (x0)", "x0", x0)
        if kind0 != kind:
            raise TypeError(
                f"{where}: `x0` must be the same kind of vector as `b` ({kind}); got {kind0}. "
                "Fix: pass both as pytrees, or both flat."
            )
    tol, atol = check.check_tolerances(where, tol, atol)
    maxiter = check.check_maxiter(where, maxiter, default=10 * A.dim)
    # on kept linearisations where the budget holds them (QGTOperator.kept_solve); the chunk is then
    # the solve's own automatic one, as for the recomputing solve (its out-of-memory retry included)
    keep = A.kept_solve is not None
    return call(solve_program, A.problem, A, b, x0, tol, atol, maxiter, kind, keep)


@partial(jax.jit, static_argnums=(0, 7, 8))
def solve_program(
    prob: Problem, A: Any, b: Any, x0: Any, tol: Any, atol: Any, maxiter: Any, kind: str, keep: bool = False
):
    """The solve of ``A x = b``; with ``keep``, its iterations run on every chunk's linearisation,
    kept once (``A`` a :class:`vmcgrad.QGTOperator`)."""
    A = A._at(prob)
    views = A.views
    b = views.to_rep(b, kind)
    x0 = None if x0 is None else views.to_rep(x0, kind)
    # Differentiable implicitly, both operators (a LinearizedQGT's product is the chunked primitive
    # too; its rules refuse a tangent in the kept linearisations).
    matvec = partial(_apply_rep, A)  # one trace, however many times CG and its transpose call it
    # With `keep`, the iterations run on every chunk's linearisation, kept once here (where the
    # budget holds them: QGTOperator.kept_solve). Only the solution is differentiated
    # (custom_linear_solve: x' = A^{-1}(b' - A' x), A' by `matvec`), never the iterations, so the
    # kept maps are taken of stopped inputs: a derivative in the parameters goes through the
    # recomputing product.
    iterate = partial(_apply_rep, jax.lax.stop_gradient(A).linearize()) if keep else matvec
    options = dict(tol=tol, atol=atol, maxiter=maxiter, M=_jacobi(A))
    x, info = differentiable_cg(matvec, b, x0, iterate=iterate, **options)
    return views.from_rep(x, kind), info


@jax.jit
def _apply_rep(A: Any, rep: Any) -> Any:
    """``A._apply_rep(rep)`` as a function of its own, which JAX traces once per operand shapes: the
    solve's trace calls it eight times (``custom_linear_solve``'s own trace, then CG's loop, its final
    residual check and ``x0``'s residual, in the solve and in its transpose), and each call traced
    the model again (tests/test_qgt.py::test_solve_traces_the_product_once)."""
    return A._apply_rep(rep)


def _jacobi(op: Any) -> Any:
    r"""With ``diag_scale`` set, the preconditioner :math:`r \mapsto D^{-1} r`,
    :math:`D = \epsilon_1 \operatorname{diag}(S) + \epsilon_2` (None without ``diag_scale``).

    Entries with :math:`D_{kk} = 0` (a parameter that does not change :math:`\log\psi`, no shift)
    are left unscaled, so that :math:`M` stays positive definite.
    """
    if op.diag_scale is None:
        return None
    d = jax.tree.map(lambda s: op.diag_scale * s + op.diag_shift, op.diag_s)
    inv = jax.tree.map(lambda d: jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 1), d)
    return lambda r: jax.tree.map(lambda a, w: (a * w).astype(a.dtype), r, inv)
