r"""``AbstractQGT``: what the two QGT operators share (:class:`vmcgrad.QGTOperator`, which recomputes
each chunk's forward pass per product, and :class:`vmcgrad.LinearizedQGT`, which keeps them).

.. math::

    S_\text{eff}\,v = S v + \epsilon_1 \operatorname{diag}(S)\, v + \epsilon_2 v,\qquad
    S = \frac1N \Delta O^\dagger \Delta O,\qquad \Delta O_i = O_i - \bar O,

with :math:`\epsilon_1` = ``diag_scale`` and :math:`\epsilon_2` = ``diag_shift``. Both operators hold
the same leaves (the parameters and samples, :math:`\bar O`, :math:`\operatorname{diag} S` and the
shifts) and take the same vectors (:mod:`vmcgrad._sr.qgt.views`); they differ only in how a chunk's
:math:`\Delta O^\dagger \Delta O v` is computed (:meth:`AbstractQGT._apply_rep`). So the product,
the solve, the dense matrix, the diagonal and :meth:`~AbstractQGT.replace` are written here once.
As in equinox, a class is abstract or final: the two operators derive from this one, not from each
other.
"""

from __future__ import annotations

import abc
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Problem, call
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._sr.base import AbstractOperator
from vmcgrad._sr.modes import to_rep
from vmcgrad._sr.qgt.apply import matmul_program, solve
from vmcgrad._sr.qgt.passes import jacobian_chunk
from vmcgrad._sr.qgt.views import Views
from vmcgrad._sr.solve import CGInfo


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class AbstractQGT(AbstractOperator):
    r"""The regularised QGT :math:`S + \epsilon_1\operatorname{diag}(S) + \epsilon_2` of one set of samples.

    Vectors are pytrees like ``params``, flat vectors in ``ravel_pytree(params)`` order, or flat
    vectors in the mode's real representation (length :attr:`dim`, the order of :meth:`to_dense`);
    every method returns the kind it was given.

    Attributes:
        obar: :math:`\bar O`, shaped like the representation of ``params`` (complex where O is).
        diag_scale: :math:`\epsilon_1` (a 0-d leaf), or None.
        diag_s: :math:`\operatorname{diag} S` without shifts, shaped like the representation of
            ``params``, or None (without ``diag_scale``).
    """

    _shifts = ("diag_shift", "diag_scale")

    obar: Any
    diag_scale: jax.Array | None
    diag_s: Any

    # --- shapes --------------------------------------------------------------------------------

    @property
    def views(self) -> Views:
        """The vector kinds this operator takes (:class:`vmcgrad._sr.qgt.views.Views`)."""
        return Views(self.params, self.mode)

    @property
    def dim(self) -> int:
        """D, the size of the matrix: P, plus the number of complex entries in 'complex' mode."""
        return self.views.dim

    # --- public API ----------------------------------------------------------------------------

    def __matmul__(self, v: Any) -> Any:
        r""":math:`S v + \epsilon_1 \operatorname{diag}(S) v + \epsilon_2 v`, one pass over the samples.

        Args:
            v: a pytree like ``params`` (same shapes and dtypes), a flat vector
                ``ravel_pytree(v)[0]``, or a flat real representation of length :attr:`dim`.

        Returns:
            The product, of the same kind as ``v``.
        """
        v, kind = self.views.kind(f"{self._builder} (v)", "v", v)
        op = self._for_product()
        return call(matmul_program, op.problem, op, v, kind)

    def to_dense(self) -> jax.Array:
        """The ``(dim, dim)`` matrix, in the mode's representation (equal to NetKet's
        ``QGTJacobianDense(...).to_dense()``); one pass over the samples, holding a chunk's Jacobian."""
        return call(_dense_program, self.problem, self)

    def diagonal(self) -> jax.Array:
        r"""The diagonal of :meth:`to_dense`, :math:`(1 + \epsilon_1) S_{kk} + \epsilon_2`, a flat
        ``(dim,)`` vector (without building the matrix)."""
        return call(_diagonal_program, self.problem, self)

    def solve(
        self,
        b: Any,
        *,
        x0: Any = None,
        tol: float = 1e-5,
        atol: float = 0.0,
        maxiter: int | None = None,
    ) -> tuple[Any, CGInfo]:
        r"""Solves :math:`S_\text{eff}\, x = b` by conjugate gradient (one product per iteration).

        With ``diag_scale`` set, CG is preconditioned by Jacobi, :math:`M = D^{-1}`,
        :math:`D = \epsilon_1 \operatorname{diag}(S) + \epsilon_2` (NetKet's rescaling of the system
        by :math:`D^{-1/2}`, which gives the same iterates in exact arithmetic); the tolerances and
        ``info`` refer to the original system :math:`S_\text{eff}\, x = b`. The solution is
        differentiable implicitly in ``b`` (``jax.lax.custom_linear_solve``), not through the
        iterations.

        To keep every chunk's linearisation for the whole solve (no forward pass per iteration),
        solve with ``S.linearize().solve(b)`` (:class:`vmcgrad.LinearizedQGT`); an operator built
        with ``chunk_size="auto"`` does so itself where the budget holds them
        (:attr:`vmcgrad.QGTOperator.kept_solve`); its derivatives still go through the recomputing
        product (only the solution is differentiated, not the iterations).

        Args:
            b: right-hand side, a vector of any kind :meth:`__matmul__` takes.
            x0: initial guess of the same kind, or None for zeros.
            tol, atol: stop when :math:`\lVert r\rVert \le \max(\mathrm{tol}\lVert b\rVert,
                \mathrm{atol})` (``jax.scipy.sparse.linalg.cg``'s rule and defaults).
            maxiter: iteration cap, an int >= 0; None means ``10 * dim``.

        Returns:
            ``(x, info)``: ``x`` of the kind of ``b``, ``info`` a :class:`~vmcgrad.CGInfo`;
            ``info.converged`` is true only if the returned ``x`` meets the tolerance on the true
            residual :math:`\lVert S_\text{eff} x - b\rVert` (one more product after the loop).

        Raises:
            TypeError, ValueError: for bad vectors, tolerances or ``maxiter``, before anything is
                traced.
        """
        return solve(self, b, x0=x0, tol=tol, atol=atol, maxiter=maxiter)

    def replace(self, **changes: Any) -> AbstractQGT:
        """A copy with new ``diag_shift`` and/or ``diag_scale`` (computing diag(S) if needed; kept
        linearisations stay valid, as they do not depend on the shifts)."""
        new = super().replace(**changes)
        if new.diag_scale is not None and new.diag_s is None:
            new = dataclasses.replace(new, diag_s=call(diag_s_program, new.problem, new))
        return new

    # --- traced pieces -------------------------------------------------------------------------

    def _for_product(self) -> AbstractQGT:
        """The operator a product ``self @ v`` runs (itself; see
        :meth:`vmcgrad.QGTOperator._for_product` for the exception)."""
        return self

    @abc.abstractmethod
    def _apply_rep(self, rep: Any) -> Any:
        """:math:`S_\\text{eff} \\tilde v` for a representation pytree: one pass, one reduction (the
        interface of :mod:`vmcgrad._sr.qgt.apply`)."""

    @property
    def kept_solve(self) -> int | None:
        """The chunk at which :meth:`solve` first keeps every chunk's linearisation, or None (see
        :attr:`vmcgrad.QGTOperator.kept_solve`; None here: this operator's solves iterate with its
        own products)."""
        return None

    @property
    def _real_dtype(self) -> Any:
        return self.views.real_dtype

    def _sizing_call(self) -> tuple:
        return matmul_program, self.problem, self, self.params, "tree"

    def _check_shift(self, where: str, name: str, value: Any) -> Any:
        if name == "diag_scale":
            return diag_scale_leaf(where, value, self._real_dtype)
        return super()._check_shift(where, name, value)

    def _rep_layout(self) -> tuple:
        return self.views.rep_layout(self.problem.layout)

    def _rep_like(self) -> Any:
        return jax.eval_shape(partial(to_rep, self.mode), self.params)

    def _finish(self, total: Any, v: Any, *, scaled: bool = False) -> Any:
        """From the reduced :math:`\\sum_i \\overline{O_i} w_i` to :math:`S_\\text{eff} v` (``scaled``:
        the :math:`w_i` already carry the :math:`1/N`, applied to the :math:`N` rows rather than
        to the :math:`P` sums)."""
        inv_n = 1.0 / self.problem.n

        def finish(t, x, d=None):
            y = (jnp.conj(t) if scaled else jnp.conj(t) * inv_n) + self.diag_shift * x
            if d is not None:
                y = y + self.diag_scale * d * x
            return y.astype(x.dtype)

        if self.diag_scale is None:
            return jax.tree.map(finish, total, v)
        return jax.tree.map(finish, total, v, self.diag_s)

    def _jacobian_stats(self, *, dense: bool) -> jax.Array:
        chunk = partial(jacobian_chunk, mode=self.mode, out_dtype=self.problem.out_dtype, dense=dense)
        total, _ = map_reduce_problem(self.problem, self.inputs, chunk, (self.obar, self._rep_layout()))
        return total / self.problem.n


