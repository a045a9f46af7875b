r"""``NTK``: the centred neural-tangent kernel of sample-space SR (MinSR / SPRING) as a pytree operator.

With :math:`J` the per-sample Jacobian of the mode's output with respect to a real parametrisation
(NetKet's ``VMC_SR`` conventions, :func:`NTK`), :math:`\Delta J_i = J_i - \frac1N \sum_j J_j`,

.. math::

    T = \frac1N \Delta J \Delta J^\dagger + \lambda\, \mathbb 1 ,

an :math:`NK \times NK` matrix (K = 2 output components in 'complex' mode, 1 otherwise). Its
non-zero spectrum is that of the QGT :math:`S = \frac1N \Delta J^\dagger \Delta J`.

How it is computed, always through the one chunked primitive (:mod:`vmcgrad._runner.primitive`):

* :meth:`NTKOperator.to_dense`: block by block, each row chunk's Jacobian contracted with the column
  chunks' on and above the diagonal (:mod:`vmcgrad._sr.ntk.dense`).
* ``T @ v``: one vjp pass (:math:`g = \Delta J^\dagger v`, the pullback path of
  :func:`vmcgrad.batched_vjp`) and one jvp pass (:math:`\Delta J g`, that of
  :func:`vmcgrad.batched_jvp`); nothing of size N×N or N×P is stored.

The update of sample-space SR (:func:`vmcgrad.minsr_update`, :mod:`vmcgrad._sr.ntk.minsr`) maps the
solution back to parameter space with the same pullback as :func:`vmcgrad.batched_vjp`
(``vmcgrad._estimators.vjp.vjp_sum``).

**Complex conventions.** JAX's pullback of a function of complex parameters returns
:math:`\overline{J_\mathbb{R}^T \bar c}` packed as a complex number, so for every mode
:math:`\Delta J^\dagger x = \overline{\mathrm{vjp}(\bar x_c)}` with :math:`x_c` the vector packed as
:math:`x_{re} + i x_{im}` ('complex'), or itself ('real', 'holomorphic'); and the jvp with the packed
tangent is the directional derivative whose real and imaginary parts are the 'complex' rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._chunks.plan import cast_like
from vmcgrad._estimators.jvp import jvp_chunk
from vmcgrad._estimators.vjp import vjp_sum
from vmcgrad._function import join_fun
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Problem, call, problem
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._sr.base import AbstractOperator
from vmcgrad._sr.jacobian import components
from vmcgrad._sr.modes import is_complex
from vmcgrad._sr.ntk.dense import choose_dense, dense_program, dense_solve
from vmcgrad._sr.ntk.modes import choose_ntk_mode, k_of, pinned, vector_dtype
from vmcgrad._sr.solve import CGInfo, differentiable_cg

_NAME = "vmcgrad.NTK"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class NTKOperator(AbstractOperator):
    r"""The centred kernel :math:`T = \frac1N \Delta J \Delta J^\dagger + \lambda\mathbb 1` (see :func:`NTK`).

    A pytree (:class:`vmcgrad._sr.base.AbstractOperator`): parameters, samples, the model state of a
    ``Partial`` ``logpsi`` and ``diag_shift`` are leaves (rebuilding it every step does not recompile);
    the function's code, the chunk size, the mode and the sample mesh axis are static.

    Vectors are flat, of length :attr:`dim` = N·K, in NetKet's order: sample by sample, and within a
    sample (Re, Im) in 'complex' mode; real, or complex in 'holomorphic' mode.
    """

    _builder = _NAME
    _described = ("jacobian_batch",)

    #: Samples whose Jacobians the dense kernel derives at once, or None for the whole chunk
    #: (:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`). Static; ``chunk_size="auto"`` sets it
    #: (:func:`~vmcgrad._sr.ntk.dense.choose_dense`).
    jacobian_batch: int | None = dataclasses.field(default=None, metadata={"static": True})

    #: Whether :func:`vmcgrad.minsr_update`'s dense route may keep every sample's Jacobian across
    #: several chunks (one device holding all N, the Jacobian within the budget:
    #: :func:`~vmcgrad._sr.ntk.dense.keeps_jacobian`). Static; ``chunk_size="auto"``
    #: (:func:`~vmcgrad._sr.ntk.dense.choose_dense`) sets it False for the blocks' candidates of
    #: several chunks, searched where one block, which keeps the Jacobian, does not fit.
    keep_jacobian: bool = dataclasses.field(default=True, metadata={"static": True})

    #: Whether the kept Jacobian's rows take the K components' pullbacks one after another
    #: (:func:`vmcgrad._sr.jacobian.jacobian`'s ``in_turn``): half a sample's derivative intermediates
    #: in 'complex' mode, more ops a trip. Static; ``chunk_size="auto"``
    #: (:func:`~vmcgrad._sr.ntk.dense.choose_dense`) sets it where the budget binds and it is faster.
    components_in_turn: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def dim(self) -> int:
        """N·K: the side of the matrix (2N in 'complex' mode)."""
        return self.problem.n * k_of(self.mode)

    @property
    def dtype(self) -> Any:
        """The matrix dtype: complex in 'holomorphic' mode, else the real dtype of the parameters."""
        return vector_dtype(self.mode, self.params)

    def __matmul__(self, v: Any) -> jax.Array:
        r""":math:`T v`: one vjp pass and one jvp pass over the samples, no N×N storage.

        Args:
            v: a vector of shape ``(dim,)`` (:attr:`dtype`).

        Returns:
            :math:`T v`, shape ``(dim,)``.
        """
        v = self._vector("v", v)
        return call(_matmul_program, self.problem, self, v)

    def to_dense(self) -> jax.Array:
        """The ``(dim, dim)`` matrix, block by block (rows split over the devices like the samples)."""
        return call(dense_program, self.problem, self, choose=choose_dense)

    def solve(
        self,
        b: Any,
        *,
        solver: Any = None,
        x0: Any = None,
        tol: float = 1e-5,
        atol: float = 0.0,
        maxiter: int | None = None,
    ) -> tuple[jax.Array, Any]:
        r"""Solves :math:`T x = b`.

        The solution is differentiable in ``b`` and in the operator's leaves (parameters, samples,
        ``diag_shift``): the dense solve through its factorisation, the conjugate gradient implicitly
        (``jax.lax.custom_linear_solve``: the tangent is one more solve, not the iterations), as
        :meth:`vmcgrad.QGTOperator.solve`.

        Args:
            b: right-hand side, shape ``(dim,)``.
            solver: None for a Cholesky solve of :meth:`to_dense`; a NetKet-style dense solver
                ``solver(A, b) -> x`` or ``(x, info)`` (e.g. ``netket.optimizer.solver.cholesky``);
                or ``"cg"``: vmcgrad's conjugate gradient on :meth:`__matmul__` (matrix-free).
            x0, tol, atol, maxiter: for ``"cg"`` only, with the defaults of
                :meth:`vmcgrad.QGTOperator.solve` (and ``jax.scipy.sparse.linalg.cg``): stop when
                :math:`\lVert r\rVert \le \max(\mathrm{tol}\lVert b\rVert, \mathrm{atol})`;
                ``maxiter`` None means ``10 * dim``.

        Returns:
            ``(x, info)``: ``info`` a :class:`vmcgrad.CGInfo` for ``"cg"``, the dense solver's info
            (or None) otherwise.
        """
        where = f"{_NAME}.solve"
        b = self._vector("b", b)
        solver = check_solver(where, solver)
        if solver == "cg":
            x0 = None if x0 is None else self._vector("x0", x0)
            tol, atol = check.check_tolerances(where, tol, atol)
            maxiter = check.check_maxiter(where, maxiter, default=10 * self.dim)
            return call(_cg_program, self.problem, self, b, x0, tol, atol, maxiter)
        return call(_dense_solve_program, self.problem, self, b, solver, choose=choose_dense)

    def _vector(self, name: str, v: Any) -> jax.Array:
        where = f"{_NAME} ({name})"
        v = check.as_arrays(where, name, v)
        dtype = self.dtype
        if not isinstance(v, jax.Array) or v.shape != (self.dim,):
            raise ValueError(
                f"{where}: `{name}` must be a vector of shape ({self.dim},) (N·K = {self.n_samples}·"
                f"{k_of(self.mode)} in mode {self.mode!r}); got {check.describe(v)}. Fix: pass one entry per "
                "sample (and per real/imaginary part in 'complex' mode, interleaved as NetKet does)."
            )
        if not jnp.issubdtype(v.dtype, jnp.inexact) or (is_complex(v) and not is_complex(dtype)):
            raise TypeError(
                f"{where}: `{name}` must be a {'complex' if is_complex(dtype) else 'real'} floating "
                f"vector ({dtype}); got {check.describe(v)}. Fix: pass v.astype({jnp.dtype(dtype).name!r})."
            )
        return v.astype(dtype)

    # --- traced pieces ---------------------------------------------------------------------------

    @property
    def _real_dtype(self) -> Any:
        return jnp.finfo(self.dtype).dtype

    def _sizing_call(self) -> tuple:
        return dense_program, self.problem, self

    def _auto_chunk(self) -> int:
        return choose_dense(*self._sizing_call())[0]

    def _fun(self) -> Callable:
        return join_fun(self.problem.fun, tuple(self.inputs.fun_data))

    def _jdagger(self, x: jax.Array) -> Any:
        r""":math:`\Delta J^\dagger x` for ``x`` of shape ``(N, K)``, parameter-shaped: one vjp pass."""
        x = x - jnp.mean(x, axis=0, keepdims=True)
        xc = jax.lax.complex(x[:, 0], x[:, 1]) if self.mode == "complex" else x[:, 0]
        ct = jnp.conj(xc).astype(self.problem.out_dtype)
        g = vjp_sum(self.problem, self.inputs, ct)
        return cast_like(jax.tree.map(jnp.conj, g), self.params)

    def _j(self, tangent: Any) -> jax.Array:
        r""":math:`\Delta J t` for a parameter-shaped ``t``, shape ``(N, K)``: one jvp pass."""
        _, y = map_reduce_problem(self.problem, self.inputs, jvp_chunk, (tangent, self.problem.layout))
        y = components(self.mode, y)
        return y - jnp.mean(y, axis=0, keepdims=True)

    def _apply(self, v: jax.Array) -> jax.Array:
        k, n = k_of(self.mode), self.problem.n
        y = self._j(self._jdagger(v.reshape(n, k))) / n
        return (y.reshape(-1) + self.diag_shift * v).astype(v.dtype)


def check_solver(where: str, solver: Any) -> Any:
    """``solver`` checked before anything is traced: None (Cholesky), a NetKet-style ``solver(A, b)``
    or ``"cg"`` (matrix-free); a TypeError in ``where``'s words otherwise."""
    if solver is None or callable(solver) or (isinstance(solver, str) and solver == "cg"):
        return solver
    raise TypeError(
        f"{where}: `solver` must be None (Cholesky of the dense kernel), a dense solver "
        f"solver(A, b) -> x or (x, info), or 'cg' (matrix-free); got {check.describe(solver)}. "
        "Fix: pass e.g. solver=netket.optimizer.solver.cholesky or solver='cg'."
    )


