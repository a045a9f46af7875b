"""The one per-device runner: the chunked primitive's lowering runs here, and its result is reduced once.

:func:`run_on` (called by :mod:`vmcgrad._runner.primitive`'s lowering, the only caller) does, for every
estimator:

1. pads the sample-shaped arguments to a multiple of the device count (copies of the last row);
2. runs the loop inside ``jax.shard_map`` over the sample axis (or directly, on one device), after
   all-gathering parameter-sharded leaves once;
3. hands it a :class:`~vmcgrad._chunks.plan.Chunks` — the chunk plan of this device's rows and
   the row weights rule (:mod:`vmcgrad._chunks.plan`);
4. reduces the summed outputs once after the loop (``psum``, or ``psum_scatter`` for split leaves),
   and returns the per-sample outputs split over the devices (cut to N rows) and the per-chunk
   outputs one slot per chunk.

A feature added here (a layout, a precision rule, a placement) holds for every estimator.

**Typing of the body.** The body is run with ``check_vma=False``: values inside are not typed by
which mesh axes they vary over. Models that branch on data (``lax.cond`` in equinox's runtime checks,
e.g. NetKet's ``LogStateVector``) otherwise fail with "cond branches must have equal output types"
when one branch returns a constant (not varying) and the other a sample-dependent value. Without the
typing JAX also inserts no implicit "invariant -> varying" cast on a replicated parameter, hence no
all-reduce in its pullback: that is what keeps the reduction out of the loop and lets the one
reduction after it be the only one. (A typed body would need an explicit
``jax.lax.pcast(p, axis, to="varying")`` of the replicated leaves before the loop to move that
all-reduce out of it; netket#2228.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._chunks.plan import Chunks, Space, acc_dtype, put_block, slice_rows, update_rows
from vmcgrad._problem.sharding import gather, pad_to_devices, reduce, specs, unsplit_explicit
from vmcgrad._runner.body import Body, Operands, Outputs
from vmcgrad._runner.refs import PullbackJaxprs, pull_chunk

#: Placements: one row per sample (padded, split, cut back to N on the way out); replicated (a
#: placement of :func:`vmcgrad._runner.primitive.map_reduce_problem`'s arguments, which passes it here as a
#: layout of no split leaves); and one slot per chunk (every device's chunks along axis 0, in device
#: order: split like the devices, never padded, gathered, reduced or cut; how kept linearisations
#: travel, see vmcgrad._runner.primitive).
SAMPLES, REPLICATED, CHUNKS = "samples", "replicated", "chunks"


def run_on(space: Space, body: Any, *args: tuple[Any, Any], out: tuple) -> tuple:
    """Runs ``body(chunks, *values) -> results`` on every device's rows and reduces the sums once.

    Args:
        space: the rows and how each device walks them.
        body: this device's pass; ``chunks`` is its :class:`~vmcgrad._chunks.plan.Chunks`. It returns a
            tuple, one element per entry of ``out``.
        *args: ``(value, placement)`` pairs: placement :data:`SAMPLES` (one row per sample, padded
            and split like the samples), :data:`CHUNKS` (one slot per chunk, split into equal
            blocks along axis 0), or a layout tuple (one entry per leaf: the split dimension or
            None; split leaves are all-gathered before the loop, the others are replicated).
        out: how each element of the result leaves the devices: a :class:`Laid` (reduce-scatter
            split leaves, psum the rest), :data:`SAMPLES` (no reduction: a per-row result, split
            like the samples and cut to the N real rows) or :data:`CHUNKS` (no reduction: each
            device's slots, concatenated along axis 0).

    Returns:
        The tuple of results, reduced (or per sample / per chunk), outside ``shard_map``.
    """
    where = space.where
    kinds = [k for _, k in args]
    values = [pad_to_devices(v, where) if k == SAMPLES and jax.tree.leaves(v) else v for v, k in args]

    def local(*values):
        values = [_enter(v, k, where) for v, k in zip(values, kinds)]
        first = 0 if where is None else jax.lax.axis_index(where.axis) * space.n_local
        devices = 1 if where is None else where.size
        chunks = Chunks(space.plan, first, space.n, devices)
        return tuple(_leave(r, o, where) for r, o in zip(body(chunks, *values), out))

    if where is None:
        result = local(*values)
    else:
        in_specs = tuple(_spec(v, k, where) for v, k in zip(values, kinds))
        out_specs = tuple(_out_spec(o, where) for o in out)
        mapped = jax.shard_map(
            local, mesh=where.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        if AxisType.Explicit in where.mesh.axis_types:
            # Explicit axes: shard_map takes inputs typed as its in_specs (replicated samples under an
            # Explicit mesh, or samples just padded to the device count): reshard them.
            values = tuple(_reshard(v, s, where.mesh) for v, s in zip(values, in_specs))
        result = mapped(*values)
    return tuple(_cut(r, space.n) if o == SAMPLES else r for r, o in zip(result, out))


def _per_row(kind: Any) -> bool:
    """Whether a placement is split along the sample axis as it is (:data:`SAMPLES`, :data:`CHUNKS`)."""
    return isinstance(kind, str) and kind in (SAMPLES, CHUNKS)


def _leave(result: Any, out: Any, where: Any) -> Any:
    """A body result leaving the devices: reduced once, or (per-sample, per-chunk) as it is."""
    if _per_row(out) or not jax.tree.leaves(result):
        return result
    return reduce(result, out.layout, where)


def _enter(value: Any, kind: Any, where: Any) -> Any:
    """An argument inside the body: split ones as they are, parameter-sharded leaves gathered."""
    return value if _per_row(kind) else gather(value, kind, where)


def _spec(value: Any, kind: Any, where: Any) -> Any:
    return P(where.axis) if _per_row(kind) else specs(value, kind, where)


class Laid(NamedTuple):
    """An output placement: a result with the structure of ``like``, its leaves laid out by ``layout``
    (split leaves are reduce-scattered back to their shards, the rest all-reduced)."""

    like: Any
    layout: tuple


def _out_spec(out: Any, where: Any) -> Any:
    return P(where.axis) if _per_row(out) else specs(out.like, out.layout, where)


def _reshard(tree: Any, spec: Any, mesh: Any) -> Any:
    """``tree`` resharded to ``spec`` (a prefix of it) on ``mesh``: a ``NamedSharding``, not a bare spec,
    since a program that a transformation rule lowers has no context mesh."""
    is_spec = lambda s: isinstance(s, P)

    def put(s, sub):
        return jax.tree.map(lambda x: jax.sharding.reshard(x, NamedSharding(mesh, s)), sub)

    return jax.tree.map(put, spec, tree, is_leaf=is_spec)


def _cut(x: Any, n: int) -> Any:
    """The first ``n`` rows of a per-sample result padded to the device count (gathered first on
    Explicit axes, where slicing a sharded axis unevenly is a type error)."""

    def cut(a):
        return a if a.shape[0] == n else unsplit_explicit(a)[:n]

    return jax.tree.map(cut, x)


def device_pass(body: Body, pullback: PullbackJaxprs | None, ops: Operands, chunks: Chunks) -> Outputs:
    """One device's pass: a ``while_loop`` over chunks; sums into ref accumulators, rows and
    per-chunk slots into the carry.

    A ``while_loop`` over an int32 counter, not a ``scan``: a scan's index array costs temp memory,
    and the loop is never differentiated (the primitive's rules act instead). Rows of weight False
    keep the buffer's earlier value (an earlier chunk's, or zeros for padded rows, which are cut).
    Per-chunk operands are read at the chunk's index ``k`` on their leading axis, and chunk ``k``
    writes slot ``k`` of each per-chunk output. Sums given as a pullback are written by
    ``f_vjp.with_refs(*accumulators)`` (:func:`vmcgrad._runner.refs.pull_chunk`), every leaf a whole
    ref (jax#32468, and a ref view under ``jit`` accumulates nothing); other sums by
    ``acc[...] += part``.

    Returns:
        The sums (at the accumulation dtype), the per-sample outputs (``n_local`` rows) and the
        per-chunk ones (one slot per chunk of this device).
    """
    avals = body.out_avals
    accs = [jax.new_ref(jnp.zeros(a.shape, acc_dtype(a.dtype))) for a in avals.sums]
    size, one, count = chunks.plan.size, chunks.plan.count == 1, chunks.plan.count
    # where every chunk's rows all count, the per-sample outputs are written block by block (chunk k
    # is block k of (count, size, ...)): no earlier rows to keep, no row offset to compute
    every_row = chunks.every_row
    rows_shape = (count, size) if every_row else (chunks.plan.n,)
    bufs = [jnp.zeros((*rows_shape, *a.shape[1:]), a.dtype) for a in avals.maps]
    slots = [jnp.zeros((count, *a.shape), a.dtype) for a in avals.slots]
    assert pullback is None or not ops.chunks, "the pullback form reads no per-chunk operands"

    def step(carry):
        k, bufs, slots = carry
        *chunk, w = chunks.take(k, *ops.samples, dtype=jnp.bool_)
        if pullback is None:
            own = tuple(
                jax.lax.dynamic_index_in_dim(a, k, keepdims=False, allow_negative_indices=False)
                for a in ops.chunks
            )
            out = body(Operands(ops.rep, tuple(chunk), own), w)
            for acc, part in zip(accs, out.sums):
                acc[...] += part.astype(acc.dtype)
        else:
            out = pull_chunk(accs, pullback, ops.rep, chunk, ops.samples, chunks, k, w)
        if one:  # its rows are the output: no earlier chunk's to keep, and padded rows are cut
            new = list(out.maps)
        elif every_row:
            new = [put_block(buf, rows, k) for buf, rows in zip(bufs, out.maps)]
        else:
            start = chunks.start(k)
            new = []
            for buf, rows in zip(bufs, out.maps):
                old = slice_rows(buf, start, size)
                keep = w.reshape((size,) + (1,) * (rows.ndim - 1))
                new.append(update_rows(buf, jnp.where(keep, rows, old), start))
        new_slots = [put_block(slot, x.astype(slot.dtype), k) for slot, x in zip(slots, out.slots)]
        return k + 1, new, new_slots

    carry = (jnp.int32(0), bufs, slots)
    if one:  # no loop, so that the chunk's rows are the output, not copied into a buffer of it
        _, bufs, slots = step(carry)
    else:
        _, bufs, slots = jax.lax.while_loop(lambda c: c[0] < chunks.plan.count, step, carry)
        if every_row:
            bufs = [buf.reshape(chunks.plan.n, *buf.shape[2:]) for buf in bufs]
    return Outputs(tuple(jax.ref.freeze(a) for a in accs), tuple(bufs), tuple(slots))