def diag_scale_leaf(where: str, x: Any, real_dtype: Any) -> jax.Array | None:
    """``diag_scale``: None, or a shift; a concrete 0 means no scaling, the same as None."""
    if x is None:
        return None
    x = check.check_nonnegative_scalar(where, "diag_scale", x, real_dtype)
    return None if not isinstance(x, jax.core.Tracer) and float(x) == 0 else x


# --- compiled programs: program(problem, op, ...) with the problem static (see _problem.call) ----


@partial(jax.jit, static_argnums=0)
def diag_s_program(prob: Problem, op: AbstractQGT) -> Any:
    """diag(S) as a real pytree shaped like the representation of the parameters."""
    flat = op._at(prob)._jacobian_stats(dense=False)
    return _unflatten_like(flat, to_rep(op.mode, op.params))


@partial(jax.jit, static_argnums=0)
def _diagonal_program(prob: Problem, op: AbstractQGT) -> jax.Array:
    op = op._at(prob)
    diag_s = op.diag_s if op.diag_s is not None else diag_s_program(prob, op)
    flat = ravel_pytree(diag_s)[0]
    scale = 1.0 if op.diag_scale is None else 1.0 + op.diag_scale
    return (scale * flat + op.diag_shift).astype(op.views.rep_dtype)


@partial(jax.jit, static_argnums=0)
def _dense_program(prob: Problem, op: AbstractQGT) -> jax.Array:
    op = op._at(prob)
    s = op._jacobian_stats(dense=True)
    diag = jnp.full((op.dim,), op.diag_shift)
    if op.diag_scale is not None:
        diag = diag + op.diag_scale * ravel_pytree(op.diag_s)[0]
    return (s + jnp.diag(diag)).astype(op.views.rep_dtype)


def _unflatten_like(flat: jax.Array, tree: Any) -> Any:
    """Splits ``flat`` into leaves shaped like ``tree``'s, keeping ``flat``'s dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    parts, start = [], 0
    for x in leaves:
        parts.append(flat[start : start + x.size].reshape(x.shape))
        start += x.size
    return treedef.unflatten(parts)
