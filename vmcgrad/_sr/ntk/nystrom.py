r"""A column-Nyström preconditioner for the conjugate gradient on the centred kernel of sample-space SR.

The system of :func:`vmcgrad.minsr_update` with ``solver="cg"`` is :math:`(T + \lambda)x = \varepsilon`,
:math:`T = \frac1N \Delta J \Delta J^\dagger` (:func:`vmcgrad.NTK`). Its spectrum falls from
:math:`O(1)` to zero (rank at most P), so plain CG at :math:`\lambda = 10^{-3}` takes hundreds of
iterations. The preconditioner is built from ``r`` samples :math:`S` (evenly strided, as NetKet's
mean-Jacobian subset; duplicated samples cost nothing but a column that is cut below):

.. math::

    C = \tilde J \tilde J_S^\dagger \;(NK \times rK),\qquad
    W = \tilde J_S \tilde J_S^\dagger \;(rK \times rK),\qquad
    T \approx \hat T = \frac1N (QC)\, W^{+} (QC)^\dagger ,

with :math:`\tilde J = J - s` the Jacobian rows less NetKet's mean-Jacobian estimate :math:`s` (as in
the dense kernel) and :math:`Q` the centring over samples (per component). :math:`\hat T` is the
centred Nyström approximation of the uncentred kernel :math:`\tilde J \tilde J^\dagger`, so
:math:`0 \preceq \hat T \preceq T`. Its thin eigendecomposition :math:`\hat T = Z\Theta Z^\dagger`
(``QC`` times :math:`W`'s inverse square root, then a QR and the SVD of the triangle; directions with
tiny :math:`W` or :math:`\Theta` eigenvalues are dropped, which keeps :math:`Z` orthonormal) gives the
preconditioner of Frangella, Tropp and Udell (Randomized Nyström preconditioning, SIAM J. Matrix Anal.
Appl. 44, 2023):

.. math::

    M = Z (\Theta + \lambda)^{-1} Z^\dagger + \frac{1}{\theta_\text{min} + \lambda}(\mathbb 1 - Z Z^\dagger),

Hermitian positive definite for any :math:`\lambda \ge 0`; applying it costs two products with the
:math:`NK \times rK` matrix :math:`Z` (the Woodbury form of :math:`(\hat T + \lambda)^{-1}` up to the
scale of the complement). The directions :math:`T` has and :math:`\hat T` captures are brought near 1,
the rest (eigenvalues below :math:`\theta_\text{min}`) keep a spread of :math:`(\theta_\text{min} +
\lambda)/\lambda` at most.

:math:`C` is built a block of ``b`` subset samples at a time (:func:`columns`): the block's Jacobians
(:math:`bKP` numbers, the only Jacobians held), then one pass over every device's rows deriving each row
chunk's Jacobian and contracting it with the block, which fills the block's :math:`b K` columns of
:math:`C`; :math:`\lceil r/b \rceil` blocks in all (the last one overlaps its predecessor where ``b``
does not divide ``r``: it recomputes columns, never pads). :math:`W` is :math:`C`'s rows at the subset
(before centring, :math:`\tilde J_S \tilde J_S^\dagger` exactly in the algebra; made Hermitian), so no
pass builds it. The rank is thus bounded by the :math:`NK \times rK` matrices (:math:`C`, its QR
factor and :math:`Z`), not by held Jacobians; each block costs a pass over the N rows (N per-sample
Jacobians). :func:`nystrom_plan` trades the two (rank against passes) within a memory budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vmcgrad._chunks.budget import Choice
from vmcgrad._problem.problem import Problem, auto_choice, auto_knob
from vmcgrad._problem.sharding import unsplit_explicit
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import REPLICATED
from vmcgrad._sr.jacobian import jacobian
from vmcgrad._sr.ntk.modes import (
    contract,
    jacobian_batch,
    jacobian_split,
    k_of,
    mean_jacobian,
    rows_fun,
    theta_of,
)

#: Fraction of the memory budget the preconditioner's own arrays may take (the rest: the CG passes).
BUDGET_FRACTION = 0.5

#: The model of preconditioned CG's iterations against the rank r, :math:`I(r) = I_1 r^{-a}`
#: (:func:`nystrom_plan`): the exponent ``a`` and the scale ``I_1``. Fitted to the 1-D GCNN of
#: ``docs/performance.md`` (tol 1e-10, λ = 1e-3: 69, 30 and 19 iterations at r = 19, 64 and 128); the
#: plan's time is flat near its optimum, so the choice does not hinge on the fit.
ITERATIONS_POWER = 2 / 3
ITERATIONS_AT_ONE = 500.0

#: CG iterations one pass over the rows that builds a block of columns costs (N per-sample
#: Jacobians against an iteration's jvp and vjp passes over N): about 3 measured on the 1-D GCNN on
#: a CPU (``docs/performance.md``), where a Jacobian derived a few samples at a time is dearer per FLOP
#: than a pass; its FLOPs alone, :math:`(1 + 2K)F` against :math:`6F` per sample, would say 5/6.
PASS_ITERATIONS = 3.0


class Nystrom(NamedTuple):
    """The preconditioner :math:`M` (see the module): ``z`` the ``(NK, q)`` orthonormal directions,
    ``scale`` their ``(q,)`` factors :math:`1/(\\theta + \\lambda)` (zero where a direction was
    dropped), ``rest`` the factor :math:`1/(\\theta_\\text{min} + \\lambda)` of the complement."""

    z: jax.Array
    scale: jax.Array
    rest: jax.Array

    def __call__(self, v: jax.Array) -> jax.Array:
        zv = jnp.conj(self.z).T @ v
        return (self.z @ (self.scale * zv) + self.rest * (v - self.z @ zv)).astype(v.dtype)


class Plan(NamedTuple):
    """The preconditioner's ``rank`` (samples r) and ``block`` (samples b whose Jacobians are held at
    once); ``passes`` :math:`\\lceil r/b \\rceil` over the rows (0 at rank 0, plain CG)."""

    rank: int
    block: int

    @property
    def passes(self) -> int:
        return -(-self.rank // self.block) if self.rank else 0


def _bytes(n: int, k: int, p: int, itemsize: int, budget: float) -> tuple[float, int, int]:
    """The preconditioner's share of ``budget``, one held sample Jacobian (:math:`KP` numbers) and one
    sample's columns of the three :math:`NK \\times rK` matrices (:math:`3NK^2`), in bytes."""
    return BUDGET_FRACTION * budget, itemsize * k * p, itemsize * 3 * n * k * k


