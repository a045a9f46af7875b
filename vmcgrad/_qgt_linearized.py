"""``LinearizedQGT``: a QGT whose chunks' linearisations are kept, so products need no forward pass.

``S.linearize()`` runs one pass over the samples that keeps, for every chunk on every device, the
residuals of ``jax.linearize`` of the log-amplitude (the forward activations its jvp needs). Every
product afterwards — each conjugate-gradient iteration of :meth:`LinearizedQGT.solve` — runs only the
chunk jvps and their transposes from those residuals: no forward recomputation, still one reduction
per product. The price is the residuals of all chunks at once (:attr:`LinearizedQGT.nbytes` per
device), where :class:`vmcgrad.QGTOperator` holds one chunk's at a time.

Both passes are the chunked primitive (:mod:`vmcgrad._chunked`): the linearising pass writes one
slot per chunk (a per-chunk output, nothing reduced), and a product reads chunk ``k``'s slot as a
per-chunk operand inside the one loop over the chunks. So the product is an ordinary operator
application to JAX: ``jax.vmap`` batches it, it is differentiable in its vector, and
``jax.scipy.sparse.linalg.cg`` or NetKet's solvers run on ``lambda v: L @ v``. Differentiating in
the kept linearisations (in the parameters through ``S.linearize()``) is refused by the primitive's
own rules, with or without ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import jax

from ._chunked import map_reduce, map_reduce_problem
from ._problem import Problem, call
from ._qgt_apply import matmul_program, solve
from ._qgt_passes import kept_product_chunk, linearize_chunk
from ._solve import CGInfo

if TYPE_CHECKING:  # annotations only: _qgt imports this module (in QGTOperator.linearize)
    from ._qgt import QGTOperator


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearizedQGT:
    """A :class:`vmcgrad.QGTOperator` with every chunk's linearisation kept (from ``S.linearize()``).

    Same products and solves as the operator it came from (same ``diag_shift``/``diag_scale``,
    vectors of the same kinds), without a forward pass per product. A pytree: pass it into
    ``jax.jit`` like the operator. ``jax.vmap`` over vectors, derivatives of a product or solve in
    its vector, and ``jax.scipy.sparse.linalg.cg(lambda v: L @ v, b)`` work; differentiating in the
    kept linearisations (through ``S.linearize()`` in the parameters) raises a TypeError.

    Attributes:
        op: the operator, at the chunk size the linearisations were kept at.
        linear_maps: every chunk's linear map (``jax.linearize``'s ``Partial``), its residual leaves
            stacked along a leading axis of every device's chunks (``devices * chunks``, split over
            the devices).
    """

    op: QGTOperator
    linear_maps: Any

    @property
    def operator(self) -> QGTOperator:
        """The operator whose products this computes."""
        return self.op

    @property
    def problem(self) -> Problem:
        return self.op.problem

    @property
    def dim(self) -> int:
        """D, the size of the matrix."""
        return self.op.dim

    @property
    def nbytes(self) -> int:
        """Bytes of kept residuals per device."""
        n_dev = 1 if self.problem.where is None else self.problem.where.size
        leaves = jax.tree.leaves(self.linear_maps)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) // n_dev

    def __matmul__(self, v: Any) -> Any:
        """:math:`S_\\text{eff} v` from the kept linearisations (as ``QGTOperator.__matmul__``)."""
        v, kind = self.op.views.kind("vmcgrad.LinearizedQGT (v)", "v", v)
        return call(matmul_program, self.problem, self, v, kind)

    def solve(
        self, b: Any, *, x0: Any = None, tol: float = 1e-5, atol: float = 0.0, maxiter: int | None = None
    ) -> tuple[Any, CGInfo]:
        """As :meth:`vmcgrad.QGTOperator.solve`, each iteration's product from the kept linearisations
        (differentiable implicitly in ``b``, as there)."""
        return solve(self, b, x0=x0, tol=tol, atol=atol, maxiter=maxiter)

    # --- traced pieces (the interface of vmcgrad._qgt_apply) -------------------

    def _at(self, prob: Problem) -> LinearizedQGT:
        return dataclasses.replace(self, op=self.op._at(prob))

    def _apply_rep(self, rep: Any) -> Any:
        op = self.op
        layout = op._rep_layout()
        # shapes and dtypes only: the body runs on one device's chunk, with no mesh
        theta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), op._rep_like())
        chunk = partial(kept_product_chunk, theta=theta)
        total, _ = map_reduce(
            op.problem.space,
            chunk,
            [(op.obar, layout), (rep, layout)],
            [],
            per_chunk=[self.linear_maps],
            sum_layout=layout,
        )
        return op._finish(total, rep)


def linearize(op: QGTOperator) -> LinearizedQGT:
    """``op.linearize()``: one pass keeping every chunk's linearisation.

    With ``chunk_size="auto"`` the chunk is fixed here (the product's automatic chunk), so that the
    products walk the chunks the linearisations were kept for.
    """
    if op.problem.chunk_size == "auto":
        op = op._at(op.problem.at_chunk(op.chunk_size))
    _, _, maps = call(_linearize_program, op.problem, op)
    return LinearizedQGT(op=op, linear_maps=maps)


@partial(jax.jit, static_argnums=0)
def _linearize_program(prob: Problem, op: QGTOperator) -> tuple[Any, Any, Any]:
    op = op._at(prob)
    return map_reduce_problem(prob, op.inputs, partial(linearize_chunk, mode=op.mode))
