r"""``NTK``: the centred neural-tangent kernel of sample-space SR (MinSR / SPRING) as a pytree operator.

With :math:`J` the per-sample Jacobian of the mode's output with respect to a real parametrisation
(NetKet's ``VMC_SR`` conventions, :func:`NTK`), :math:`\Delta J_i = J_i - \frac1N \sum_j J_j`,

.. math::

    T = \frac1N \Delta J \Delta J^\dagger + \lambda\, \mathbb 1 ,

an :math:`NK \times NK` matrix (K = 2 output components in 'complex' mode, 1 otherwise). Its
non-zero spectrum is that of the QGT :math:`S = \frac1N \Delta J^\dagger \Delta J`.

How it is computed, always through the one chunked primitive (:mod:`vmcgrad._runner.primitive`):

* :meth:`NTKOperator.to_dense`: one pass over each device's rows, ``c`` at a time. For a chunk of
  rows the chunk's Jacobian :math:`J_{[k]}` (``c K × P``) is taken, then an inner loop walks the N
  samples (gathered once, before the pass) ``c`` columns at a time, taking each column chunk's
  Jacobian and the block :math:`U_{[k][l]} = (J_{[k]} - \mathbf 1 s^T)(J_{[l]} - \mathbf 1 s^T)^\dagger`,
  only for the column chunks on or above the diagonal (from the one holding the chunk's first counted
  row; the chunk's own columns from its rows): the uncentred kernel is Hermitian,
  :math:`U_{[l][k]} = U_{[k][l]}^\dagger`, so the blocks below are filled after the pass, by one
  transpose of the rows (an all-to-all over the devices). About half the column Jacobians are
  derived: on one device :math:`N + N(N - c)/2c` per-sample Jacobians (rows, then the column chunks
  not yet seen) instead of :math:`N + N^2/c` (NetKet's NTK: N); with one block (``c`` ≥ N), N.
  Peak memory is about :math:`2cKP` plus the device's :math:`N_\text{local} K \times NK` rows and
  the buffer of their transpose (which XLA may reuse, see ``benchmarks/bench_minsr.py``); no
  collective runs per block. :math:`s` is NetKet's mean-Jacobian estimate (32 evenly strided
  samples): it does not change the centred kernel in exact arithmetic, and keeps its small
  eigenvalues in float32 (taken over at most ``c`` samples, so that no model call exceeds the chunk).
  The centring follows, as row and column means of the blocks.
* ``T @ v``: one vjp pass (:math:`g = \Delta J^\dagger v`, the pullback path of
  :func:`vmcgrad.batched_vjp`) and one jvp pass (:math:`\Delta J g`, that of
  :func:`vmcgrad.batched_jvp`); nothing of size N×N or N×P is stored.

The update of sample-space SR (:func:`minsr_update`) maps the solution back to parameter space with
the same pullback as :func:`vmcgrad.batched_vjp` (``vmcgrad._estimators.vjp.vjp_sum``).

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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._chunks.plan import cast_like, plan_chunks
from vmcgrad._estimators.jvp import jvp_chunk
from vmcgrad._estimators.vjp import vjp_sum
from vmcgrad._problem import validation as check
from vmcgrad._problem.function import join_fun
from vmcgrad._problem.problem import Problem, call, problem
from vmcgrad._problem.sharding import explicit_sharding, unsplit_explicit
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import REPLICATED, SAMPLES
from vmcgrad._sr.ntk_modes import (
    choose_ntk_mode,
    components,
    contract,
    is_complex,
    jacobian,
    jacobian_batch,
    k_of,
    mean_jacobian,
    rows_fun,
    theta_of,
    vector_dtype,
)
from vmcgrad._sr.operator import AbstractOperator
from vmcgrad._sr.qgt_apply import differentiable_cg
from vmcgrad._sr.solve import CGInfo

_NAME = "vmcgrad.NTK"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class NTKOperator(AbstractOperator):
    r"""The centred kernel :math:`T = \frac1N \Delta J \Delta J^\dagger + \lambda\mathbb 1` (see :func:`NTK`).

    A pytree (:class:`vmcgrad._sr.operator.AbstractOperator`): parameters, samples, the model state of a
    ``Partial`` ``logpsi`` and ``diag_shift`` are leaves (rebuilding it every step does not recompile);
    the function's code, the chunk size, the mode and the sample mesh axis are static.

    Vectors are flat, of length :attr:`dim` = N·K, in NetKet's order: sample by sample, and within a
    sample (Re, Im) in 'complex' mode; real, or complex in 'holomorphic' mode.
    """

    _builder = _NAME

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
        return call(_dense_program, self.problem, self)

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
        solver = _check_solver(where, solver)
        if solver == "cg":
            x0 = None if x0 is None else self._vector("x0", x0)
            tol, atol = check.check_tolerances(where, tol, atol)
            maxiter = check.check_maxiter(where, maxiter, default=10 * self.dim)
            return call(_cg_program, self.problem, self, b, x0, tol, atol, maxiter)
        return call(_dense_solve_program, self.problem, self, b, solver)

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
        return _dense_program, self.problem, self

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


def _check_solver(where: str, solver: Any) -> Any:
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
            (all local rows against all samples), or ``"auto"``: the largest power of two whose
            :meth:`~NTKOperator.to_dense` program fits ``memory_budget``.
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
    mode = choose_ntk_mode(_NAME, inputs.params, prob.out_dtype, mode)
    real = jnp.finfo(vector_dtype(mode, inputs.params)).dtype
    diag_shift = check.check_nonnegative_scalar(_NAME, "diag_shift", diag_shift, real)
    return NTKOperator(inputs=inputs, diag_shift=diag_shift, problem=prob, mode=mode)


# --- compiled programs: program(problem, op, ...) with the problem static (see _problem.call) ---------


def _column_chunk(prob: Problem) -> int:
    """Columns per block: the row chunk (at most N), or all N for one block."""
    c = plan_chunks(prob.n_local, prob.chunk_size).size
    return min(c, prob.n)


def dense_chunk(
    fun: Callable,
    params: Any,
    x: Any,
    w: jax.Array,
    index: jax.Array,
    all_x: Any,
    shift: Any,
    *,
    mode: str,
    cols: int,
    n: int,
) -> tuple[tuple, jax.Array]:
    r"""One chunk of rows of the uncentred kernel on and above the diagonal: ``(c, K, N, K)``.

    With :math:`\tilde J_i = J_i - s` (``shift`` the mean-Jacobian estimate :math:`s`), the entries
    :math:`U_{r a, s b} = \tilde J_{r a} \tilde J_{s b}^\dagger` of the chunk's rows :math:`r` are taken
    for the column blocks of ``cols`` samples (``all_x``: all samples, padded to a multiple of ``cols``)
    from the one holding :math:`r_0`, the smallest global index ``index`` of a counted row
    (``w > 0``), to the last: every entry with :math:`s \ge r` of a counted row, and the blocks before
    are left zero (:func:`_dense_program` fills :math:`s < r` from :math:`U_{s b, r a} =
    \overline{U_{r a, s b}}`). A column block's Jacobians are derived from its samples, except the
    block the chunk's own rows are (``c == cols`` and the chunk starts at the block's first sample),
    which reuses them. A row chunk starting at global sample :math:`g` thus derives about
    :math:`N - g` column Jacobians, not :math:`N`.
    """
    f = rows_fun(fun, mode, params)
    theta = theta_of(mode, params)
    k = k_of(mode)
    c = jax.tree.leaves(x)[0].shape[0]
    rows = jax.tree.map(lambda j, s: j - s, jacobian(f, theta, x, mode, jacobian_batch(c)), shift)
    n_pad = jax.tree.leaves(all_x)[0].shape[0]
    blocks = n_pad // cols
    dtype = jax.tree.leaves(rows)[0].dtype
    if blocks == 1:  # one chunk, one block (c == N): the chunk's rows are all the samples
        return (), contract(rows, rows, k)[:, :, :n, :]
    # The first block with a column >= the smallest counted row (none for a chunk without one).
    first = jnp.min(jnp.where(w > 0, index, n_pad)) // cols

    def block(i, out):
        def derived():
            xc = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * cols, cols), all_x)
            col = jacobian(f, theta, xc, mode, jacobian_batch(cols))
            col = jax.tree.map(lambda j, s: j - s, col, shift)
            return contract(rows, col, k)

        # A chunk starting at block i's first sample holds its samples (rows padded to the device
        # count repeat the last sample, as all_x's padding does): its own Jacobians.
        own = (lambda: contract(rows, rows, k)) if c == cols else derived
        skip = lambda: jnp.zeros((c, k, cols, k), dtype)
        which = jnp.where(i < first, 0, jnp.where(index[0] == i * cols, 1, 2))
        return jax.lax.dynamic_update_slice_in_dim(
            out, jax.lax.switch(which, (skip, own, derived)), i * cols, axis=2
        )

    # Static bounds (a scan, reverse-differentiable); the blocks before `first` are skipped.
    out = jax.lax.fori_loop(0, blocks, block, jnp.zeros((c, k, n_pad, k), dtype))
    return (), out[:, :, :n, :]


@partial(jax.jit, static_argnums=0)
def _dense_program(prob: Problem, op: NTKOperator) -> jax.Array:
    op = op._at(prob)
    n, k, mode = prob.n, k_of(op.mode), op.mode
    f = rows_fun(op._fun(), mode, op.params)
    theta = theta_of(mode, op.params)
    cols = _column_chunk(prob)
    samples = unsplit_explicit(op.samples)  # all of them go to every device anyway
    shift = mean_jacobian(f, theta, samples, n, mode, cols)
    n_pad = -(-n // cols) * cols
    all_x = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], n_pad - n, axis=0)]), samples)
    chunk = partial(dense_chunk, mode=mode, cols=cols, n=n)
    index = (jnp.arange(n), SAMPLES)
    _, t = map_reduce_problem(prob, op.inputs, chunk, index, (all_x, REPLICATED), (shift, REPLICATED))
    if n_pad > cols:  # (with one column block every chunk took all its columns)
        t = _hermitian_fill(t)
    # Centring without a dense centring matrix (NetKet's srt_onthefly): row and column means.
    col_means = t.mean(axis=0, keepdims=True)
    row_means = t.mean(axis=2, keepdims=True)
    t = (t - col_means - row_means + col_means.mean(axis=2, keepdims=True)) / n
    t = _flatten(t)
    return (t + op.diag_shift * jnp.eye(n * k, dtype=t.dtype)).astype(op.dtype)


def _flatten(t: jax.Array) -> jax.Array:
    """``(N, K, N, K) -> (NK, NK)``, the rows split as ``t``'s (on Explicit axes, stated: JAX does not
    infer the split of a merged dimension)."""
    n, k = t.shape[:2]
    sharding = explicit_sharding(t)
    if sharding is None:
        return t.reshape(n * k, n * k)
    out = NamedSharding(sharding.mesh, P((*sharding.spec, None)[0], None))
    return jax.lax.reshape(t, (n * k, n * k), out_sharding=out)


def _hermitian_fill(t: jax.Array) -> jax.Array:
    r"""The kernel ``(N, K, N, K)`` from its entries with column :math:`s \ge` row :math:`r`:
    :math:`U_{r a, s b} = \overline{U_{s b, r a}}` for :math:`s < r` (one transpose of the rows split
    over the devices: one all-to-all, outside every loop)."""
    n = t.shape[0]
    upper = (jnp.arange(n)[None, :] >= jnp.arange(n)[:, None])[:, None, :, None]
    lower = jnp.conj(jnp.transpose(t, (2, 3, 0, 1)))
    sharding = explicit_sharding(t)
    if sharding is not None:
        # Explicit axes: the transpose and the mask are typed otherwise; select wants t's sharding
        lower = jax.sharding.reshard(lower, sharding)
        upper = jax.sharding.reshard(jnp.broadcast_to(upper, t.shape), sharding)
    return jnp.where(upper, t, lower)


@partial(jax.jit, static_argnums=0)
def _matmul_program(prob: Problem, op: NTKOperator, v: jax.Array) -> jax.Array:
    return op._at(prob)._apply(v)


def _dense_solve(solver: Any, a: jax.Array, b: jax.Array) -> tuple[jax.Array, Any]:
    a, b = unsplit_explicit((a, b))  # Explicit axes: factorisations take unsplit matrices (as NetKet's)
    if solver is None:
        return jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a, lower=True), b), None
    out = solver(a, b)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


@partial(jax.jit, static_argnums=(0, 3))
def _dense_solve_program(prob: Problem, op: NTKOperator, b: jax.Array, solver: Any) -> tuple[jax.Array, Any]:
    return _dense_solve(solver, _dense_program(prob, op), b)


@partial(jax.jit, static_argnums=0)
def _cg_program(prob: Problem, op: NTKOperator, b, x0, tol, atol, maxiter) -> tuple[jax.Array, CGInfo]:
    op = op._at(prob)
    return differentiable_cg(partial(_product, op), b, x0, tol=tol, atol=atol, maxiter=maxiter)


@jax.jit
def _product(op: NTKOperator, v: jax.Array) -> jax.Array:
    """``op._apply(v)`` as a function of its own, which JAX traces once per operand shapes: CG's trace
    calls it three times (its loop, ``x0``'s residual, the final residual check), each two passes
    (tests/test_ntk.py::test_cg_solve_traces_the_product_once)."""
    return op._apply(v)
