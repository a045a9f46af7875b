r"""``QGT``: the quantum geometric tensor as an immutable, jit-friendly linear operator.

.. math::

    S = \frac1N \Delta O^\dagger \Delta O,\qquad \Delta O_i = O_i - \bar O,\qquad
    \bar O = \frac1N \sum_{i=1}^N O_i,\qquad O_{ik} = \frac{\partial \log\psi_\theta(\sigma_i)}
    {\partial\theta_k},

applied as :math:`S_\text{eff}\,v = S v + \epsilon_1 \operatorname{diag}(S)\, v + \epsilon_2 v`
with :math:`\epsilon_1` = ``diag_scale`` and :math:`\epsilon_2` = ``diag_shift`` (NetKet's
QGTJacobian regularisation, Becca & Sorella 2017). The matrix taken in each mode (real part, real
and imaginary parts split, holomorphic) is described in :mod:`vmcgrad._sr.modes`; the kinds of
vectors it takes in :mod:`vmcgrad._sr.qgt.views`.

The pieces: this module holds the operator (its product's designs) and its builder; what it shares
with the kept-linearisation operator :class:`vmcgrad.LinearizedQGT` (:mod:`vmcgrad._sr.qgt.linearized`)
is their base :class:`~vmcgrad._sr.qgt.abstract.AbstractQGT` (products, solves, the dense matrix); the
chunk functions are in :mod:`vmcgrad._sr.qgt.passes`, run by the chunked primitive
(:mod:`vmcgrad._runner.primitive`); the solver is :mod:`vmcgrad._sr.solve`. Every product is one pass over the
samples: per chunk one linearisation, its jvp and its transpose; :math:`\bar O` is computed once,
when the operator is built, so the centring is a cheap dot product; one reduction per product,
after the loop.

Except where the product runs in the very trace that built the operator (``jax.jit(lambda w, x, v:
vmcgrad.QGT(f, w, x) @ v)``): there the pass for :math:`\bar O` would be paid by that one product,
so the product takes the two-loop design instead (NetKet's ``QGTOnTheFly``: a loop of jvps, their
centring by their mean, a loop of pullbacks), which reads no :math:`\bar O`, and XLA drops the
unused pass for :math:`\bar O`: four linear passes in all, where the pass for :math:`\bar O` and
the fused product make five (seven where :math:`O` is complex over real parameters: two pullbacks
for :math:`\bar O`, :func:`~vmcgrad._sr.qgt.passes.mean_chunk`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._checks.holomorphy import holomorphic_violation
from vmcgrad._chunks.budget import Choice, cheapest, predicted_seconds
from vmcgrad._jax_private import get_opaque_trace_state
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import (
    Problem,
    auto_choice,
    auto_knob,
    budget_of,
    call,
    cost_platform_of,
    problem,
)
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import SAMPLES
from vmcgrad._sr.modes import choose_mode, to_rep
from vmcgrad._sr.qgt.abstract import AbstractQGT, diag_s_program, diag_scale_leaf
from vmcgrad._sr.qgt.apply import matmul_program, solve_program
from vmcgrad._sr.qgt.linearized import KEPT_NOTE, LinearizedQGT
from vmcgrad._sr.qgt.passes import (
    join_mean,
    linearize_chunk,
    mean_chunk,
    product_chunk,
    product_jvp_vjp_chunk,
    pullback_chunk,
    split_imag,
    tangent_chunk,
)
from vmcgrad._sr.qgt.views import Views

_NAME = "vmcgrad.QGT"

#: The product's designs, by name: the chunk function of ``S @ v`` (:mod:`vmcgrad._sr.qgt.passes`).
#: ``"fused"``: one linearisation per chunk, its jvp and its transpose (three linear passes over the
#: chunk); ``"jvp_vjp"``: a jvp, then the pullback of a second forward pass (four; a smaller chunk
#: footprint where XLA keeps the two apart); ``"two_loop"``: NetKet's ``QGTOnTheFly``, a loop of
#: jvps, their centring by their mean, then a loop of pullbacks (four passes, two loops; no
#: :math:`\bar O` read: the design of a product in the trace that built the operator, see
#: :meth:`QGTOperator._for_product`; its chunk functions are ``tangent_chunk`` and ``pullback_chunk``).
DESIGNS = {"fused": product_chunk, "jvp_vjp": product_jvp_vjp_chunk, "two_loop": None}
#: The designs ``chunk_size="auto"`` chooses between (:func:`design_choice`): with :math:`\bar O` at
#: hand, the two-loop design costs the jvp-then-vjp design's passes in two loops.
AUTO_DESIGNS = ("fused", "jvp_vjp")
#: Linear passes over a chunk's rows per product, per design (forward, tangent, transpose; the
#: jvp-then-vjp design runs the forward twice): what :func:`design_choice` scales a priced design's
#: time by to estimate another's before compiling it.
PASSES = {"fused": 3, "jvp_vjp": 4, "two_loop": 4}
#: The fixed cost of one chunk of one pass on the CPU, in rows of work, measured: the fused product's
#: time against its chunk size (``benchmarks/qgt_design_bytes.py --time-chunks``; docs/performance.md).
#: On the CPU the designs are compared by :math:`P_d (n + r \lceil n / c_d \rceil)` with this
#: :math:`r` rather than by ``program_cost``, which misprices them there (:func:`design_choice`).
CPU_CHUNK_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class QGTOperator(AbstractQGT):
    r"""The regularised QGT :math:`S + \epsilon_1\operatorname{diag}(S) + \epsilon_2` of one set of samples.

    Build it with :func:`vmcgrad.QGT`. It is a pytree (:class:`vmcgrad._sr.base.AbstractOperator`):
    the parameters, samples, :math:`\bar O`, the model state of a ``Partial`` ``logpsi`` and the
    shifts are leaves, so it can be passed into ``jax.jit`` and rebuilt every step without
    recompiling; ``logpsi``'s code, the chunk size, the mode, the product's design and the sample
    mesh axis are static (the design here, the rest in its :class:`~vmcgrad._problem.problem.Problem`).

    Products, solves, ``to_dense``, ``diagonal`` and ``replace`` are those of
    :class:`vmcgrad._sr.qgt.abstract.AbstractQGT`; each product recomputes every chunk's forward pass
    (:attr:`design`), holding one chunk's at a time. Vectors are pytrees like ``params``, flat
    vectors in ``ravel_pytree(params)`` order, or flat vectors in the mode's real representation
    (length :attr:`dim`, the order of :meth:`to_dense`); every method returns the kind it was given.
    """

    _builder = _NAME
    _described = ("design",)

    design: str = dataclasses.field(default="fused", metadata={"static": True})  # see DESIGNS

    def linearize(self) -> LinearizedQGT:
        """This operator with every chunk's linearisation kept (:class:`vmcgrad.LinearizedQGT`).

        One forward pass over the samples now; every product and solve iteration afterwards runs only
        the jvp and its transpose from the kept residuals. Costs the residuals' memory for all chunks
        at once (:attr:`vmcgrad.LinearizedQGT.nbytes` per device).
        """
        return linearize(self)

    @property
    def kept_solve(self) -> int | None:
        """The chunk at which :meth:`solve` (and a NetKet solver through
        :func:`vmcgrad.netket.QGTOnTheFly`) first keeps every chunk's linearisation
        (:meth:`linearize`), so that its iterations run no forward pass; None: every product
        recomputes them. With ``chunk_size="auto"``, the largest power of two at which such a solve
        fits the memory budget (:func:`kept_solve_chunk`: compile only, cached, chosen at the first
        use); None at a given chunk size."""
        if self.problem.chunk_size != "auto":
            return None
        return kept_solve_chunk(self)

    @property
    def choice(self) -> Choice | None:
        """The record of ``chunk_size="auto"``'s choice for the product (None at a given chunk size):
        a :class:`vmcgrad._chunks.budget.Choice` whose ``value`` is ``(design, chunk)``, with its
        modelled time (``seconds``), the ``platform`` it was priced for and the designs priced
        (:func:`design_choice`; for a design given by the caller, that design's chunk). Compile only,
        cached: reading it after the operator was built compiles nothing. ``choice.as_dict()`` is
        JSON-able, for a log."""
        if self.problem.chunk_size != "auto":
            return None
        choice = design_choice(self)
        if choice.value[0] == self.design:
            return choice
        own = auto_choice(matmul_program, self.problem, self, self.params, "tree")
        return own._replace(value=(self.design, own.value))

    def replace(self, **changes: Any) -> QGTOperator:
        """A copy with new shifts (:meth:`AbstractQGT.replace`); a copy that does not read
        :math:`\\bar O` (no new ``diag_scale``) keeps the record of the trace that built it."""
        new = super().replace(**changes)
        built = getattr(self, "_built_in", None)
        if built is not None and new.diag_s is None:
            object.__setattr__(new, "_built_in", built)
        return new

    def _for_product(self) -> QGTOperator:
        """The operator a product ``S @ v`` runs: itself, or, in the trace that built it (a
        :math:`\\bar O` of that trace that nothing else has read, and no design given), itself
        with the two-loop design, which reads no :math:`\\bar O`: that product is then the only
        use of :math:`\\bar O`, whose pass XLA drops (see the module docstring). The record of the
        trace is an attribute, not a pytree field, so it does not survive ``jax.jit``'s boundary:
        an operator passed into a program, or returned from one, keeps its design."""
        built = getattr(self, "_built_in", None)
        if built is not None and built == get_opaque_trace_state():
            return dataclasses.replace(self, design="two_loop")
        return self

    def _apply_rep(self, rep: Any) -> Any:
        """:math:`S_\\text{eff} \\tilde v` for a representation pytree: one pass, one reduction
        (two passes, each with its reduction, for the two-loop design)."""
        layout = self._rep_layout()
        if self.design == "two_loop":
            return self._finish(self._two_loop_sum(rep, layout), rep, scaled=True)
        chunk = partial(DESIGNS[self.design], mode=self.mode)
        total, _ = map_reduce_problem(
            self.problem, self.inputs, chunk, (self.obar, layout), (rep, layout), sum_layout=layout
        )
        return self._finish(total, rep)

    def _two_loop_sum(self, rep: Any, layout: tuple) -> Any:
        r""":math:`\frac1N \sum_i \overline{O_i}\, \Delta w_i`, :math:`\Delta w = O v - \mathrm{mean}(O v)`,
        by two loops: the rows of :math:`O v` (:func:`~vmcgrad._sr.qgt.passes.tangent_chunk`),
        their centring, then the pullback with cotangent :math:`\overline{\Delta w} / N`
        (:func:`~vmcgrad._sr.qgt.passes.pullback_chunk`). As :math:`\mathrm{mean}(O v) = \bar O
        \cdot v`, the fused design's sums over :math:`N` (the :math:`1/N` on the rows, as NetKet
        applies it, rather than on the :math:`P` sums)."""
        tangent = partial(tangent_chunk, mode=self.mode)
        _, ov = map_reduce_problem(self.problem, self.inputs, tangent, (rep, layout))
        ov = ov * (1.0 / self.problem.n)
        dw = jnp.conj(ov - jnp.mean(ov))
        pull = partial(pullback_chunk, mode=self.mode)
        total, _ = map_reduce_problem(self.problem, self.inputs, pull, (dw, SAMPLES), sum_layout=layout)
        return total


def choose_design(op: QGTOperator) -> tuple[str, int]:
    """The product's design and chunk that ``chunk_size="auto"`` picks (:func:`design_choice`)."""
    return design_choice(op).value


