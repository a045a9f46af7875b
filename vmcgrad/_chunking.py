"""Chunking: split the local samples into fixed-size chunks walked by one ``lax.scan``.

A per-device sample count ``n`` and a requested ``chunk_size`` give a :class:`ChunkPlan` of
``count`` chunks of ``size`` samples each. No divisibility is required and no second copy of the
loop body is compiled for a remainder: chunk ``k`` starts at ``min(k * size, n - size)``, so the
last chunk is shifted back onto valid samples, and the samples it shares with the previous chunk
are masked out (``fresh`` is False for them). Nothing is padded or copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class ChunkPlan(NamedTuple):
    """How ``n`` local samples are walked: ``count`` chunks of ``size`` samples."""

    n: int
    size: int
    count: int


def plan_chunks(n: int, chunk_size: int | None) -> ChunkPlan:
    """Returns the plan for ``n`` samples; ``chunk_size=None`` or ``>= n`` means one chunk."""
    size = n if chunk_size is None else min(chunk_size, n)
    return ChunkPlan(n=n, size=size, count=-(-n // size))


def chunk_start(plan: ChunkPlan, k: jax.Array) -> jax.Array:
    """First sample of chunk ``k``; the last chunk is shifted back to end at ``n``."""
    return jnp.minimum(k * plan.size, plan.n - plan.size)


def take_chunk(tree: Any, plan: ChunkPlan, k: jax.Array) -> tuple[Any, jax.Array]:
    """Slices chunk ``k`` out of every leaf of ``tree`` (leading axis ``n``).

    Returns:
        ``(chunk, fresh)`` where ``fresh`` is a boolean mask of shape ``(size,)`` that is False
        for the samples an earlier chunk already covered (only possible in the last chunk).
    """
    start = chunk_start(plan, k)
    chunk = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, plan.size), tree)
    fresh = start + jnp.arange(plan.size) >= k * plan.size
    return chunk, fresh


def for_each_chunk(body: Callable[[jax.Array], None], plan: ChunkPlan) -> None:
    """Runs ``body(k)`` for every chunk index in one ``lax.scan`` (bodies act through refs)."""

    def step(carry, k):
        body(k)
        return carry, None

    jax.lax.scan(step, None, jnp.arange(plan.count))


def map_chunks(body: Callable[[Any], jax.Array], plan: ChunkPlan, tree: Any, init: jax.Array) -> jax.Array:
    """Per-sample outputs ``body(chunk)`` for all ``n`` samples, computed chunk by chunk.

    ``init`` is the ``(n,)`` output buffer (zeros, typed like the outputs); it is the scan carry,
    and rows already written by an earlier chunk are kept.
    """

    def step(buf, k):
        chunk, fresh = take_chunk(tree, plan, k)
        start = chunk_start(plan, k)
        old = jax.lax.dynamic_slice_in_dim(buf, start, plan.size)
        new = jnp.where(fresh, body(chunk), old)
        return jax.lax.dynamic_update_slice_in_dim(buf, new, start, 0), None

    buf, _ = jax.lax.scan(step, init, jnp.arange(plan.count))
    return buf
