r"""The dense centred kernel of :class:`vmcgrad.NTKOperator` in blocks, and its dense solve.

:func:`dense_program` makes one pass over each device's rows, ``c`` at a time. For a chunk of rows the
chunk's Jacobian :math:`J_{[k]}` (``c K × P``) is taken, then an inner loop walks the N samples
(gathered once, before the pass) ``b`` columns at a time, ``b`` the chunk's Jacobian batch
(:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`: the whole chunk, or the largest batch that fits the
budget; all N for one block), taking each
column block's Jacobian and the block :math:`U_{[k][l]} = (J_{[k]} - \mathbf 1 s^T)(J_{[l]} - \mathbf 1
s^T)^\dagger`, only for the column blocks on or above the diagonal (from the one holding the chunk's
first counted row). A column block whose samples are rows of the chunk itself, in order, takes their
Jacobians from the rows instead of deriving them. The uncentred kernel is Hermitian,
:math:`U_{[l][k]} = U_{[k][l]}^\dagger`, so the blocks below are filled after the pass, by one transpose
of the rows (an all-to-all over the devices). On one device :math:`N + N(N - c)/2c` per-sample
Jacobians are derived (rows, then the columns after each chunk's own). With one block (``c`` ≥ N), N.
The rows' batches and the column blocks are each one trip of the model's derivative, a sequence of
ops whose count does not depend on the batch: on an accelerator, where each op in sequence costs a
fixed time, the fewest, largest batches that fit are the fastest.

Memory: a chunk holds :math:`(c + b) K P` numbers of Jacobians, the model's intermediates for ``b``
samples (rows and columns are derived ``b`` at a time, the shift :math:`s` taken off per batch), and the
device's :math:`N_\text{local} K \times NK` rows and the buffer of their transpose (which XLA may reuse,
see ``benchmarks/bench_minsr.py``). ``chunk_size="auto"`` picks the largest chunk whose compiled program
fits the budget (:func:`choose_dense`: one block at the largest batch that fits, or for the update on an
accelerator the Jacobian kept over the fewest chunks that fit, else the powers of two at the whole
chunk, then fewer larger chunks at the batch those fixed), the N×N kernel and, in
:func:`vmcgrad.minsr_update`, its factor and pullback (one vjp pass at the chunk) included. A chunk
given (the budget is for ``"auto"``) derives its Jacobians at once. No collective runs per block.
:math:`s` is NetKet's mean-Jacobian estimate (32 evenly strided samples): it does not change the centred
kernel in exact arithmetic, and keeps its small eigenvalues in float32 (taken over at most ``c``
samples, so that no model call exceeds the chunk). The centring follows, as row and column means of the
blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._chunks.budget import Choice
from vmcgrad._chunks.default_budget import budget_or_default
from vmcgrad._problem.problem import Problem, auto_choice, auto_knob
from vmcgrad._problem.sharding import explicit_sharding, unsplit_explicit
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import REPLICATED, SAMPLES
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


def column_chunk(prob: Problem, batch: int | None = None) -> int:
    """Columns per block: all N for one block (a chunk of at least N rows), else the chunk's Jacobian
    batch (:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`: ``batch``, or the whole chunk): a column
    block's Jacobians are derived at once, so a block as wide as a batch holds the intermediates the
    rows' batches hold, no more."""
    c = prob.plan.size
    return prob.n if c >= prob.n else jacobian_batch(c, batch, jacobian_split(prob))


#: The programs whose dense route keeps every sample's Jacobian over chunks too, not only in one block
#: (:func:`vmcgrad.minsr_update`'s: :func:`keeps_jacobian`), for which
#: :func:`choose_dense` searches such chunks.
KEPT_JACOBIAN_PROGRAMS: set = set()


def choose_dense(program: Any, prob: Problem, op: Any, *args: Any) -> tuple[int, tuple]:
    r"""``chunk_size="auto"`` for a program built on the dense kernel (the ``choose`` of
    :func:`vmcgrad._problem.problem.call`): ``(chunk, (op, *args))``, the operator's Jacobian batch fixed.

    Two knobs, searched apart, each the largest whose compiled program fits the budget: the chunk
    :math:`c` sets how often column Jacobians are derived again, :math:`N + N(N - c)/2c`, and the
    Jacobian batch :math:`b` how many samples' intermediates are held, and how many ops in sequence
    the program runs (each batch of rows and each column block :math:`b` wide is one trip of the
    model's derivative, whatever :math:`b`): fewer, larger batches and chunks both mean fewer ops.

    1. One block of every sample (one device holding them all, and their Jacobian, :math:`NKP`
       numbers, within the budget). On a CPU (the chunk's Jacobians in parts,
       :func:`~vmcgrad._sr.ntk.modes.jacobian_split` > 1), or for a program that keeps the Jacobian
       in one block only: the largest batch :math:`b` among the powers of two up to the platform's
       part of the block (:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`: N on an accelerator, N/16
       on a CPU) and that part itself. :func:`vmcgrad.minsr_update` then keeps the
       Jacobian (N per-sample Jacobians, no mean-Jacobian estimate, no pullback pass).
       For a program of :data:`KEPT_JACOBIAN_PROGRAMS` (the update's, which keeps the Jacobian over
       chunks too) on an accelerator (each chunk's Jacobians at once), the chunks instead
       (:func:`_kept_choice`): every trip count's smallest chunk :math:`\lceil N/t \rceil`, one
       block (:math:`t = 1`) first, the Jacobian kept, the last chunk shifted back: a chunk holds
       what one block at that batch holds, but its trips are any :math:`\lceil N/c \rceil`, not only
       :math:`N/b` for a power of two :math:`b`; the largest that fits (the budget's search, its
       line from the bytes every chunk holds, the Jacobian and the kernel: where one block is over
       the budget, its second probe lands near the answer). With K > 1 components ('complex'
       mode), the larger chunks with the components' pullbacks in turn
       (:attr:`~vmcgrad.NTKOperator.components_in_turn`: a sample's reverse-pass intermediates held
       for one component at a time, so up to K times the samples a trip, each trip one forward and
       K reverse passes in sequence) are searched the same way (the first probe at K times the room
       the first search measured, :func:`_predicted_chunks`), and taken where their program's
       modelled time is less. Where not even one sample per chunk fits so, item 2.
    2. Else (one block, or one kept chunk, fits nowhere) the powers of two for :math:`c` at the
       platform's batch (:math:`b = c` on an accelerator, the whole chunk at once; :math:`c/16` on a
       CPU); the largest that fits,
       :math:`c^*`, fixes its batch :math:`b^*`. With :math:`b^*` held, a chunk's bytes grow only
       by its rows' Jacobians, so fewer and larger chunks may still fit: the candidates
       :math:`\lceil N_\text{local}/m \rceil` for :math:`m` = 1 to the count of :math:`c^*` are searched
       at :math:`b^*`, and the largest that fits is taken (at worst :math:`c^*` itself). These
       chunks do not keep the Jacobian (:attr:`~vmcgrad.NTKOperator.keep_jacobian` False): a chunk at
       a batch holds what one block at that batch holds, and one block did not fit.

    An operator whose batch is already fixed is left at it, and searched over the powers of two only.
    """
    chunk, args, _ = dense_choice(program, prob, op, *args)
    return chunk, args


def dense_choice(program: Any, prob: Problem, op: Any, *args: Any) -> tuple[int, tuple, Choice | None]:
    """:func:`choose_dense`'s ``(chunk, args)`` and the record of the search that settled them
    (:class:`vmcgrad._chunks.budget.Choice`: the chosen program's modelled time and cost, and in
    ``compiled`` the programs every search on the way compiled, but for a kept-Jacobian search in
    which no chunk fitted; None for a chunk remembered after an out-of-memory error). Compile only,
    cached."""
    if op.jacobian_batch is not None:
        found = auto_choice(program, prob, op, *args)
        return found.value, (op, *args), found
    budget = budget_or_default(prob.memory_budget)
    if prob.n_local == prob.n and jacobian_bytes(prob, op) <= budget:
        if program in KEPT_JACOBIAN_PROGRAMS and jacobian_split(prob) == 1:
            kept = _kept_choice(program, prob, op, args, budget)
            if kept is not None:
                return kept
        else:
            at = lambda b: (prob.n, (dataclasses.replace(op, jacobian_batch=b), *args))
            # the whole block, or the platform's part of it
            most = jacobian_batch(prob.n, None, jacobian_split(prob))
            batches = sorted({2**i for i in range(most.bit_length())} | {most})
            name = "one block's Jacobian batch"
            one_block = auto_knob(program, prob, (op, *args), batches, at, name=name, info=True)
            if one_block is not None:
                return (*at(one_block.value), one_block)
    # (one block did not fit at any batch: neither does keeping the Jacobian over chunks, whose chunk
    # at the batch b holds what one block at b holds)
    op = dataclasses.replace(op, keep_jacobian=False)
    found = auto_choice(program, prob, op, *args)  # b = c (on an accelerator): the chunk at once
    chunk = found.value
    plan = prob.at_chunk(chunk).plan
    fixed = dataclasses.replace(op, jacobian_batch=jacobian_batch(plan.size, None, jacobian_split(prob)))
    if plan.count == 1:  # the operator compiled (its batch None is the chunk's): the run reuses it
        return chunk, (op, *args), found
    fewer = sorted({-(-prob.n_local // m) for m in range(1, plan.count + 1)})
    first = found
    found = auto_choice(program, prob, fixed, *args, candidates=fewer)
    if found is not None and first is not None:  # (the record counts both searches' compilations)
        found = found._replace(compiled=first.compiled + found.compiled)
    return found.value, (fixed, *args), found


def _kept_choice(program: Any, prob: Problem, op: Any, args: tuple, budget: float):
    r"""Item 1 of :func:`choose_dense` (one device holds every sample, an accelerator, a program of
    :data:`KEPT_JACOBIAN_PROGRAMS`): ``(chunk, (op, *args), choice)``, or None where not even one
    sample per chunk fits with the Jacobian kept. Two searches, each over the chunks
    :math:`\lceil N/t \rceil`: the components at once (from one block, :math:`t = 1`, down), then,
    with K > 1 components, in turn at the chunks above the first's (taken where its modelled time is
    less). Both lines start at the bytes every candidate holds, the Jacobian and the kernel
    (``held``), so that a search that compiled one block and found it over the budget lands its
    second probe near the answer; the one in turn opens at K times the room the first measured
    (:func:`_predicted_chunks`). ``choice.compiled`` counts both searches' compilations."""
    n, k = prob.n, k_of(op.mode)
    held = jacobian_bytes(prob, op) + (n * k) ** 2 * jnp.dtype(op.dtype).itemsize
    kept = dataclasses.replace(op, jacobian_batch=None, keep_jacobian=True)
    at_once = _kept_chunk(program, prob, kept, args, 0, n + 1, "", held=held)
    if at_once is None:
        return None
    best, in_turn = at_once, None
    once, chunk = at_once[0], at_once[1][0]
    if k > 1 and chunk < n:  # a sample's bytes in turn are at least 1/K of its bytes at once
        turn = dataclasses.replace(kept, components_in_turn=True)
        first = _predicted_chunks(once, chunk, budget, k)
        what = ", components in turn"
        in_turn = _kept_chunk(program, prob, turn, args, chunk, n + 1, what, first, held)
        timed = lambda f: math.inf if f is None or f[0].seconds is None else f[0].seconds
        best = in_turn if timed(in_turn) < timed(best) else best
    choice, (chunk, at_args) = best
    spent = sum(f[0].compiled for f in (at_once, in_turn) if f is not None)
    return chunk, at_args, choice._replace(compiled=spent)