def design_choice(op: QGTOperator) -> Choice:
    r"""The product's design and chunk that ``chunk_size="auto"`` picks, the fastest on the platform
    within the budget, as a record (:class:`vmcgrad._chunks.budget.Choice`: ``value`` is
    ``(design, chunk)``, ``seconds`` its modelled time, ``platform`` the platform priced for).

    Per design :math:`d`, the chunk :math:`c_d` is the one ``chunk_size="auto"`` gives its compiled
    ``S @ v`` (:func:`vmcgrad._problem.problem.auto_choice`: among the powers of two that fit the
    memory budget, the least modelled time), and the designs are compared by that time,

    .. math::

        t_d = n_{\text{ops}}\, t_{\text{op}} + \frac{\text{FLOPs}}{\text{peak}}
            + \frac{\text{bytes}}{\text{bandwidth}}

    (:func:`vmcgrad._hlo.cost.program_cost` of the compiled product, with the constants of the
    problem's platform: :func:`vmcgrad._problem.problem.cost_platform_of`), the fused design first
    and on a tie. The jvp-then-vjp design holds about half the arrays per row, so where the budget
    binds its chunk is about twice the fused one: half the trips, a third more FLOPs. Where the
    sequential ops dominate (a GPU, a TPU, a small model) it wins; where FLOPs and bytes do (a CPU),
    the fused design. Through :func:`vmcgrad._chunks.budget.cheapest`, a design is not sized
    (nothing compiled for it) when even its fastest case cannot beat the best priced: the priced
    program predicted at one chunk of all rows (:func:`vmcgrad._chunks.budget.predicted_seconds`),
    scaled by the ratio of linear passes (:data:`PASSES`). The chunks are cached: a second choice
    compiles nothing.

    On the CPU the designs are compared by the measured rule :math:`P_d\,(n + r\lceil n/c_d\rceil)`
    (:data:`PASSES`, :data:`CPU_CHUNK_ROWS`; the fused design wins exactly when its chunk is at
    least :math:`r`): ``program_cost`` misprices the jvp-then-vjp design there (its second forward
    pass sits in a ``conditional``, counted as the mean of its branches, and its transcendental
    functions count one FLOP each), and would take it where the fused design at half its chunk is
    measured faster (docs/performance.md, "What a step costs on an accelerator"). The record's
    ``seconds`` is still the modelled time.

    Raises:
        MemoryError: when no design fits even one sample per chunk (the error of the smaller one).
    """
    prob = op.problem
    platform = cost_platform_of(prob)
    n = prob.n_local

    def chosen(design: str) -> Choice:
        at = dataclasses.replace(op, design=design)
        choice = auto_choice(matmul_program, prob, at, op.params, "tree")
        return choice._replace(value=(design, choice.value))

    if platform.name == "cpu":  # the measured rule (see above), in rows of work

        def rows(choice: Choice) -> float:
            design, chunk = choice.value
            return PASSES[design] * (n + CPU_CHUNK_ROWS * -(-n // chunk))

        def fewest_rows(design: str, best: Choice) -> float:
            return PASSES[design] * (n + CPU_CHUNK_ROWS)

        return cheapest(AUTO_DESIGNS, chosen, budget_of(prob), platform, bound=fewest_rows, score=rows)

    def fastest(design: str, best: Choice) -> float:
        best_design, chunk = best.value
        one_chunk = predicted_seconds(best.cost, n, chunk, n, platform)
        return one_chunk * PASSES[design] / PASSES[best_design]

    return cheapest(AUTO_DESIGNS, chosen, budget_of(prob), platform, bound=fastest)


def kept_solve_chunk(op: QGTOperator) -> int | None:
    r"""The chunk at which a solve keeps every chunk's linearisation within the memory budget, or None.

    The sized program is the solve itself with the linearisations kept: its compiled bytes (every
    chunk's residuals at once, one product's temporaries, the solver's vectors, the arguments) must
    fit the budget, as one product's must for the recomputing solve. The chunk is the largest power
    of two at which it fits (what ``chunk_size="auto"`` gives the solve's program); None where even
    one sample per chunk does not fit (the residuals of all samples are over the budget).

    Where it fits, the kept route is taken: a solve of :math:`k` products costs one forward pass and
    :math:`2k` linear passes instead of :math:`3k` (fused design; NetKet's unchunked ``QGTOnTheFly``
    keeps its ``jax.linearize`` too), and a conjugate-gradient solve runs at least two products. At
    one chunk of all samples XLA hoists the loop-invariant forward pass out of the solver's loop by
    itself, which it cannot do across a loop over several chunks, so the kept route gains where the
    budget holds the residuals but not a whole-batch product (measured: docs/performance.md, the
    kept solve per chunk). Compile only, cached (:func:`vmcgrad._problem.problem.auto_knob`).
    """
    args = (op, op.params, None, 1e-5, 0.0, 1, "tree", True)  # the solve, linearisations kept
    candidates = [2**k for k in range(op.problem.n_local.bit_length())]
    return auto_knob(solve_program, op.problem, args, candidates, lambda c: (c, args), name="kept solve")


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
    :mod:`vmcgrad._sr.modes`). Building it costs one pass over the samples (for :math:`\bar O`;
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
            second forward pass: a smaller footprint per row, a fourth pass), ``"two_loop"``
            (NetKet's: a loop of jvps, their centring, a loop of pullbacks; reads no
            :math:`\bar O`), or None: with ``chunk_size="auto"`` the pair (design, chunk) that is
            fastest within ``memory_budget`` (:func:`choose_design`), else ``"fused"``; either way
            a product in the trace that built the operator (``jax.jit(lambda w, x, v:
            vmcgrad.QGT(f, w, x) @ v)``, no ``diag_scale``) runs ``"two_loop"``, as it is then the
            only reader of :math:`\bar O`, whose pass XLA drops. All give the same matrix.

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
    diag_shift = 0.0 if diag_shift is None else diag_shift
    diag_shift = check.check_nonnegative_scalar(_NAME, "diag_shift", diag_shift, real)
    diag_scale = diag_scale_leaf(_NAME, diag_scale, real)
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
        op = dataclasses.replace(op, diag_s=call(diag_s_program, prob, op))
    if design is None and prob.chunk_size == "auto":  # on the complete operator (what products get)
        op = dataclasses.replace(op, design=choose_design(op)[0])
    if design is None and diag_scale is None and _traced(op.obar):
        # O-bar was computed in the caller's trace and nothing has read it yet: a product in this
        # trace reads none (QGTOperator._for_product), so XLA drops its pass
        object.__setattr__(op, "_built_in", get_opaque_trace_state())
    return op


def _traced(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


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


def linearize(op: QGTOperator) -> LinearizedQGT:
    """``op.linearize()``: one pass keeping every chunk's linearisation.

    With ``chunk_size="auto"`` the chunk is fixed here (the product's automatic chunk), so that the
    products walk the chunks the linearisations were kept for.
    """
    if op.problem.chunk_size == "auto":
        op = op._at(op.problem.at_chunk(op.chunk_size))
    _, _, maps = call(_linearize_program, op.problem, op)
    kept = {f.name: getattr(op, f.name) for f in dataclasses.fields(LinearizedQGT) if f.name != "linear_maps"}
    return LinearizedQGT(**kept, linear_maps=maps)


@partial(jax.jit, static_argnums=0)
def _linearize_program(prob: Problem, op: QGTOperator) -> tuple[Any, Any, Any]:
    op = op._at(prob)
    return map_reduce_problem(prob, op.inputs, partial(linearize_chunk, mode=op.mode), kept_note=KEPT_NOTE)
