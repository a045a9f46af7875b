r"""``QGT``: the quantum geometric tensor as an immutable, jit-friendly linear operator.

.. math::

    S = \frac1N \Delta O^\dagger \Delta O,\qquad \Delta O_i = O_i - \bar O,\qquad
    \bar O = \frac1N \sum_{i=1}^N O_i,\qquad O_{ik} = \frac{\partial \log\psi_\theta(\sigma_i)}
    {\partial\theta_k},

applied as :math:`S_\text{eff}\,v = S v + \epsilon_1 \operatorname{diag}(S)\, v + \epsilon_2 v`
with :math:`\epsilon_1` = ``diag_scale`` and :math:`\epsilon_2` = ``diag_shift`` (NetKet's
QGTJacobian regularisation, Becca & Sorella 2017). The matrix taken in each mode (real part, real
and imaginary parts split, holomorphic) is described in :mod:`vmcgrad._qgt_modes`; the kinds of
vectors it takes in :mod:`vmcgrad._views`.

The pieces: this module holds the operator and its builder; the chunk functions are in
:mod:`vmcgrad._qgt_passes`, run by the chunked primitive (:mod:`vmcgrad._chunked`); the kept-linearisation
operator is :class:`vmcgrad.LinearizedQGT` (:mod:`vmcgrad._qgt_linearized`); the solver is
:mod:`vmcgrad._solve`. Every product is one pass over the samples: per chunk one linearisation, its
jvp and its transpose; :math:`\bar O` is computed once, when the operator is built, so the centring is
a cheap dot product; one reduction per product, after the loop.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from . import _validation as check
from ._chunked import map_reduce_problem
from ._operator import AbstractOperator
from ._problem import Problem, auto_chunk, call, problem
from ._qgt_apply import matmul_program, solve
from ._qgt_modes import choose_mode, holomorphic_violation, to_rep
from ._qgt_passes import (
    jacobian_chunk,
    join_mean,
    mean_chunk,
    product_chunk,
    product_jvp_vjp_chunk,
    split_imag,
)
from ._solve import CGInfo
from ._views import Views

_NAME = "vmcgrad.QGT"

#: The product's designs, by name: the chunk function of ``S @ v`` (:mod:`vmcgrad._qgt_passes`).
#: ``"fused"``: one linearisation per chunk, its jvp and its transpose (three linear passes over the
#: chunk); ``"jvp_vjp"``: a jvp, then the pullback of a second forward pass (four; a smaller chunk
#: footprint where XLA keeps the two apart).
DESIGNS = {"fused": product_chunk, "jvp_vjp": product_jvp_vjp_chunk}
#: Linear passes over a chunk's rows per product, per design (forward, tangent, transpose; the
#: jvp-then-vjp design runs the forward twice).
PASSES = {"fused": 3, "jvp_vjp": 4}
#: The fixed cost of one chunk of one pass, in rows of work, per platform: a loop step, its slices,
#: its kernel launches and a matrix product too thin to run at full speed. CPU: measured, process CPU
#: time of ``S @ v`` (RBM, L = 48, N = 8192, float64, one device, 9 interleaved calls): the fused
#: product at chunk 16 took 1.28x its time at chunk 64 (about 7 rows per chunk), and chunks from 32
#: to 1024 were within the noise of each other. Elsewhere (GPU, TPU): an estimate, not measured
#: (about 50 us of loop step and launches per chunk against about 10 ns per row of a small model);
#: ``benchmarks/device.sh`` measures the designs there. Only its order matters: it decides when a
#: design whose chunk fits twice as large wins (:func:`choose_design`).
CHUNK_ROWS = {"cpu": 8}
CHUNK_ROWS_ACCELERATOR = 4096


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class QGTOperator(AbstractOperator):
    r"""The regularised QGT :math:`S + \epsilon_1\operatorname{diag}(S) + \epsilon_2` of one set of samples.

    Build it with :func:`vmcgrad.QGT`. It is a pytree (:class:`vmcgrad._operator.AbstractOperator`):
    the parameters, samples, :math:`\bar O`, the model state of a ``Partial`` ``logpsi`` and the
    shifts are leaves, so it can be passed into ``jax.jit`` and rebuilt every step without
    recompiling; ``logpsi``'s code, the chunk size, the mode and the sample mesh axis are static (in
    its :class:`~vmcgrad._problem.Problem`).

    Vectors are pytrees like ``params``, flat vectors in ``ravel_pytree(params)`` order, or flat
    vectors in the mode's real representation (length :attr:`dim`, the order of :meth:`to_dense`);
    every method returns the kind it was given.
    """

    _shifts = ("diag_shift", "diag_scale")
    _builder = _NAME
    _described = ("design",)

    obar: Any  # the mean O, shaped like the representation of params (complex where O is)
    diag_scale: jax.Array | None
    diag_s: Any  # diag of S (no shifts), shaped like the representation of params, or None
    design: str = dataclasses.field(default="fused", metadata={"static": True})  # see DESIGNS

    # --- shapes --------------------------------------------------------------------------------

    @property
    def views(self) -> Views:
        """The vector kinds this operator takes (:class:`vmcgrad._views.Views`)."""
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
        v, kind = self.views.kind(f"{_NAME} (v)", "v", v)
        return call(matmul_program, self.problem, self, v, kind)

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
        r"""Solves :math:`S_\text{eff}\, x = b` by conjugate gradient (one pass per iteration).

        With ``diag_scale`` set, CG is preconditioned by Jacobi, :math:`M = D^{-1}`,
        :math:`D = \epsilon_1 \operatorname{diag}(S) + \epsilon_2` (NetKet's rescaling of the system
        by :math:`D^{-1/2}`, which gives the same iterates in exact arithmetic); the tolerances and
        ``info`` refer to the original system :math:`S_\text{eff}\, x = b`.

        To keep every chunk's linearisation for the whole solve (no forward pass per iteration),
        solve with ``S.linearize().solve(b)`` instead (:class:`vmcgrad.LinearizedQGT`).

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

    def linearize(self) -> Any:
        """This operator with every chunk's linearisation kept (:class:`vmcgrad.LinearizedQGT`).

        One forward pass over the samples now; every product and solve iteration afterwards runs only
        the jvp and its transpose from the kept residuals. Costs the residuals' memory for all chunks
        at once (:attr:`vmcgrad.LinearizedQGT.nbytes` per device).
        """
        from ._qgt_linearized import linearize

        return linearize(self)

    def replace(self, **changes: Any) -> QGTOperator:
        """A copy with new ``diag_shift`` and/or ``diag_scale`` (computing diag(S) if needed)."""
        new = super().replace(**changes)
        if new.diag_scale is not None and new.diag_s is None:
            new = dataclasses.replace(new, diag_s=call(_diag_s_program, new.problem, new))
        return new

    # --- traced pieces, shared with LinearizedQGT ---------------------------------------------

    @property
    def operator(self) -> QGTOperator:
        """Itself (a :class:`vmcgrad.LinearizedQGT`'s is the operator it keeps linearisations of)."""
        return self

    @property
    def _real_dtype(self) -> Any:
        return self.views.real_dtype

    def _sizing_call(self) -> tuple:
        return matmul_program, self.problem, self, self.params, "tree"

    def _check_shift(self, where: str, name: str, value: Any) -> Any:
        if name == "diag_scale":
            return _diag_scale(where, value, self._real_dtype)
        return super()._check_shift(where, name, value)

    def _rep_layout(self) -> tuple:
        return self.views.rep_layout(self.problem.layout)

    def _rep_like(self) -> Any:
        return jax.eval_shape(partial(to_rep, self.mode), self.params)

    def _apply_rep(self, rep: Any) -> Any:
        """:math:`S_\\text{eff} \\tilde v` for a representation pytree: one pass, one reduction."""
        layout = self._rep_layout()
        chunk = partial(DESIGNS[self.design], mode=self.mode)
        total, _ = map_reduce_problem(
            self.problem, self.inputs, chunk, (self.obar, layout), (rep, layout), sum_layout=layout
        )
        return self._finish(total, rep)

    def _finish(self, total: Any, v: Any) -> Any:
        """From the reduced :math:`\\sum_i \\overline{O_i} w_i` to :math:`S_\\text{eff} v`."""
        inv_n = 1.0 / self.problem.n

        def finish(t, x, d=None):
            y = jnp.conj(t) * inv_n + self.diag_shift * x
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