def NTK(
    logpsi: Any,
    params: Any,
    samples: Any,
    *,
    chunk_size: int | str | None = None,
    mode: str | None = None,
    diag_shift: float | jax.Array = 0.0,
    memory_budget: float | None = None,
) -> NTKOperator:
    r"""The centred neural-tangent kernel of ``logpsi`` at ``params`` over ``samples``.

    .. math::

        T = \frac1N \Delta J \Delta J^\dagger + \lambda \mathbb 1,\qquad
        \Delta J_i = J_i - \frac1N\sum_j J_j ,

    in NetKet's ``VMC_SR`` conventions (``srt`` / ``srt_onthefly``): with
    :math:`\tilde\theta` the parameters, complex leaves split into real and imaginary parts,

    - ``'real'``: :math:`J_i = \partial\,\mathrm{Re}\log\psi(\sigma_i)/\partial\tilde\theta`, T is N×N;
    - ``'complex'``: rows :math:`\partial\,\mathrm{Re}\log\psi(\sigma_i)/\partial\tilde\theta` and
      :math:`\partial\,\mathrm{Im}\log\psi(\sigma_i)/\partial\tilde\theta`, interleaved sample by
      sample: T is the real 2N×2N matrix;
    - ``'holomorphic'``: :math:`J_i = O_i = \partial\log\psi(\sigma_i)/\partial\theta` (complex), T is
      complex Hermitian N×N (the complex form of the 'complex' kernel of a holomorphic model).

    Args:
        logpsi: ``logpsi(params, batch) -> (batch,)`` log-amplitudes; a plain callable or a
            ``jax.tree_util.Partial`` whose arrays are traced.
        params: the parameter pytree.
        samples: the N samples along axis 0 (sharded over devices or not; any N).
        chunk_size: rows and columns per block on each device (any positive int), None for one block
            (all local rows against all samples), or ``"auto"``: the largest chunk whose
            :meth:`~NTKOperator.to_dense` program fits ``memory_budget``, among the powers of two
            and then, at the Jacobian batch they fix, the fewer larger chunks
            (:func:`~vmcgrad._sr.ntk.dense.choose_dense`).
        mode: 'real', 'complex', 'holomorphic', or None: 'real' for real parameters and output,
            else 'complex' (NetKet's default).
        diag_shift: :math:`\lambda`.
        memory_budget: bytes per device for ``chunk_size="auto"``.

    Returns:
        An :class:`NTKOperator`.

    Raises:
        TypeError, ValueError: for bad input, before anything is traced.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> logpsi = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> T = vmcgrad.NTK(logpsi, w, x, chunk_size=4)
        >>> J = jax.jacrev(lambda w: logpsi(w, x))(w)
        >>> dJ = J - J.mean(0)
        >>> bool(jnp.allclose(T.to_dense(), dJ @ dJ.T / 10))
        True
    """
    prob, inputs, _ = problem(
        _NAME, logpsi, params, samples, chunk_size=chunk_size, memory_budget=memory_budget, arg="logpsi"
    )
    prob = pinned(prob)  # the platform in force: its programs (their Jacobian batch) and prices
    mode = choose_ntk_mode(_NAME, inputs.params, prob.out_dtype, mode)
    real = jnp.finfo(vector_dtype(mode, inputs.params)).dtype
    diag_shift = check.check_nonnegative_scalar(_NAME, "diag_shift", diag_shift, real)
    return NTKOperator(inputs=inputs, diag_shift=diag_shift, problem=prob, mode=mode)


# --- compiled programs: program(problem, op, ...) with the problem static (see _problem.call) ---------


@partial(jax.jit, static_argnums=0)
def _matmul_program(prob: Problem, op: NTKOperator, v: jax.Array) -> jax.Array:
    return op._at(prob)._apply(v)


@partial(jax.jit, static_argnums=(0, 3))
def _dense_solve_program(prob: Problem, op: NTKOperator, b: jax.Array, solver: Any) -> tuple[jax.Array, Any]:
    return dense_solve(solver, dense_program(prob, op), b)


@partial(jax.jit, static_argnums=0)
def _cg_program(prob: Problem, op: NTKOperator, b, x0, tol, atol, maxiter) -> tuple[jax.Array, CGInfo]:
    op = op._at(prob)
    return differentiable_cg(partial(kernel_product, op), b, x0, tol=tol, atol=atol, maxiter=maxiter)


@jax.jit
def kernel_product(op: NTKOperator, v: jax.Array) -> jax.Array:
    """``op._apply(v)`` as a function of its own, which JAX traces once per operand shapes: CG's trace
    calls it three times (its loop, ``x0``'s residual, the final residual check), each two passes
    (tests/test_ntk.py::test_cg_solve_traces_the_product_once)."""
    return op._apply(v)