def nystrom_plan(n: int, k: int, p: int, itemsize: int, budget: float) -> Plan:
    r"""The rank r and block b of least modelled time whose arrays fit :data:`BUDGET_FRACTION` of
    ``budget`` bytes: the block's Jacobians and the three :math:`NK \times rK` matrices,

    .. math::

        itemsize\,(bKP + 3NK^2 r) \le \tfrac12\,\mathrm{budget},\qquad r \le N/2,

    minimising the build's passes and the iterations, in CG iterations,

    .. math::

        t(b) = \lceil r/b \rceil\,\rho + I(r),\qquad I(r) = I_1 r^{-a},

    each block a pass over the N rows worth :math:`\rho` = :data:`PASS_ITERATIONS` iterations, and
    :math:`I(r)` the iterations (:data:`ITERATIONS_AT_ONE`, :data:`ITERATIONS_POWER`): a larger block
    means fewer passes but, in the same bytes, a smaller rank and more iterations. For each b the rank
    is the largest that fits; among equal times the larger rank. The subset's own Jacobians (r) and
    the algebra (:math:`2NK\,rK\,P`, as many FLOPs at any b) are left out. Rank 0 (plain CG) when
    not even one sample's fits.

    Args:
        n: N, the samples. k: output components per sample (2 in 'complex' mode).
        p: real parameters (entries of the differentiated parametrisation).
        itemsize: bytes per entry of the kernel (16 for complex).
        budget: bytes per device.
    """
    share, jac, col = _bytes(n, k, p, itemsize, budget)
    rho = PASS_ITERATIONS
    best, best_key = Plan(0, 1), None
    for b in range(1, max(1, n // 2) + 1):
        r = int(min(n // 2, (share - b * jac) // col))
        if r < 1:
            break
        plan = Plan(r, min(b, r))
        key = (plan.passes * rho + ITERATIONS_AT_ONE * r**-ITERATIONS_POWER, -r)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best


def nystrom_rank(n: int, k: int, p: int, itemsize: int, budget: float) -> int:
    """Samples ``r`` of the preconditioner at ``budget`` bytes (:func:`nystrom_plan`): at most N/2; 0
    (plain CG) when not even one sample's Jacobian and columns fit. Arguments as :func:`nystrom_plan`."""
    return nystrom_plan(n, k, p, itemsize, budget).rank


def check_rank(where: str, rank: Any, n: int, k: int, p: int, itemsize: int, budget: float) -> int:
    """The preconditioner's rank a caller gave (``nystrom_rank``): ``"auto"`` is
    :func:`nystrom_rank` of the budget, None is 0 (plain CG), an int in ``[0, N]`` itself. Where the
    rule's matrix-free route at that automatic rank does not fit (its arrays take half the budget,
    whatever the rest needs), :func:`vmcgrad.minsr_update` tries plain CG before it says no route
    fits."""
    if rank is None:
        return 0
    if isinstance(rank, str) and rank == "auto":
        return nystrom_rank(n, k, p, itemsize, budget)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= n:
        raise ValueError(
            f"{where}: `nystrom_rank` must be 'auto', None or an int in [0, N = {n}]; got {rank!r}. "
            "Fix: nystrom_rank='auto' sizes it to the memory budget; 0 or None runs plain CG."
        )
    return rank


def nystrom_block(n: int, k: int, p: int, itemsize: int, budget: float, rank: int) -> int:
    """Samples whose Jacobians are held at once for a preconditioner of ``rank``: the most (at most
    ``rank``, so the fewest passes) that fit :data:`BUDGET_FRACTION` of ``budget`` beside its three
    :math:`NK \\times rK` matrices; for a rank whose matrices alone are over that share (one given by
    hand), as many as the share holds alone; at least 1. At the rank of :func:`nystrom_plan` it is at
    least the plan's block (the rank was the largest fitting beside it)."""
    share, jac, col = _bytes(n, k, p, itemsize, budget)
    room = share - rank * col if rank * col + jac <= share else share
    return int(max(1, min(rank, room // jac)))


def choose_cg(program: Any, prob: Problem, op: Any, *args: Any, rank: int) -> tuple[int, tuple]:
    """``chunk_size="auto"`` for a matrix-free update with a preconditioner of ``rank`` samples (the
    ``choose`` of :func:`vmcgrad._problem.problem.call`): ``(chunk, (op, *args))``, as
    :func:`cg_choice`."""
    chunk, args, _ = cg_choice(program, prob, op, *args, rank=rank)
    return chunk, args


def cg_choice(program: Any, prob: Problem, op: Any, *args: Any, rank: int) -> tuple[int, tuple, Choice]:
    r""":func:`choose_cg`'s ``(chunk, args)`` and the record of the search that settled them
    (:class:`vmcgrad._chunks.budget.Choice`). Compile only, cached.

    Two knobs, searched apart, as the dense kernel's (:func:`~vmcgrad._sr.ntk.dense.choose_dense`):
    the chunk sets the trips of CG's jvp and vjp passes, run every iteration; the Jacobian batch
    :math:`b` (:attr:`~vmcgrad.NTKOperator.jacobian_batch`) the trips of the preconditioner's build,
    run once, whose per-sample Jacobians hold the model's intermediates of :math:`b` samples, many
    times a pass's. Derived at the whole chunk, as an accelerator's batch would have them
    (:func:`~vmcgrad._sr.ntk.modes.jacobian_split` 1), those Jacobians would bound the chunk of
    every iteration's passes by the build's bytes. So on an accelerator, with a preconditioner: the
    largest chunk that fits with the build's Jacobians one sample at a time, then at that chunk the
    largest batch among the powers of two up to it (and the chunk itself) that fits (the build and
    the iterations run one after the other, so the two hardly compete for the budget). Elsewhere
    (a CPU: a fixed part of the chunk; plain CG; a batch given) the chunk alone, as for any program.
    """
    if rank == 0 or op.jacobian_batch is not None or jacobian_split(prob) != 1:
        found = auto_choice(program, prob, op, *args)
        return found.value, (op, *args), found
    single = dataclasses.replace(op, jacobian_batch=1)
    found = auto_choice(program, prob, single, *args)
    chunk = found.value
    rows = min(prob.at_chunk(chunk).plan.size, prob.n)
    batches = sorted({2**i for i in range(rows.bit_length())} | {rows})
    at = lambda b: (chunk, (dataclasses.replace(op, jacobian_batch=b), *args))
    name = "the Nyström build's Jacobian batch"
    best = auto_knob(program, prob.at_chunk(chunk), (op, *args), batches, at, name=name, info=True)
    if best is None:  # (batch 1 fits: it was searched)
        return chunk, (single, *args), found
    return (*at(best.value), best._replace(compiled=found.compiled + best.compiled))


def nystrom_chunk(
    fun, params, x, w, js, shift, *, mode: str, split: int, batch: int | None = None
) -> tuple[tuple, jax.Array]:
    r"""One chunk of rows of :math:`C = \tilde J \tilde J_S^\dagger`: ``(c, K, b, K)``, the rows'
    Jacobians derived ``batch`` samples at a time (:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`)
    and each batch contracted with the block's ``js`` at once: the chunk holds a batch's Jacobians,
    never its c rows', so its bytes beyond the batch's are those of the chunk's samples and columns."""
    f = rows_fun(fun, mode, params)
    theta, k = theta_of(mode, params), k_of(mode)

    def one(xi):  # one sample's row of C
        row = jacobian(f, theta, jax.tree.map(lambda a: a[None], xi), mode, None, shift)
        return contract(row, js, k)[0]

    # (w: padded rows are cut after the pass)
    return (), jax.lax.map(one, x, batch_size=jacobian_batch(w.shape[0], batch, split))


def columns(op: Any, rank: int, cols: int, block: int) -> tuple[jax.Array, jax.Array]:
    r"""``(C, idx)``: :math:`C = \tilde J \tilde J_S^\dagger` uncentred, ``(N, K, r, K)``, and the subset
    ``idx`` (``r`` evenly strided samples), built ``block`` subset samples at a time: the block's
    Jacobians (``cols`` at a time, at most the operator's Jacobian batch), then one pass over every
    device's rows contracting each row chunk's Jacobian (derived a Jacobian batch at a time:
    :attr:`~vmcgrad.NTKOperator.jacobian_batch`, None for the whole chunk) with them, written into
    the block's columns (a loop over the blocks carrying :math:`C`; the last block starts at
    ``r - b``, overlapping the one before where ``b`` does not divide ``r``)."""
    prob, mode = op.problem, op.mode
    n = prob.n
    b = max(1, min(block, rank))
    f = rows_fun(op._fun(), mode, op.params)
    theta = theta_of(mode, op.params)
    samples = unsplit_explicit(op.samples)
    shift = mean_jacobian(f, theta, samples, n, mode, cols)
    idx = (jnp.arange(rank) * n) // rank
    split = jacobian_split(prob)

    def block_columns(start):
        at = jax.lax.dynamic_slice_in_dim(idx, start, b)
        subset = jax.tree.map(lambda a: a[at], samples)
        at_once = jacobian_batch(min(cols, b), op.jacobian_batch, split)
        js = jax.lax.stop_gradient(jacobian(f, theta, subset, mode, at_once, shift))
        chunk = _partial_chunk(mode, split, op.jacobian_batch)
        _, c = map_reduce_problem(prob, op.inputs, chunk, (js, REPLICATED), (shift, REPLICATED))
        return unsplit_explicit(c)

    blocks = -(-rank // b)
    if blocks == 1:
        return block_columns(0), idx
    shape = jax.eval_shape(block_columns, 0)
    c = jnp.zeros((*shape.shape[:2], rank, shape.shape[3]), shape.dtype)

    def body(i, c):
        start = jnp.minimum(i * b, rank - b)
        return jax.lax.dynamic_update_slice_in_dim(c, block_columns(start), start, axis=2)

    return jax.lax.fori_loop(0, blocks, body, c), idx


def build(op: Any, rank: int, cols: int, block: int | None = None) -> Nystrom:
    """The preconditioner of ``op`` (an :class:`~vmcgrad.NTKOperator` at a concrete chunk, traced)
    from ``rank`` evenly strided samples, their Jacobians taken ``block`` at a time (:func:`columns`;
    None: all at once) and ``cols`` at a time within a block."""
    n, k = op.problem.n, k_of(op.mode)
    c, idx = columns(op, rank, cols, rank if block is None else block)
    w = c[idx].reshape(rank * k, rank * k)  # W = J̃_S J̃_S^†: C's rows at the subset
    w = 0.5 * (w + jnp.conj(w).T)
    c = (c - jnp.mean(c, axis=0, keepdims=True)).reshape(n * k, rank * k)  # Q C
    eps = jnp.finfo(w.dtype).eps
    sigma, v = jnp.linalg.eigh(w)
    keep = sigma > jnp.max(sigma) * rank * k * eps
    f_mat = (c @ v) * jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, sigma, 1.0)), 0.0) / jnp.sqrt(n)
    q, r = jnp.linalg.qr(f_mat)
    u, s, _ = jnp.linalg.svd(r)
    theta_vals = s**2
    kept = s > jnp.max(s) * jnp.sqrt(eps)
    lam = op.diag_shift
    smallest = jnp.min(jnp.where(kept, theta_vals, jnp.inf))
    rest = 1.0 / (smallest + lam)
    scale = jnp.where(kept, 1.0 / (theta_vals + lam), rest)  # a dropped direction: the complement's
    return Nystrom(z=q @ u, scale=scale.astype(c.dtype), rest=rest.astype(jnp.finfo(c.dtype).dtype))


def _partial_chunk(mode: str, split: int, batch: int | None):
    def chunk(fun, params, x, w, js, shift):
        return nystrom_chunk(fun, params, x, w, js, shift, mode=mode, split=split, batch=batch)

    return chunk
