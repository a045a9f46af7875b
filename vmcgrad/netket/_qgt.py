r"""``QGTOnTheFly``: a NetKet ``LinearOperator`` backed by :func:`vmcgrad.QGT`, for SR and TDVP.

The operator is

.. math::

    S_\text{eff} = S + \epsilon_1 \operatorname{diag}(S) + \operatorname{diag}(\epsilon_2), \qquad
    S = \frac1N \Delta O^\dagger \Delta O, \quad \Delta O_i = O_i - \bar O ,

with :math:`\epsilon_1` = ``diag_scale`` (a scalar) and :math:`\epsilon_2` = ``diag_shift``, a scalar
or, as NetKet's ``QGTOnTheFly`` allows, one shift per parameter (a pytree like the parameters).
:math:`S` (and :math:`\epsilon_1`) live in the wrapped :class:`vmcgrad.QGTOperator`; the shift is
added here, so that ``+``, ``replace(diag_shift=...)`` and a pytree shift need no new operator.

How NetKet's solvers are fed: every product ``S @ v`` (what ``jax.scipy.sparse.linalg.cg`` and
``gmres`` call, through ``lax.custom_linear_solve``) is one ``jax.custom_derivatives.linear_call``
whose callee is vmcgrad's chunked product and whose transpose is declared as
:math:`S^T v = \overline{S_\text{eff} \bar v}` (:math:`S_\text{eff}` is Hermitian, or real
symmetric), so a transpose is one more product by definition. The solvers do not need it:
``jax.scipy``'s ``cg`` and ``gmres``, and ``jax.linear_transpose``, work on the plain
:class:`vmcgrad.QGTOperator` product too (real and complex, jitted; checked with jax 0.10.2), so the
``linear_call`` is a declaration, not a workaround. No private JAX API and no mode flag: ``@`` is
the same operation everywhere (solvers, ``error_norm="qgt"``, user code). Dense solvers
(``cholesky``, ``LU``, ``solve``, ``svd``, ``pinv``, ``pinv_smooth``) call :meth:`to_dense`.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import netket as nk
import numpy as np
from flax import struct
from jax.flatten_util import ravel_pytree
from netket import jax as nkjax
from netket.errors import HolomorphicUndeclaredWarning, IllegalHolomorphicDeclarationForRealParametersError
from netket.optimizer import LinearOperator
from netket.optimizer.linear_operator import SolverT, Uninitialized
from netket.optimizer.qgt.common import check_valid_vector_type
from netket.utils import HashablePartial
from netket.utils.api_utils import partial_from_kwargs

import vmcgrad
from vmcgrad._checks.holomorphy import holomorphic_violation
from vmcgrad._jax_private import linear_call
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import call
from vmcgrad._sr.modes import to_rep
from vmcgrad._sr.qgt.qgt import DESIGNS
from vmcgrad._sr.qgt.views import Views
from vmcgrad._warnings import VmcgradWarning

from . import _nk_private as nkp
from ._expect_grad import log_psi

NAME = "vmcgrad.netket.QGTOnTheFly"


@partial_from_kwargs
def QGTOnTheFly(
    vstate: Any = None,
    *,
    chunk_size: int | None = None,
    diag_shift: Any = 0.0,
    diag_scale: float | None = None,
    holomorphic: bool | None = None,
    mode: str | None = None,
    design: str | None = None,
    memory_budget: float | None = None,
) -> QGTOnTheFlyT:
    r"""The quantum geometric tensor of ``vstate`` as a NetKet linear operator, computed by vmcgrad.

    .. math::

        S_\text{eff} = S + \epsilon_1 \operatorname{diag}(S) + \operatorname{diag}(\epsilon_2),
        \qquad S = \frac1N \Delta O^\dagger \Delta O, \quad \Delta O_i = O_i - \bar O

    with :math:`\epsilon_2` = ``diag_shift`` and :math:`\epsilon_1` = ``diag_scale`` (NetKet's
    QGTJacobian regularisation, which NetKet's own ``QGTOnTheFly`` lacks), in NetKet's mode: the
    real part of :math:`S` for real parameters ('real'), real and imaginary parts as separate real
    parameters for complex ones ('complex'), or :math:`S` itself with ``holomorphic=True``. Each
    product :math:`S v` is one chunked pass over ``vstate.samples`` with one reduction
    (:func:`vmcgrad.QGT`); the chunk size need not divide anything.

    Called with keyword arguments only, it returns a partial, as NetKet's ``QGTOnTheFly`` does::

        sr = nk.optimizer.SR(qgt=vmcgrad.netket.QGTOnTheFly(chunk_size=256), diag_shift=0.01)
        te = nkx.driver.TDVP(H, vstate, integrator, qgt=vmcgrad.netket.QGTOnTheFly(diag_shift=1e-4))

    It works with NetKet's iterative (``jax.scipy.sparse.linalg.cg``, ``gmres``) and dense
    (``nk.optimizer.solver.cholesky``, ``LU``, ``solve``, ``svd``, ``pinv``, ``pinv_smooth``)
    solvers; ``to_dense()`` equals ``QGTJacobianDense(...).to_dense()`` in the same mode (also in
    'complex' mode, where NetKet's ``QGTOnTheFly`` refuses).

    Args:
        vstate: an ``nk.vqs.MCState`` (its samples, parameters and model state are used).
        chunk_size: samples per chunk on each device; None takes ``vstate.vmcgrad_chunk_size``
            (a :class:`vmcgrad.netket.MCState`), else ``vstate.chunk_size``.
        diag_shift: :math:`\epsilon_2 \ge 0`: a real scalar, or a pytree like the parameters
            (one non-negative real shift per parameter; complex leaves must have zero imaginary
            part). None means 0, as in NetKet.
        diag_scale: :math:`\epsilon_1 \ge 0`, or None.
        holomorphic: whether the model is holomorphic in its complex parameters. As for NetKet's
            ``QGTOnTheFly``, ``holomorphic=True`` on a model that is not (checked as
            :func:`vmcgrad.QGT` checks it) applies the 'complex' matrix, whose products and solves
            are the ones NetKet's ``QGTOnTheFly(holomorphic=True)`` gives; a UserWarning says so.
            The model's rows must depend on their own sample only (see :func:`vmcgrad.QGT`).
        mode: 'real', 'complex' or 'holomorphic', as NetKet's ``QGTJacobianDense(mode=...)``
            ('real' takes :math:`\operatorname{Re}\log\psi`, as NetKet's does), or None (or
            'auto') to choose from ``holomorphic`` and the parameter dtypes as NetKet does;
            exclusive with ``holomorphic``. See :func:`vmcgrad.QGT`.
        design: how each chunk's product is computed, as for :func:`vmcgrad.QGT`: ``"fused"``
            (one linearisation per chunk), ``"jvp_vjp"`` (a jvp, then the pullback of a second
            forward pass: fewer bytes per row, one more pass), ``"two_loop"`` (NetKet's: a loop of
            jvps, their centring, a loop of pullbacks), or None: at ``chunk_size="auto"``
            the (design, chunk) pair that is fastest within ``memory_budget``
            (:func:`vmcgrad._sr.qgt.qgt.choose_design`), else ``"fused"``. All give the same matrix; the
            operator's ``qgt.design`` says which one it uses.
        memory_budget: bytes per device for ``chunk_size="auto"`` (compiled ``memory_analysis()``
            of one product), or None: ``vstate.vmcgrad_memory_budget`` on a
            :class:`vmcgrad.netket.MCState`, else :func:`vmcgrad.auto_chunk_size`'s default.
            Unused with an integer ``chunk_size``.

    Returns:
        A :class:`QGTOnTheFlyT`.

    Raises:
        TypeError: ``vstate`` is not an ``MCState``; a shift of the wrong kind.
        ValueError: a negative, NaN or infinite shift or scale; a bad ``chunk_size``, ``design``
            or ``memory_budget`` (a TypeError for a budget that is not a number).
        netket.errors.IllegalHolomorphicDeclarationForRealParametersError: ``holomorphic=True``
            with real parameters (as NetKet).
    """
    chunk_size, memory_budget, mode, diag_shift = _checked(
        vstate, chunk_size, diag_shift, diag_scale, holomorphic, mode, design, memory_budget
    )
    params = vstate.parameters
    if mode is None and holomorphic is None and nkjax.tree_leaf_iscomplex(params):
        warnings.warn(HolomorphicUndeclaredWarning(), UserWarning, stacklevel=3)  # past the wrapper too
    apply_fun = nkp.apply_fun(vstate)
    if mode == "real":  # NetKet's QGTJacobian mode='real' takes Re log psi (drops Im of a complex output)
        apply_fun = HashablePartial(_real_apply, apply_fun)  # equal across calls: compiled once
    logpsi, samples = log_psi(apply_fun, vstate.model_state), _flat_samples(vstate.samples)
    if holomorphic and not _holomorphic_as_declared(logpsi, params, samples):
        holomorphic = False
    qgt = vmcgrad.QGT(
        logpsi,
        params,
        samples,
        chunk_size=chunk_size,
        diag_shift=0.0,  # the shift is added by QGTOnTheFlyT (scalar or per parameter)
        diag_scale=diag_scale,
        mode=mode,
        holomorphic=holomorphic,
        design=design,
        memory_budget=memory_budget,
    )
    return QGTOnTheFlyT(diag_shift=diag_shift, qgt=qgt)


def _checked(
    vstate: Any,
    chunk_size: Any,
    diag_shift: Any,
    diag_scale: Any,
    holomorphic: Any,
    mode: Any,
    design: Any,
    memory_budget: Any,
) -> tuple[Any, Any, str | None, Any]:
    """:func:`QGTOnTheFly`'s arguments checked before anything is traced, and resolved: ``(chunk_size,
    memory_budget, mode, diag_shift)``, the first two from the state where not given, NetKet's mode
    'auto' as None."""
    if not isinstance(vstate, nkp.NetKetMCState):
        raise TypeError(
            f"{NAME}: `vstate` must be a netket.vqs.MCState; got {type(vstate).__name__}. "
            "Fix: use NetKet's QGT types for other variational states."
        )
    chunk_size = check.check_chunk_size(NAME, chunk_size)
    if chunk_size is None:
        chunk_size = getattr(vstate, "vmcgrad_chunk_size", None) or vstate.chunk_size
    check.check_design(NAME, design, DESIGNS)
    memory_budget = check.check_memory_budget(NAME, memory_budget)
    if memory_budget is None:
        memory_budget = getattr(vstate, "vmcgrad_memory_budget", None)
    params = vstate.parameters
    if holomorphic is not None and not isinstance(holomorphic, bool):
        raise TypeError(
            f"{NAME}: `holomorphic` must be True, False or None; got {check.describe(holomorphic)}. "
            "Fix: pass holomorphic=True for a holomorphic model of complex parameters."
        )
    if holomorphic and nkjax.tree_leaf_isreal(params):
        raise IllegalHolomorphicDeclarationForRealParametersError()
    diag_shift = check.check_diag_shift(NAME, diag_shift, params)
    if diag_scale is not None:
        check.check_nonnegative_scalar(NAME, "diag_scale", diag_scale)
    return chunk_size, memory_budget, None if mode == "auto" else mode, diag_shift


def _holomorphic_as_declared(logpsi: Any, params: Any, samples: Any) -> bool:
    """Whether a model declared holomorphic is (:func:`vmcgrad._checks.holomorphy.holomorphic_violation`);
    if not, a warning at :func:`QGTOnTheFly`'s caller says the 'complex' matrix is used instead."""
    why = holomorphic_violation(logpsi, params, samples)
    if why is None:
        return True
    # NetKet's QGTOnTheFly(holomorphic=True) applies the 'complex' matrix here (its products and
    # iterative solves are exact whatever the declaration); so does this adapter
    warnings.warn(
        f"{NAME}: holomorphic=True, but the model is not holomorphic in its parameters: "
        f"{why}. Using mode='complex' (real and imaginary parts as separate real parameters), "
        "whose products and solves equal those of NetKet's QGTOnTheFly(holomorphic=True) on "
        "this model; to_dense() is then the (2P x 2P)-like real matrix of that mode. "
        "Fix: pass holomorphic=False to silence this warning.",
        VmcgradWarning,
        stacklevel=4,  # past this function, QGTOnTheFly and NetKet's partial_from_kwargs wrapper
    )
    return False


def _real_apply(apply_fun: Any, variables: Any, x: jax.Array) -> jax.Array:
    return jnp.real(apply_fun(variables, x))


@jax.jit
def _flat_samples(samples: jax.Array) -> jax.Array:
    return samples.reshape(-1, samples.shape[-1])


@struct.dataclass
class QGTOnTheFlyT(LinearOperator):
    """NetKet ``LinearOperator`` wrapping a :class:`vmcgrad.QGTOperator` (built with no shift).

    ``diag_shift`` (NetKet's field, changed by ``+`` and ``replace``; a scalar or a pytree like the
    parameters) is added to the wrapped operator at every use. Concrete shifts are checked
    whenever the operator is built or replaced (negative, NaN or infinite values are refused);
    shifts traced inside ``jax.jit`` cannot be checked.
    """

    qgt: Any = Uninitialized
    """The :class:`vmcgrad.QGTOperator` (a pytree): :math:`S + \\epsilon_1 \\operatorname{diag}(S)`."""

    def __post_init__(self):
        if isinstance(self.qgt, vmcgrad.QGTOperator) and _is_concrete(self.qgt.params):
            check.check_diag_shift(f"{NAME} (diag_shift)", self.diag_shift, self.qgt.params)

    @property
    def mode(self) -> str:
        """'real', 'complex' or 'holomorphic', as NetKet's QGT modes."""
        return self.qgt.mode

    def __add__(self, eps: Any) -> QGTOnTheFlyT:
        """A copy with ``eps`` added to the shift (to every entry of a per-parameter shift)."""
        return self.replace(diag_shift=jax.tree.map(lambda d: d + eps, self.diag_shift))

    def __matmul__(self, vec: Any) -> Any:
        return _matmul(self, vec)

    def _solve(self, solve_fun: SolverT, y: Any, *, x0: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        return _solve(self, solve_fun, y, x0=x0)

    def to_dense(self) -> jax.Array:
        """The dense matrix, as ``QGTJacobianDense(...).to_dense()`` in the same mode."""
        return _to_dense(self)

    def diagonal(self) -> jax.Array:
        """The diagonal of :meth:`to_dense`, without building the matrix."""
        return _diagonal(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(S)``: :meth:`to_dense` as a NumPy array (NetKet's returns a JAX array,
        which NumPy refuses)."""
        return np.asarray(self.to_dense(), dtype=dtype)

    def __repr__(self) -> str:
        shift = self.diag_shift if _is_scalar(self.diag_shift) else "<per parameter>"
        return f"vmcgrad.netket.QGTOnTheFly(diag_shift={shift}, mode={self.mode!r})"


# --- input checks (eager) ------------------------------------------------------------------------


def _is_scalar(x: Any) -> bool:
    if isinstance(x, (dict, list, tuple)):
        return False
    return np.ndim(x) == 0 and jax.tree.structure(x).num_leaves == 1


def _is_concrete(tree: Any) -> bool:
    """Whether every leaf is a value (not a tracer, nor a placeholder JAX puts in while unflattening)."""
    ok = (int, float, complex, np.ndarray, np.generic, jax.Array)
    return all(isinstance(x, ok) and not isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


# --- vectors: one function from any kind NetKet passes to the flat representation ---------------


def _as_rep_flat(params: Any, mode: str, v: Any) -> tuple[jax.Array, Any]:
    """``v`` as a flat vector of the mode's representation, and the map back to ``v``'s kind.

    The kind is the core's guess (:meth:`vmcgrad._sr.qgt.views.Views.guess`: a pytree like ``params``,
    then a flat vector of the representation, of length :math:`D` (the basis of
    :meth:`QGTOnTheFlyT.to_dense`; what the solvers are handed), then a flat vector in
    ``ravel_pytree(params)`` order); the dtype is then cast as NetKet casts, and a complex vector on
    real parameters raises NetKet's ``RealQGTComplexDomainError``.
    """
    views = Views(params, mode)  # the core's one guess of, and conversion between, vector kinds
    kind = views.guess(v)
    if kind is None and not hasattr(v, "ndim"):
        check_valid_vector_type(params, v)  # NetKet's "PyTree mismatch" ValueError for other trees
        expected = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        raise ValueError(
            f"{NAME}: the vector's leaf shapes differ from the parameters' ({check.describe(expected)}). "
            "Fix: build it with jax.tree.map over vstate.parameters."
        )
    if kind is None:
        raise ValueError(
            f"{NAME}: a flat vector must have shape ({views.n_params},) (ravel_pytree of the parameters) "
            f"or ({views.dim},) (the real representation of mode {mode!r}); got an array of shape "
            f"{tuple(v.shape)}. Fix: pass a pytree like vstate.parameters, or ravel_pytree of one."
        )
    if kind == "rep":
        v = v.astype(views.rep_dtype)
    elif kind == "flat":
        if jnp.iscomplexobj(v) and not nkjax.tree_leaf_iscomplex(params):
            raise nk.errors.RealQGTComplexDomainError()
        v = v.astype(views.flat_dtype)
        check_valid_vector_type(params, ravel_pytree(params)[1](v))
    else:
        check_valid_vector_type(params, v)
        v = nkjax.tree_cast(v, params)
    flat = ravel_pytree(views.to_rep(v, kind))[0]

    def back(x):
        return views.from_rep(views.to_rep(x, "rep"), kind)

    return flat, back


def _for_solve(qgt: Any) -> Any:
    """The operator NetKet's solver iterates with (traced): ``qgt`` itself, or, where its
    ``kept_solve`` is set, ``qgt`` at that chunk with every chunk's linearisation kept
    (:class:`vmcgrad.LinearizedQGT`), as NetKet's unchunked ``QGTOnTheFly`` keeps its
    ``jax.linearize``: an iteration then runs no forward pass."""
    chunk = qgt.kept_solve
    if chunk is None:
        return qgt
    return qgt._at(qgt.problem.at_chunk(chunk)).linearize()


def _shift_rep(self: QGTOnTheFlyT) -> jax.Array:
    r"""The shift :math:`\epsilon_2` in the representation: a scalar, or a flat real ``(D,)`` vector
    (a complex parameter's shift applies to its real and imaginary parts alike)."""
    params, mode = self.qgt.params, self.qgt.mode
    real = self.qgt.views.real_dtype
    if jax.tree.structure(self.diag_shift) != jax.tree.structure(params):
        return jnp.real(jnp.asarray(self.diag_shift)).astype(real)
    both = jax.tree.map(
        lambda d, p: (jnp.real(d) * (1 + 1j)).astype(p.dtype) if jnp.iscomplexobj(p) else jnp.real(d),
        self.diag_shift,
        params,
    )
    return ravel_pytree(to_rep(mode, both))[0].real.astype(real)


# --- traced operations -------------------------------------------------------------------------


def _apply(self: QGTOnTheFlyT, rep: jax.Array) -> jax.Array:
    r""":math:`S_\text{eff} v` for a flat representation vector, as one ``linear_call`` (see the
    module docstring): the callee is vmcgrad's chunked product plus the shift, the declared
    transpose :math:`\overline{S_\text{eff} \bar v}`."""

    def product(res, x):
        qgt, shift = res
        return (qgt @ x + shift * x).astype(x.dtype)

    def transpose(res, ct):
        return jnp.conj(product(res, jnp.conj(ct)))

    return linear_call(product, transpose, (self.qgt, _shift_rep(self)), rep)


@jax.jit
def _matmul(self: QGTOnTheFlyT, vec: Any) -> Any:
    rep, back = _as_rep_flat(self.qgt.params, self.mode, vec)
    return back(_apply(self, rep))


@jax.jit
def _to_dense(self: QGTOnTheFlyT) -> jax.Array:
    dense = self.qgt.to_dense()
    return dense + jnp.diag(jnp.broadcast_to(_shift_rep(self), dense.shape[:1])).astype(dense.dtype)


@jax.jit
def _diagonal(self: QGTOnTheFlyT) -> jax.Array:
    diag = self.qgt.diagonal()
    return (diag + _shift_rep(self)).astype(diag.dtype)


@jax.jit
def _solve(self: QGTOnTheFlyT, solve_fun: Any, y: Any, *, x0: Any) -> tuple[Any, Any]:
    """Solves in the flat representation of the mode (as QGTJacobianDense does): iterative solvers
    see ``self @ flat`` and dense ones ``to_dense()``, in the same basis. ``info`` is the solver's
    own (None for ``jax.scipy``'s ``cg``/``gmres``, which report no convergence).

    With ``chunk_size="auto"`` the chunk is the solve's own (:func:`vmcgrad._problem.problem.call`:
    the largest power of two at which this whole program, the solver's vectors and its products
    included, fits the memory budget; compile only, cached), not the product's alone, which a solve
    of a small model exceeds by its vectors (a 1-D GCNN at 128 KiB: 160 against 125 KB, the
    product's chunk 8). Where the wrapped operator's ``kept_solve`` is set (the budget holds every
    chunk's linearisation at some chunk), the solver is handed the operator with its
    linearisations kept (:class:`vmcgrad.LinearizedQGT`), taken once here, at that chunk."""
    prob = self.qgt.problem
    if prob.chunk_size == "auto" and self.qgt.kept_solve is None:
        return call(_solve_program, prob, self, solve_fun, y, x0)
    return _solve_program(prob, self, solve_fun, y, x0)


@partial(jax.jit, static_argnums=0)
def _solve_program(prob: Any, self: QGTOnTheFlyT, solve_fun: Any, y: Any, x0: Any) -> tuple[Any, Any]:
    """:func:`_solve`'s program, the wrapped operator at ``prob`` (its chunk)."""
    self = self.replace(qgt=self.qgt._at(prob))
    params, mode = self.qgt.params, self.mode
    y_rep, back = _as_rep_flat(params, mode, y)
    x0_rep = jnp.zeros_like(y_rep) if x0 is None else _as_rep_flat(params, mode, x0)[0]
    # with every chunk's linearisation kept where the budget holds it (the operator's kept_solve, as
    # NetKet's unchunked QGTOnTheFly keeps its jax.linearize): then an iteration runs no forward pass
    kept = self.replace(qgt=_for_solve(self.qgt))
    x_rep, info = solve_fun(kept, y_rep, x0=x0_rep)
    return back(x_rep), info