def _predicted_chunks(found: Choice, c: int, budget: float, k: int) -> float | None:
    r"""Where the kept Jacobian's chunks with the K components in turn cross the budget, predicted
    from the search at once (``found``, which chose chunk :math:`c`; its ``probes``): the straight
    line :math:`F + s c` through the bytes at :math:`c` and at the smallest chunk over the budget
    crosses it at :math:`(B - F)/s`; in turn a sample's bytes are at least :math:`s/K` (its forward
    pass's residuals held once, its reverse pass's for one component), so their chunks cross it at
    most at :math:`K(B - F)/s`. None where the probes do not give the line. The search in turn
    compiles the largest chunk at most that first (:func:`vmcgrad._chunks.budget.choose_chunk`'s
    ``first``)."""
    measured = dict(found.probes)
    over = [b for b, m in measured.items() if b > c and m > budget]
    if c not in measured or not over:
        return None
    c2 = min(over)
    slope = (measured[c2] - measured[c]) / (c2 - c)
    if slope <= 0:
        return None
    return k * (budget - (measured[c] - slope * c)) / slope


def _kept_chunk(
    program: Any,
    prob: Problem,
    op: Any,
    args: tuple,
    above: int,
    below: int,
    what: str,
    first: float | None = None,
    held: int = 0,
):
    """``(choice, (chunk, (op, *args)))`` of the largest chunk strictly between ``above`` and ``below``
    whose program, the Jacobian kept (``op``), fits the budget, or None: each trip count's smallest
    chunk a candidate (one trip fewer is one trip of the model's derivative saved), the budget's
    search compiling a few of them (:func:`vmcgrad._problem.problem.auto_knob`), the one at most
    ``first`` (:func:`_predicted_chunks`) first, its line from ``held`` bytes."""
    n = prob.n
    chunks = sorted(
        {c for t in range(1, -(-n // max(above, 1)) + 1) if above < (c := _chunk_of(n, t)) < below}
    )
    if not chunks:
        return None
    at_kept = lambda c: (c, (op, *args))
    name = "the kept Jacobian's chunk" + what
    found = auto_knob(
        program, prob, (op, *args), chunks, at_kept, name=name, info=True, first=first, held=held
    )
    return None if found is None else (found, at_kept(found.value))


def _chunk_of(n: int, trips: int) -> int:
    """The smallest chunk that walks ``n`` rows in ``trips`` trips."""
    return -(-n // max(1, trips))


def jacobian_bytes(prob: Problem, op: Any) -> int:
    """Bytes of every sample's Jacobian, :math:`NKP` entries: what one block keeps."""
    split = op.mode != "holomorphic"
    p = sum(x.size * (2 if split and jnp.iscomplexobj(x) else 1) for x in jax.tree.leaves(op.params))
    return prob.n * k_of(op.mode) * p * jnp.dtype(op.dtype).itemsize


def keeps_jacobian(prob: Problem, op: Any) -> bool:
    """Whether the dense route of :func:`vmcgrad.minsr_update` (a program of
    :data:`KEPT_JACOBIAN_PROGRAMS`) keeps every sample's Jacobian at ``prob``'s chunk
    (:func:`vmcgrad._sr.ntk.minsr._whole_jacobian`): one device's rows are all N, and either one
    chunk holds them, or the operator allows it over chunks
    (:attr:`~vmcgrad.NTKOperator.keep_jacobian`: not for the blocks' candidates of ``"auto"``)
    and the Jacobian, :math:`NKP` numbers, fits the memory budget (the default budget where none was
    given). Kept, the N per-sample Jacobians are derived once each, as NetKet's ``srt`` does at any
    chunk; the blocks derive each column block again per chunk of rows above it, a mean-Jacobian
    estimate and a pullback pass besides."""
    if prob.n_local != prob.n:
        return False
    if prob.plan.count == 1:
        return True
    return op.keep_jacobian and jacobian_bytes(prob, op) <= budget_or_default(prob.memory_budget)


def row_chunk(prob: Problem) -> int:
    """Rows per chunk (at most N)."""
    return min(prob.plan.size, prob.n)


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
    split: int,
    batch: int | None = None,
) -> tuple[tuple, jax.Array]:
    r"""One chunk of rows of the uncentred kernel on and above the diagonal: ``(c, K, N, K)``.

    With :math:`\tilde J_i = J_i - s` (``shift`` the mean-Jacobian estimate :math:`s`), the entries
    :math:`U_{r a, s b} = \tilde J_{r a} \tilde J_{s b}^\dagger` of the chunk's rows :math:`r` are taken
    for the column blocks of ``cols`` samples (``all_x``: all samples, padded to a multiple of ``cols``)
    from the one holding :math:`r_0`, the smallest global index ``index`` of a counted row
    (``w > 0``), to the last: every entry with :math:`s \ge r` of a counted row, and the blocks before
    are left zero (:func:`dense_program` fills :math:`s < r` from :math:`U_{s b, r a} =
    \overline{U_{r a, s b}}`). A column block's Jacobians are derived from its samples, except where
    the chunk's rows hold exactly the block's samples in order (their global ``index`` says so; padded
    rows repeat the last index and never match a block past the last sample): those are reused. A row
    chunk starting at global sample :math:`g` thus derives about :math:`N - g - c` column Jacobians.
    The rows' batches and the column blocks call one ``derive`` (:func:`batch_derivative`), so that
    the model's derivative is lowered once in the chunk.
    """
    theta = theta_of(mode, params)
    k = k_of(mode)
    c = jax.tree.leaves(x)[0].shape[0]
    b = jacobian_batch(c, batch, split)
    derive = batch_derivative(rows_fun(fun, mode, params), mode)
    rows = batched_rows(derive, theta, shift, x, b)
    n_pad = jax.tree.leaves(all_x)[0].shape[0]
    blocks = n_pad // cols
    dtype = jax.tree.leaves(rows)[0].dtype
    if blocks == 1:  # one chunk, one block (c >= N): the chunk's rows are all the samples
        return (), contract(rows, rows, k)[:, :, :n, :]
    # The first block with a column >= the smallest counted row (none for a chunk without one).
    first = jnp.min(jnp.where(w > 0, index, n_pad)) // cols
    offsets = jnp.arange(cols, dtype=index.dtype)

    def block(i, out):
        def derived():
            xc = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * cols, cols), all_x)
            col = derive(theta, shift, xc)  # at once: cols is a Jacobian batch
            return contract(rows, col, k)

        # Block i's samples are rows o .. o + cols of this chunk when the rows' global indices there
        # are exactly i * cols + 0, 1, ... (padded rows repeat the last index, so a block reaching the
        # padding is derived): then their Jacobians are the chunk's own.
        o = jnp.clip(i * cols - index[0], 0, c - cols)
        own_rows = jax.lax.dynamic_slice_in_dim(index, o, cols) == i * cols + offsets
        is_own = jnp.all(own_rows) & (i * cols + cols <= n)
        own = lambda: contract(
            rows, jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(r, o, cols), rows), k
        )
        skip = lambda: jnp.zeros((c, k, cols, k), dtype)
        which = jnp.where(i < first, 0, jnp.where(is_own, 1, 2))
        return jax.lax.dynamic_update_slice_in_dim(
            out, jax.lax.switch(which, (skip, own, derived)), i * cols, axis=2
        )

    # Static bounds (a scan, reverse-differentiable); the blocks before `first` are skipped.
    out = jax.lax.fori_loop(0, blocks, block, jnp.zeros((c, k, n_pad, k), dtype))
    return (), out[:, :, :n, :]


