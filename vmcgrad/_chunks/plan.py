"""Chunks with row weights: how one device walks its samples, and which rows count.

A per-device sample count ``n_local`` and a requested ``chunk_size`` give a :class:`ChunkPlan` of
``count`` chunks of ``size <= chunk_size`` rows each. No divisibility is required and no second copy
of the loop body is compiled for a remainder: chunk ``k`` starts at ``min(k * size, n_local - size)``,
so the last chunk is shifted back onto rows that exist.

**The one rule for which rows count.** Every chunk comes with per-row weights

.. math::

    w_r = \\begin{cases} 1 & \\text{row } r \\text{ is a sample no earlier chunk covered} \\\\
    0 & \\text{row } r \\text{ was padded (global index} \\ge N\\text{) or an earlier chunk covered it}
    \\end{cases}

Rows are padded only to divide N over the devices (see :mod:`vmcgrad._problem.sharding`); the shifted last
chunk re-reads up to ``count - 1`` rows. Every estimator multiplies its per-row quantity by ``w``
(a cotangent, a centred tangent, a Jacobian row), and per-sample outputs keep an earlier chunk's
value where ``w = 0``. Nothing else decides which rows count.

**Rows of weight 0 add an exact zero.** :math:`0 \\cdot \\infty` is NaN, so a re-read or padded
row whose derivative is infinite would turn ``inf`` into NaN. Where the plan has such rows at all
(known statically), a chunk that holds some is walked with each of them replaced by a copy of a
counted row of the same chunk whose derivative is finite, and a chunk with no counted row is
skipped (:func:`vmcgrad._runner.refs._finite_stand_ins`; for the pullbacks of untransformed estimators,
where the sums are pullbacks: ``batched_vjp``, ``expect_grad``, the QGT passes).

**The precision of the sums over chunks.** Chunk results are added at :func:`acc_dtype`, the leaf's
dtype promoted to at least float32 (complex64), whatever the parameters' dtype, so that the chunked
sum is as accurate as one reduction over all samples; results are cast back (:func:`cast_like`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class ChunkPlan(NamedTuple):
    """How ``n`` local rows are walked: ``count`` chunks of ``size`` rows."""

    n: int
    size: int
    count: int


def plan_chunks(n: int, chunk_size: int | None) -> ChunkPlan:
    """Returns the plan for ``n`` rows: the fewest chunks of at most ``chunk_size`` rows.

    The chunks are balanced: ``count = ceil(n / chunk_size)`` chunks of ``ceil(n / count)``
    rows, so the shifted last chunk recomputes fewer than ``count`` rows (4096 samples at
    ``chunk_size=1000`` give 5 chunks of 820, not 5 of 1000 with 904 samples done twice).
    ``chunk_size=None`` or ``>= n`` means one chunk.
    """
    if chunk_size is None or chunk_size >= n:
        return ChunkPlan(n=n, size=n, count=1)
    count = -(-n // chunk_size)
    size = -(-n // count)
    return ChunkPlan(n=n, size=size, count=count)


class Space(NamedTuple):
    """Where the rows live and how each device walks them (static, hashable).

    Attributes:
        where: the sample mesh axis, or None on one device.
        n: N, the global number of real samples.
        n_local: rows per device after padding to the device count.
        chunk_size: rows per chunk on each device, or None for one chunk.
    """

    where: Any
    n: int
    n_local: int
    chunk_size: int | None

    @property
    def plan(self) -> ChunkPlan:
        """How each device walks its ``n_local`` rows (:func:`plan_chunks`)."""
        return plan_chunks(self.n_local, self.chunk_size)


class Chunks(NamedTuple):
    """This device's rows, chunked: the plan, and where the rows sit in the global sample order.

    Attributes:
        plan: the :class:`ChunkPlan` over the ``n_local`` rows of this device.
        first: global index of this device's first row (traced inside ``shard_map``).
        n_total: N, the global number of real samples (rows at or past it are padding).
        devices: how many devices the rows are split over.
    """

    plan: ChunkPlan
    first: Any
    n_total: int
    devices: int = 1

    @property
    def exact(self) -> bool:
        """Whether the chunks tile the ``n_local`` rows exactly (no last chunk shifted back)."""
        return self.plan.count * self.plan.size == self.plan.n

    @property
    def every_row(self) -> bool:
        """Whether every row of every chunk on every device counts (statically: the chunks tile the
        rows, and no device holds padding)."""
        return self.exact and self.plan.n * self.devices == self.n_total

    def start(self, k: jax.Array) -> jax.Array:
        """First local row of chunk ``k``; the last chunk is shifted back to end at ``n_local``
        (where the chunks tile the rows, ``k * size``: no clamp for the loop to compute)."""
        if self.exact:
            return k * self.plan.size
        return jnp.minimum(k * self.plan.size, self.plan.n - self.plan.size)

    def take(self, k: jax.Array, *trees: Any, dtype: Any = jnp.float32) -> tuple[Any, ...]:
        """Chunk ``k`` of every tree (leading axis ``n_local``), and its row weights.

        Returns:
            ``(*chunks, w)`` with ``w`` of shape ``(size,)`` and ``dtype``: 1 for rows that count
            here, 0 for padded rows and rows an earlier chunk covered (the module's one rule).
        """
        if self.exact:  # chunk k is block k of the rows seen as (count, size, ...): no start to compute
            sliced = tuple(jax.tree.map(lambda a: block(a, k, self.plan.count), t) for t in trees)
        else:
            start = self.start(k)
            sliced = tuple(jax.tree.map(lambda a: slice_rows(a, start, self.plan.size), t) for t in trees)
        if self.every_row:  # a constant, which XLA folds into its uses
            return (*sliced, jnp.ones(self.plan.size, dtype))
        start = self.start(k)
        local = start + jnp.arange(self.plan.size)
        real = self.first + local < self.n_total
        if not self.exact:  # rows the shifted last chunk re-reads count in the earlier chunk
            real = real & (local >= k * self.plan.size)
        return (*sliced, real.astype(dtype))


def slice_rows(a: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """Rows ``start .. start + size`` of ``a``: a chunk's start is never negative, so no wrap of a
    negative index is computed (one op less in the loop's body)."""
    return jax.lax.dynamic_slice_in_dim(a, start, size, allow_negative_indices=False)


def blocks(a: jax.Array, count: int) -> jax.Array:
    """``a``'s rows as ``count`` blocks: shape ``(count, rows // count, ...)`` (a reshape, no copy)."""
    return a.reshape(count, a.shape[0] // count, *a.shape[1:])


def block(a: jax.Array, k: jax.Array, count: int) -> jax.Array:
    """Block ``k`` of ``a``'s rows cut into ``count`` equal blocks (:func:`blocks`)."""
    return jax.lax.dynamic_index_in_dim(blocks(a, count), k, keepdims=False, allow_negative_indices=False)


def put_block(a: jax.Array, x: jax.Array, k: jax.Array) -> jax.Array:
    """``a`` with ``a[k] = x`` (``k`` never negative: no wrap computed)."""
    return jax.lax.dynamic_update_index_in_dim(a, x, k, 0, allow_negative_indices=False)


def update_rows(a: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """``a`` with ``rows`` written from row ``start`` on (never negative, as in :func:`slice_rows`)."""
    return jax.lax.dynamic_update_slice_in_dim(a, rows, start, 0, allow_negative_indices=False)


# --- precision: what the sums over chunks are accumulated in -----------------------------------


def acc_dtype(dtype: Any) -> Any:
    """The accumulation dtype of a leaf: its own, promoted to at least float32 (complex64).

    Sums over chunks run at this precision whatever the parameters' dtype (bfloat16, float16), so
    the chunked sum is as accurate as one reduction over all samples; the result is cast back.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.promote_types(dtype, jnp.complex64)
    return jnp.promote_types(dtype, jnp.float32)


def promote(tree: Any) -> Any:
    """``tree`` with every leaf cast to its accumulation dtype (:func:`acc_dtype`)."""
    return jax.tree.map(lambda p: p.astype(acc_dtype(p.dtype)), tree)


def cast_like(tree: Any, like: Any) -> Any:
    """``tree`` cast leaf by leaf to the dtypes of ``like``."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), tree, like)
