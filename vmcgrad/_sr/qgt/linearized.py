"""``LinearizedQGT``: a QGT whose chunks' linearisations are kept, so products need no forward pass.

``S.linearize()`` runs one pass over the samples that keeps, for every chunk on every device, the
residuals of ``jax.linearize`` of the log-amplitude (the forward activations its jvp needs). Every
product afterwards — each conjugate-gradient iteration of :meth:`LinearizedQGT.solve` — runs only the
chunk jvps and their transposes from those residuals: no forward recomputation, still one reduction
per product. The price is the residuals of all chunks at once (:attr:`LinearizedQGT.nbytes` per
device), where :class:`vmcgrad.QGTOperator` holds one chunk's at a time.

Both passes are the chunked primitive (:mod:`vmcgrad._runner.primitive`): the linearising pass writes one
slot per chunk (a per-chunk output, nothing reduced), and a product reads chunk ``k``'s slot as a
per-chunk operand inside the one loop over the chunks. So the product is an ordinary operator
application to JAX: ``jax.vmap`` batches it, it is differentiable in its vector, and
``jax.scipy.sparse.linalg.cg`` runs on ``lambda v: L @ v``; NetKet's dense solvers
(``nk.optimizer.solver.cholesky(L, b)``, ...) take ``L`` itself, through
:meth:`LinearizedQGT.to_dense`. Differentiating in the kept linearisations (in the parameters
through ``S.linearize()``) is refused by the primitive's own rules, with or without ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax

from vmcgrad._runner.primitive import map_reduce
from vmcgrad._sr.qgt.abstract import AbstractQGT
from vmcgrad._sr.qgt.passes import kept_product_chunk

#: The TypeError of a derivative in the kept linearisations (the runner raises it, in these words).
KEPT_NOTE = (
    "vmcgrad.LinearizedQGT cannot be differentiated in its kept linearisations (jax.grad / jax.jvp / "
    "jax.jacfwd of S.linearize() in the parameters, or of a product or solve in the kept maps, with or "
    "without jax.jit): the kept linear maps are constants of one parameter point. Products and solves "
    "of a LinearizedQGT are differentiable in their vector, and jax.vmap works. Fix: differentiate the "
    "operator that recomputes the forward pass, vmcgrad.QGT(...) @ v or vmcgrad.QGT(...).solve(b) "
    "(every transformation works there), or wrap the parameters in jax.lax.stop_gradient. A solver "
    "handed the kept operator because the QGT's kept_solve is set (chunk_size='auto') meets the same "
    "limit: give the QGT an integer chunk_size to differentiate through that solver."
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class LinearizedQGT(AbstractQGT):
    """A QGT with every chunk's linearisation kept (from ``S.linearize()`` of a :class:`vmcgrad.QGTOperator`).

    The same matrix as the operator it came from (its leaves, shifts and chunk size), the same
    products, solves, ``to_dense``, ``diagonal`` and ``replace``
    (:class:`vmcgrad._sr.qgt.abstract.AbstractQGT`), taking the same kinds of vectors; each product
    reads the kept linearisations instead of running a forward pass. A pytree: pass it into
    ``jax.jit`` like the operator. ``jax.vmap`` over vectors, derivatives of a product or solve in its
    vector, and ``jax.scipy.sparse.linalg.cg(lambda v: L @ v, b)`` work; differentiating in the kept
    linearisations (through ``S.linearize()`` in the parameters) raises a TypeError.
    ``replace(diag_shift=...)`` keeps the linearisations, which do not depend on the shifts.

    Attributes:
        linear_maps: every chunk's linear map (``jax.linearize``'s ``Partial``), its residual leaves
            stacked along a leading axis of every device's chunks (``devices * chunks``, split over
            the devices).
    """

    _builder = "vmcgrad.QGT(...).linearize()"

    linear_maps: Any

    @property
    def nbytes(self) -> int:
        """Bytes of kept residuals per device."""
        n_dev = 1 if self.problem.where is None else self.problem.where.size
        leaves = jax.tree.leaves(self.linear_maps)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) // n_dev

    def _apply_rep(self, rep: Any) -> Any:
        """:math:`S_\\text{eff} \\tilde v` from the kept linearisations: one pass, one reduction."""
        layout = self._rep_layout()
        # shapes and dtypes only: the body runs on one device's chunk, with no mesh
        theta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._rep_like())
        chunk = partial(kept_product_chunk, theta=theta)
        total, _ = map_reduce(
            self.problem.space,
            chunk,
            [(self.obar, layout), (rep, layout)],
            [],
            per_chunk=[self.linear_maps],
            sum_layout=layout,
            kept_note=KEPT_NOTE,
        )
        return self._finish(total, rep)