def batch_derivative(f: Callable, mode: str) -> Callable:
    """``derive(theta, shift, xs)``: the per-sample Jacobians of ``f`` at a batch of samples, all at
    once, less ``shift`` (leaves ``(b, K, *leaf)``), as one jitted function: every call at the same
    shapes (the blocked kernel's calls are all at its Jacobian batch b) is one lowering of the
    model's derivative in the program, called from each place (JAX lowers a jitted function once
    per shapes and caches its trace)."""
    return jax.jit(lambda t, s, xs: jacobian(f, t, xs, mode, None, s))


def batched_rows(derive: Callable, theta: Any, shift: Any, x: Any, b: int) -> Any:
    r"""``derive(theta, shift, xs)`` (one batch's per-sample Jacobians, leaves ``(b, K, *leaf)``) over
    the ``c`` samples of ``x``, ``b`` at a time: a loop of :math:`\lceil c/b \rceil` trips (static
    bounds: reverse-differentiable) writing each batch into the rows, the last batch shifted back
    onto the rows before it (they are derived twice, written the same), so that every trip calls
    ``derive`` at one shape, the column blocks' own: the model's derivative is lowered once."""
    c = jax.tree.leaves(x)[0].shape[0]
    if c == b:
        return derive(theta, shift, x)
    trips = -(-c // b)
    first = jax.tree.map(lambda a: a[:b], x)
    out = jax.eval_shape(derive, theta, shift, first)
    rows = jax.tree.map(lambda o: jnp.zeros((c, *o.shape[1:]), o.dtype), out)

    def batch(i, rows):
        start = jnp.minimum(i * b, c - b)
        xs = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, b), x)
        put = lambda r, j: jax.lax.dynamic_update_slice_in_dim(r, j, start, axis=0)
        return jax.tree.map(put, rows, derive(theta, shift, xs))

    return jax.lax.fori_loop(0, trips, batch, rows)