def _scalar(where: str, name: str, x: Any, real_dtype: Any) -> jax.Array:
    """A shift: a finite real number >= 0 (checked when concrete), as a 0-d ``real_dtype`` array."""
    return check.check_nonnegative_scalar(where, name, x, real_dtype)


def _diag_scale(where: str, x: Any, real_dtype: Any) -> jax.Array | None:
    """``diag_scale``: None, or a shift; a concrete 0 means no scaling, the same as None."""
    if x is None:
        return None
    x = _scalar(where, "diag_scale", x, real_dtype)
    return None if not isinstance(x, jax.core.Tracer) and float(x) == 0 else x


def choose_design(op: QGTOperator) -> tuple[str, int]:
    r"""The product's design and chunk that ``chunk_size="auto"`` picks: the fastest within the budget.

    Per design :math:`d`, the chunk :math:`c_d` is the largest power of two whose compiled ``S @ v``
    fits the memory budget (:func:`vmcgrad._problem.auto_chunk`: compiled, not run); the time is
    modelled as

    .. math::

        t_d \propto P_d \,(n + r \lceil n / c_d \rceil),

    :math:`P_d` the linear passes per row (:data:`PASSES`: 3 fused, 4 jvp-then-vjp), :math:`n` the
    rows per device and :math:`r` the cost of one chunk in rows (:data:`CHUNK_ROWS`: 8 on CPU, else
    :data:`CHUNK_ROWS_ACCELERATOR`). The smallest :math:`t_d` wins, the fused design on a tie. Where
    the jvp-then-vjp chunk is twice the fused one (it holds about half the arrays per row), the fused
    design wins exactly when its chunk is at least :math:`r`. A design is not sized (nothing is
    compiled for it) when even its fastest case, one chunk of all :math:`n` rows, cannot beat a design
    sized before it: with the fused design at chunk :math:`c`, the jvp-then-vjp design is compiled
    only when :math:`3r\lceil n/c\rceil > n + 4r` (on CPU, with more than 64 rows: a fused chunk of
    16 rows or fewer). The chunks are cached
    (:func:`vmcgrad._auto_chunk.choose_chunk`): a second choice compiles nothing.

    Raises:
        MemoryError: when no design fits even one sample per chunk (the error of the smaller one).
    """
    n, fits, errors = op.problem.n_local, {}, []
    rows = CHUNK_ROWS.get(jax.local_devices()[0].platform, CHUNK_ROWS_ACCELERATOR)

    def time(design: str, chunk: int) -> float:
        return PASSES[design] * (n + rows * -(-n // chunk))

    for design in DESIGNS:  # the fused design first, so it wins a tie
        if fits and min(time(d, c) for d, c in fits.items()) <= time(design, n):
            continue  # cannot win even at its largest chunk
        try:
            fits[design] = auto_chunk(
                matmul_program, op.problem, dataclasses.replace(op, design=design), op.params, "tree"
            )
        except MemoryError as err:
            errors.append(err)
    if not fits:
        raise min(errors, key=lambda err: err.need)
    design = min(fits, key=lambda d: time(d, fits[d]))  # dicts keep order: a tie goes to the first
    return design, fits[design]


def QGT(
    logpsi: Any,
    params: Any,
    samples: Any,
    *,
    chunk_size: int | str | None = None,
    diag_shift: float | jax.Array = 0.0,
    diag_scale: float | jax.Array | None = None,
    mode: str | None = None,
    holomorphic: bool | None = None,
    memory_budget: float | None = None,
    design: str | None = None,
) -> QGTOperator:
    r"""Builds the quantum geometric tensor of ``logpsi`` at ``params`` over ``samples``.

    .. math::

        S_\text{eff} = \frac1N \Delta O^\dagger \Delta O + \epsilon_1 \operatorname{diag}
        \Big(\frac1N \Delta O^\dagger \Delta O\Big) + \epsilon_2\, \mathbb 1,\qquad
        \Delta O_i = O_i - \bar O,\quad O_{ik} = \frac{\partial \log\psi(\sigma_i)}{\partial\theta_k}

    in the mode's representation (``Re`` of it for 'real' and 'complex'; see
    :mod:`vmcgrad._qgt_modes`). Building it costs one pass over the samples (for :math:`\bar O`;
    a second one, holding one chunk's Jacobian, when ``diag_scale`` is set, for
    :math:`\operatorname{diag} S`); each product :math:`S v` then costs one more.

    Args:
        logpsi: ``logpsi(params, batch) -> (batch_size,)`` log-amplitudes, real or complex; a plain
            callable (static) or a ``jax.tree_util.Partial`` whose arrays (model state) are traced.
            **Row by row:** row i of the output may depend on sample i only; ``logpsi`` is called on chunks of
            at most ``chunk_size`` rows (per device), so a batch statistic inside it (a mean, max or
            logsumexp of the batch subtracted without ``jax.lax.stop_gradient``) would become a per-chunk
            one. Where the analysis of its jaxpr proves such a coupling, a ValueError says so.
        params: the parameter pytree (real and/or complex floating leaves).
        samples: an array (or pytree of arrays) with the N samples along axis 0, sharded over
            devices or not; any N.
        chunk_size: samples per chunk on each device (any positive int, or None for one chunk),
            or ``"auto"``: the largest power of two whose ``S @ v`` program fits the memory budget
            (:func:`vmcgrad.auto_chunk_size`'s rule, applied to the product), for the design that
            is then fastest (:func:`choose_design`; the operator's ``design`` says which).
        diag_shift: :math:`\epsilon_2`, added to the diagonal.
        diag_scale: :math:`\epsilon_1`, or None: the diagonal is also scaled by
            :math:`1 + \epsilon_1` and :meth:`~QGTOperator.solve` is Jacobi-rescaled (NetKet's
            QGTJacobian ``diag_scale``).
        mode: 'real', 'complex', 'holomorphic', or None to choose as NetKet does: 'real' for real
            parameters, 'complex' if any is complex, 'holomorphic' if ``holomorphic=True``. The
            matrices equal NetKet's QGTOnTheFly, and QGTJacobianDense with NetKet's default mode
            (for real parameters and a complex output NetKet names that mode 'complex'; its
            explicit mode='real' there drops Im log ψ: pass ``logpsi(...).real`` to get it).
        holomorphic: whether ``logpsi`` is holomorphic in complex parameters (exclusive with ``mode``).
            The declaration is checked: ``logpsi``'s tangent map is proved complex-linear from its
            jaxpr (no FLOPs, once per function and input shapes), or else the Cauchy–Riemann
            equations are tested on the first 8 samples (needs concrete inputs: outside
            ``jax.jit``, or once before, as a pass is remembered). A non-holomorphic ``logpsi`` is
            refused (the holomorphic matrix would be wrong); use ``mode='complex'`` for it.
        memory_budget: bytes per device for ``chunk_size="auto"`` (compiled ``memory_analysis()``:
            temporaries, arguments and outputs), or None for :func:`vmcgrad.auto_chunk_size`'s default.
        design: how each chunk's :math:`\Delta O^\dagger \Delta O v` is computed: ``"fused"`` (one
            linearisation: its jvp and its transpose), ``"jvp_vjp"`` (a jvp, then the pullback of a
            second forward pass: a smaller footprint per row, a fourth pass), or None: with
            ``chunk_size="auto"`` the pair (design, chunk) that is fastest within ``memory_budget``
            (:func:`choose_design`), else ``"fused"``. Both give the same matrix.

    Returns:
        A :class:`QGTOperator` (a pytree).

    Raises:
        TypeError, ValueError: for bad input, before anything is traced; ValueError for a
            ``logpsi`` whose rows provably depend on each other, or a non-holomorphic ``logpsi``
            declared holomorphic.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> logpsi = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> S = vmcgrad.QGT(logpsi, w, x, chunk_size=4, diag_shift=1e-3)
        >>> O = jax.jacrev(lambda w: logpsi(w, x))(w)
        >>> dO = O - O.mean(0)
        >>> S_ref = dO.T @ dO / 10 + 1e-3 * jnp.eye(3)
        >>> bool(jnp.allclose(S.to_dense(), S_ref)), bool(jnp.allclose(S @ w, S_ref @ w))
        (True, True)
        >>> x_sol, info = S.solve(S_ref @ w)
        >>> bool(jnp.allclose(x_sol, w, rtol=1e-4)), int(info.iterations) <= 3
        (True, True)
    """
    check.check_design(_NAME, design, DESIGNS)
    prob, inputs, _ = problem(
        _NAME, logpsi, params, samples, chunk_size=chunk_size, memory_budget=memory_budget, arg="logpsi"
    )
    out = jax.ShapeDtypeStruct((prob.n,), prob.out_dtype)
    mode = choose_mode(_NAME, inputs.params, out, mode, holomorphic)
    if mode == "holomorphic":
        why = holomorphic_violation(logpsi, inputs.params, inputs.samples)
        if why is not None:
            raise ValueError(
                f"{_NAME}: holomorphic=True (mode='holomorphic') needs `logpsi` to be holomorphic in "
                f"`params`, but it is not: {why}. The holomorphic QGT would be a different, wrong "
                "matrix (its centring assumes O v is complex-linear in v). Fix: pass "
                "holomorphic=False or mode='complex' (real and imaginary parts as separate real "
                "parameters: the matrix NetKet's QGTOnTheFly(holomorphic=True) applies to such a "
                "model), or make `logpsi` holomorphic (no conj, abs, real or imag of a "
                "parameter-dependent value)."
            )
    real = Views(inputs.params, mode).real_dtype
    diag_shift = _scalar(_NAME, "diag_shift", 0.0 if diag_shift is None else diag_shift, real)
    diag_scale = _diag_scale(_NAME, diag_scale, real)
    op = QGTOperator(
        inputs=inputs,
        obar=None,
        diag_shift=diag_shift,
        diag_scale=diag_scale,
        diag_s=None,
        problem=prob,
        mode=mode,
        design=design or "fused",
    )
    op = dataclasses.replace(op, obar=call(_mean_program, prob, op))
    if diag_scale is not None:
        op = dataclasses.replace(op, diag_s=call(_diag_s_program, prob, op))
    if design is None and prob.chunk_size == "auto":  # on the complete operator (what products get)
        op = dataclasses.replace(op, design=choose_design(op)[0])
    return op


# --- compiled programs: program(problem, op, ...) with the problem static (see _problem.call) ----


@partial(jax.jit, static_argnums=0)
def _mean_program(prob: Problem, op: QGTOperator) -> Any:
    op = op._at(prob)
    chunk = partial(mean_chunk, mode=op.mode, out_dtype=prob.out_dtype)
    like = to_rep(op.mode, op.params)
    layout = op._rep_layout()
    pair = split_imag(like, prob.out_dtype)
    total, _ = map_reduce_problem(prob, op.inputs, chunk, sum_layout=layout * 2 if pair else layout)
    total = join_mean(total, like, prob.out_dtype)
    complex_o = jnp.issubdtype(prob.out_dtype, jnp.complexfloating)

    def mean(t, p):
        dtype = jnp.result_type(p.dtype, jnp.complex64) if complex_o else p.dtype
        return (t / prob.n).astype(dtype)

    return jax.tree.map(mean, total, like)


@partial(jax.jit, static_argnums=0)
def _diag_s_program(prob: Problem, op: QGTOperator) -> Any:
    """diag(S) as a real pytree shaped like the representation of the parameters."""
    flat = op._at(prob)._jacobian_stats(dense=False)
    return _unflatten_like(flat, to_rep(op.mode, op.params))


@partial(jax.jit, static_argnums=0)
def _diagonal_program(prob: Problem, op: QGTOperator) -> jax.Array:
    op = op._at(prob)
    diag_s = op.diag_s if op.diag_s is not None else _diag_s_program(prob, op)
    flat = ravel_pytree(diag_s)[0]
    scale = 1.0 if op.diag_scale is None else 1.0 + op.diag_scale
    return (scale * flat + op.diag_shift).astype(op.views.rep_dtype)


@partial(jax.jit, static_argnums=0)
def _dense_program(prob: Problem, op: QGTOperator) -> jax.Array:
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
