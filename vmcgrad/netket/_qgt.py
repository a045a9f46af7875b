"""``QGTOnTheFly``: a NetKet ``LinearOperator`` backed by :func:`vmcgrad.QGT`, for ``nk.optimizer.SR``."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import netket as nk
from flax import struct
from jax.custom_derivatives import linear_call
from jax.flatten_util import ravel_pytree
from netket import jax as nkjax
from netket.errors import HolomorphicUndeclaredWarning
from netket.optimizer import LinearOperator
from netket.optimizer.linear_operator import SolverT, Uninitialized
from netket.optimizer.qgt.common import check_valid_vector_type
from netket.utils.api_utils import partial_from_kwargs

import vmcgrad

from .. import _validation as check
from .._qgt_modes import from_rep, to_rep
from ._expect_grad import log_psi

NAME = "vmcgrad.netket.QGTOnTheFly"


@partial_from_kwargs
def QGTOnTheFly(
    vstate: Any = None,
    *,
    chunk_size: int | None = None,
    diag_shift: float = 0.0,
    diag_scale: float | None = None,
    holomorphic: bool | None = None,
) -> QGTOnTheFlyT:
    r"""The quantum geometric tensor of ``vstate`` as a NetKet linear operator, computed by vmcgrad.

    .. math::

        S_\text{eff} = S + \epsilon_1 \operatorname{diag}(S) + \epsilon_2 \mathbb 1, \qquad
        S = \frac1N \Delta O^\dagger \Delta O, \quad \Delta O_i = O_i - \bar O

    with :math:`\epsilon_2` = ``diag_shift`` and :math:`\epsilon_1` = ``diag_scale`` (NetKet's
    QGTJacobian regularisation), in NetKet's mode: the real part of :math:`S` for real parameters
    ('real'), real and imaginary parts as separate real parameters for complex ones ('complex'),
    or :math:`S` itself with ``holomorphic=True``. Each product :math:`S v` is one chunked pass
    over ``vstate.samples`` with one reduction (:func:`vmcgrad.QGT`); no divisibility requirement.

    Called with keyword arguments only, it returns a partial, as NetKet's ``QGTOnTheFly`` does::

        sr = nk.optimizer.SR(qgt=vmcgrad.netket.QGTOnTheFly(chunk_size=256), diag_shift=0.01)

    It works with NetKet's iterative (``cg``, ``gmres``) and dense (``cholesky``, ``svd``,
    ``pinv_smooth``, ...) solvers; ``to_dense()`` equals ``QGTJacobianDense``'s in the same mode.

    Args:
        vstate: an ``nk.vqs.MCState`` (its samples, parameters and model state are used).
        chunk_size: samples per chunk on each device; None takes ``vstate.vmcgrad_chunk_size``
            (a :class:`vmcgrad.netket.MCState`), else ``vstate.chunk_size``.
        diag_shift: :math:`\epsilon_2`.
        diag_scale: :math:`\epsilon_1`, or None.
        holomorphic: whether the model is holomorphic in its complex parameters.

    Returns:
        A :class:`QGTOnTheFlyT`.
    """
    if not isinstance(vstate, nk.vqs.MCState):
        raise TypeError(
            f"{NAME}: `vstate` must be a netket.vqs.MCState; got {type(vstate).__name__}. "
            "Fix: use NetKet's QGT types for other variational states."
        )
    chunk_size = check.check_chunk_size(NAME, chunk_size)
    if chunk_size is None:
        chunk_size = getattr(vstate, "vmcgrad_chunk_size", None) or vstate.chunk_size
    params = vstate.parameters
    if holomorphic is None and nkjax.tree_leaf_iscomplex(params):
        warnings.warn(HolomorphicUndeclaredWarning(), UserWarning, stacklevel=2)
    qgt = vmcgrad.QGT(
        log_psi(vstate._apply_fun, vstate.model_state),
        params,
        _flat_samples(vstate.samples),
        chunk_size=chunk_size,
        diag_shift=diag_shift,
        diag_scale=diag_scale,
        holomorphic=holomorphic,
    )
    return QGTOnTheFlyT(diag_shift=diag_shift, qgt=qgt)


@jax.jit
def _flat_samples(samples: jax.Array) -> jax.Array:
    return samples.reshape(-1, samples.shape[-1])


@struct.dataclass
class QGTOnTheFlyT(LinearOperator):
    """NetKet ``LinearOperator`` wrapping a :class:`vmcgrad.QGTOperator`.

    ``diag_shift`` (NetKet's field, changed by ``+`` and ``replace``) is the one in force: it is
    passed to the wrapped operator at every use.
    """

    qgt: Any = Uninitialized
    """The :class:`vmcgrad.QGTOperator` (a pytree)."""

    _in_solve: bool = struct.field(pytree_node=False, default=False)
    """Set on the copy handed to the solver: products are then ref-free (see :func:`_pure_matmul`)."""

    @property
    def mode(self) -> str:
        """'real', 'complex' or 'holomorphic', as NetKet's QGT modes."""
        return self.qgt.mode

    def _op(self) -> Any:
        return self.qgt.replace(diag_shift=self.diag_shift)

    def __matmul__(self, vec: Any) -> Any:
        return _matmul(self, vec)

    def _solve(self, solve_fun: SolverT, y: Any, *, x0: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        return _solve(self, solve_fun, y, x0=x0)

    def to_dense(self) -> jax.Array:
        """The dense matrix, as ``QGTJacobianDense(...).to_dense()`` in the same mode."""
        return _to_dense(self)

    def diagonal(self) -> jax.Array:
        """The diagonal of :meth:`to_dense`, without building the matrix."""
        return self._op().diagonal()

    def __repr__(self) -> str:
        return f"vmcgrad.netket.QGTOnTheFly(diag_shift={self.diag_shift}, mode={self.mode!r})"


@jax.jit
def _matmul(self: QGTOnTheFlyT, vec: Any) -> Any:
    params = self.qgt.params
    if not hasattr(vec, "ndim"):
        check_valid_vector_type(params, vec)
        vec = nkjax.tree_cast(vec, params)
    if self._in_solve:
        return _pure_matmul(self._op(), vec)
    return self._op() @ vec


def _pure_matmul(op: Any, vec: Any) -> Any:
    r"""``op @ vec`` for NetKet's iterative solvers: ref-free, with a declared transpose.

    vmcgrad's products accumulate into ``jax.new_ref`` refs; on jax 0.10.2 the solvers built on
    ``lax.custom_linear_solve`` (``jax.scipy.sparse.linalg.cg``, ``gmres``) cannot hold a function
    with ref effects ("No state discharge rule implemented for primitive: custom_linear_solve").
    Discharging the product's jaxpr (refs become scan carries: the same program for XLA) gives a
    pure function. ``gmres`` also transposes the operator, which cannot go through the chunk loop;
    as NetKet's QGTOnTheFly does, the transpose is declared with ``linear_call``: :math:`S` is
    Hermitian, so :math:`S^T v = \overline{S \bar v}` (just :math:`S v` when :math:`S` is real).
    """

    def apply(op, v):
        closed, out_shape = jax.make_jaxpr(lambda op, v: op @ v, return_shape=True)(op, v)
        from .._jax_private import discharge_state

        pure = discharge_state()(closed)
        out = jax.core.eval_jaxpr(pure.jaxpr, pure.consts, *jax.tree.leaves((op, v)))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    def transpose(op, ct):
        return jax.tree.map(jnp.conj, apply(op, jax.tree.map(jnp.conj, ct)))

    return linear_call(apply, transpose, op, vec)


@jax.jit
def _to_dense(self: QGTOnTheFlyT) -> jax.Array:
    return self._op().to_dense()


@jax.jit
def _solve(self: QGTOnTheFlyT, solve_fun: Any, y: Any, *, x0: Any) -> tuple[Any, Any]:
    """Solves in the flat representation of the mode (as QGTJacobianDense does), so that iterative
    solvers see ``self @ flat`` and dense solvers see ``to_dense()`` in the same basis."""
    params = self.qgt.params
    if not hasattr(y, "ndim"):
        check_valid_vector_type(params, y)
    y_rep, back = _to_rep_flat(self, y)
    x0_rep = None if x0 is None else _to_rep_flat(self, x0)[0]
    if x0_rep is None:
        x0_rep = jax.numpy.zeros_like(y_rep)
    x_rep, info = solve_fun(self.replace(_in_solve=True), y_rep, x0=x0_rep)
    return back(x_rep), info


def _to_rep_flat(self: QGTOnTheFlyT, v: Any) -> tuple[jax.Array, Any]:
    """``v`` (a params-like pytree, or its ravel) as a flat vector of the mode's representation."""
    params, mode = self.qgt.params, self.qgt.mode
    _, unravel_params = ravel_pytree(params)
    was_flat = hasattr(v, "ndim")
    tree = unravel_params(v) if was_flat else nkjax.tree_cast(v, params)
    flat, unravel_rep = ravel_pytree(to_rep(mode, tree))

    def back(x):
        out = from_rep(mode, unravel_rep(x))
        return ravel_pytree(out)[0] if was_flat else out

    return flat, back
