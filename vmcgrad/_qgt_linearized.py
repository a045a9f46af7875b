"""``LinearizedQGT``: a QGT whose chunks' linearisations are kept, so products need no forward pass.

``S.linearize()`` runs one pass over the samples that keeps, for every chunk on every device, the
residuals of ``jax.linearize`` of the log-amplitude (the forward activations its jvp needs). Every
product afterwards — each conjugate-gradient iteration of :meth:`LinearizedQGT.solve` — runs only the
chunk jvps and their transposes from those residuals: no forward recomputation, still one reduction
per product. The price is the residuals of all chunks at once (:attr:`LinearizedQGT.nbytes` per
device), where :class:`vmcgrad.QGTOperator` holds one chunk's at a time.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import TYPE_CHECKING, Any

import jax

from ._problem import Problem, call
from ._qgt_apply import matmul_program, solve
from ._qgt_passes import cached_product_body, linearize_body
from ._runner import PER_DEVICE, Laid, run
from ._solve import CGInfo

if TYPE_CHECKING:  # annotations only: _qgt imports this module (in QGTOperator.linearize)
    from ._qgt import QGTOperator


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearizedQGT:
    """A :class:`vmcgrad.QGTOperator` with every chunk's linearisation kept (from ``S.linearize()``).

    Same products and solves as the operator it came from (same ``diag_shift``/``diag_scale``,
    vectors of the same kinds), without a forward pass per product. A pytree: pass it into
    ``jax.jit`` like the operator.

    Attributes:
        op: the operator.
        linear_maps: every chunk's linear map (``jax.linearize``'s ``Partial``), its residual leaves
            stacked along a leading axis of chunks (each device's block).
        weights: the chunks' row weights, ``(chunks, chunk_size)`` per device.
    """

    op: QGTOperator
    linear_maps: Any
    weights: jax.Array

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
        leaves = jax.tree.leaves((self.linear_maps, self.weights))
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) // n_dev

    def __matmul__(self, v: Any) -> Any:
        """:math:`S_\\text{eff} v` from the kept linearisations (as ``QGTOperator.__matmul__``)."""
        v, kind = self.op.views.kind("vmcgrad.LinearizedQGT (v)", "v", v)
        _refuse_differentiation("vmcgrad.LinearizedQGT.__matmul__", self)
        return matmul_program(self.problem, self, v, kind)

    def solve(
        self, b: Any, *, x0: Any = None, tol: float = 1e-5, atol: float = 0.0, maxiter: int | None = None
    ) -> tuple[Any, CGInfo]:
        """As :meth:`vmcgrad.QGTOperator.solve`, each iteration's product from the kept linearisations."""
        _refuse_differentiation("vmcgrad.LinearizedQGT.solve", (self, b, x0))
        return solve(self, b, x0=x0, tol=tol, atol=atol, maxiter=maxiter)

    # --- traced pieces (the interface of vmcgrad._qgt_apply) -------------------

    def _at(self, prob: Problem) -> LinearizedQGT:
        return dataclasses.replace(self, op=self.op._at(prob))

    def _apply_rep(self, rep: Any) -> Any:
        op = self.op
        layout = op._rep_layout()
        body = partial(cached_product_body, mode=op.mode)
        total = run(
            op.problem,
            body,
            op.inputs,
            (op.obar, layout),
            (rep, layout),
            (self.linear_maps, PER_DEVICE),
            (self.weights, PER_DEVICE),
            out=Laid(op._rep_like(), layout),
        )
        return op._finish(total, rep)


def linearize(op: QGTOperator) -> LinearizedQGT:
    """``op.linearize()``: one pass keeping every chunk's linearisation."""
    maps, weights = call(_linearize_program, op.problem, op)
    return LinearizedQGT(op=op, linear_maps=maps, weights=weights)


@partial(jax.jit, static_argnums=0)
def _linearize_program(prob: Problem, op: QGTOperator) -> tuple[Any, jax.Array]:
    body = partial(linearize_body, mode=op.mode)
    return run(prob, body, op.inputs, out=PER_DEVICE)


_DIFFERENTIATING = ("JVPTracer", "LinearizeTracer")  # jax.jvp / jax.grad's tracers (jax 0.10.2)


def _refuse_differentiation(where: str, tree: Any) -> None:
    """Refuses differentiating through kept linearisations, before tracing.

    The kept linear maps are constants of one parameter point, and the CG loop carries refs, which
    JAX can batch but not differentiate. Differentiating a *product* in its vector is allowed (the
    product is linear in it; tested against ``QGT @ v``); this guards the parameters (the operator's
    leaves) and the solve.
    """
    if any(type(x).__name__ in _DIFFERENTIATING for x in jax.tree.leaves(tree)):
        raise TypeError(
            f"{where}: a vmcgrad.LinearizedQGT cannot be differentiated here (jax.grad / jax.jvp / "
            "jax.jacfwd through its kept linearisations or its solve): the kept linear maps are "
            "constants of one parameter point, and the solve's loop carries refs. Fix: differentiate "
            "the operator itself, vmcgrad.QGT(...) @ v or vmcgrad.QGT(...).solve(b) (every "
            "transformation works there; the forward pass is recomputed), or wrap the inputs in "
            "jax.lax.stop_gradient. jax.vmap works here."
        )