@partial(jax.jit, static_argnums=0)
def dense_program(prob: Problem, op: Any) -> jax.Array:
    op = op._at(prob)
    n, k, mode = prob.n, k_of(op.mode), op.mode
    f = rows_fun(op._fun(), mode, op.params)
    theta = theta_of(mode, op.params)
    cols = column_chunk(prob, op.jacobian_batch)
    samples = unsplit_explicit(op.samples)  # all of them go to every device anyway
    shift = mean_jacobian(f, theta, samples, n, mode, row_chunk(prob))
    n_pad = -(-n // cols) * cols
    all_x = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], n_pad - n, axis=0)]), samples)
    chunk = partial(
        dense_chunk, mode=mode, cols=cols, n=n, split=jacobian_split(prob), batch=op.jacobian_batch
    )
    index = (jnp.arange(n), SAMPLES)
    _, t = map_reduce_problem(prob, op.inputs, chunk, index, (all_x, REPLICATED), (shift, REPLICATED))
    if n_pad > cols:  # (with one column block every chunk took all its columns)
        t = hermitian_fill(t)
    # Centring without a dense centring matrix (NetKet's srt_onthefly): row and column means.
    col_means = t.mean(axis=0, keepdims=True)
    row_means = t.mean(axis=2, keepdims=True)
    t = (t - col_means - row_means + col_means.mean(axis=2, keepdims=True)) / n
    t = flatten(t)
    return (t + op.diag_shift * jnp.eye(n * k, dtype=t.dtype)).astype(op.dtype)


def flatten(t: jax.Array) -> jax.Array:
    """``(N, K, N, K) -> (NK, NK)``, the rows split as ``t``'s (on Explicit axes, stated: JAX does not
    infer the split of a merged dimension)."""
    n, k = t.shape[:2]
    sharding = explicit_sharding(t)
    if sharding is None:
        return t.reshape(n * k, n * k)
    out = NamedSharding(sharding.mesh, P((*sharding.spec, None)[0], None))
    return jax.lax.reshape(t, (n * k, n * k), out_sharding=out)


def hermitian_fill(t: jax.Array) -> jax.Array:
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


def dense_solve(solver: Any, a: jax.Array, b: jax.Array) -> tuple[jax.Array, Any]:
    a, b = unsplit_explicit((a, b))  # Explicit axes: factorisations take unsplit matrices (as NetKet's)
    if solver is None:
        return jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a, lower=True), b), None
    out = solver(a, b)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None
