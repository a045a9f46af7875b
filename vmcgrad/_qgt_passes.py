r"""The sample passes behind :class:`~vmcgrad.QGTOperator`, each one ``lax.scan`` per device.

All passes work on the representation :math:`\tilde\theta` of the parameters (see
:mod:`vmcgrad._qgt_modes`) and a function :math:`g(\tilde\theta, x)` of a batch, and return this
device's *un-reduced* sums; the caller adds the one ``psum``. Rows carry a weight (1 for a sample,
0 for a row padded to make the global count divisible by the devices, computed per chunk from
:class:`Rows`); rows an earlier chunk already covered (``fresh`` False) get weight 0 too.

- :func:`mean_pass`: :math:`\sum_i O_i` (real and imaginary parts by two pullbacks of one
  linearisation when the output is complex and :math:`\tilde\theta` real).
- :func:`product_pass`, the fused product: per chunk, one ``jax.linearize`` gives
  :math:`w_i = O_i v - \bar O\cdot v` and the transpose of the same linear map gives
  :math:`\sum_i \overline{O_i}\, w_i` (for a real :math:`\tilde\theta`, JAX's transpose of a
  real-to-complex map takes the real part, which is :math:`\mathrm{Re}\,O^\dagger w`). As
  :math:`\sum_i \Delta O_i = 0`, :math:`O^\dagger \Delta w = \Delta O^\dagger \Delta O v`.
- :func:`jacobian_pass`: per chunk, the chunk's rows of :math:`\Delta O` (one vmapped per-sample
  pullback) reduced to the diagonal :math:`\sum_i |\Delta O_{ik}|^2` or the full
  :math:`\Delta O^\dagger \Delta O` (for ``to_dense``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ._chunking import ChunkPlan, chunk_start, for_each_chunk, take_chunk


class Rows(NamedTuple):
    """Where this device's samples sit: global index of its first row, and the global count N.

    Rows at or past N were padded to divide the samples over the devices; they get weight 0.
    """

    first: Any
    n: int
    dtype: Any


def _chunk(samples: Any, rows: Rows, plan: ChunkPlan, k: jax.Array) -> tuple[Any, jax.Array]:
    """Chunk ``k`` and its row weights: 1, or 0 for padded rows and rows an earlier chunk covered."""
    x, fresh = take_chunk(samples, plan, k)
    index = rows.first + chunk_start(plan, k) + jnp.arange(plan.size)
    return x, (fresh & (index < rows.n)).astype(rows.dtype)


def _refs_like(tree: Any) -> Any:
    return jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), tree)


def _add_into(refs: Any, values: Any) -> None:
    for ref, val in zip(jax.tree.leaves(refs), jax.tree.leaves(values)):
        ref[...] += val


def _freeze(refs: Any) -> Any:
    return jax.tree.map(jax.ref.freeze, refs)


def split_imag(theta: Any, out_dtype: Any) -> bool:
    """Whether :math:`O` is complex over a real :math:`\\tilde\\theta` (needs two pullbacks)."""
    real_theta = all(not jnp.issubdtype(p.dtype, jnp.complexfloating) for p in jax.tree.leaves(theta))
    return real_theta and jnp.issubdtype(out_dtype, jnp.complexfloating)


def mean_pass(g: Callable, theta: Any, samples: Any, rows: Rows, plan: ChunkPlan, out_dtype) -> Any:
    """This device's :math:`\\sum_i w_i O_i` (complex where :math:`O` is)."""
    two = split_imag(theta, out_dtype)
    acc_re = _refs_like(theta)
    acc_im = _refs_like(theta) if two else None

    def body(k):
        x, wt = _chunk(samples, rows, plan, k)
        _, f_vjp = jax.vjp(lambda p: g(p, x), theta)
        f_vjp.with_refs(acc_re)(wt.astype(out_dtype))
        if two:
            f_vjp.with_refs(acc_im)((-1j * wt).astype(out_dtype))

    for_each_chunk(body, plan)
    if not two:
        return _freeze(acc_re)
    return jax.tree.map(jax.lax.complex, _freeze(acc_re), _freeze(acc_im))


def product_pass(
    g: Callable, theta: Any, samples: Any, rows: Rows, plan: ChunkPlan, obar: Any, v: Any
) -> Any:
    """This device's :math:`\\sum_i \\overline{O_i}\\,w_i (O_i v - \\bar O\\cdot v)` (real part for a real
    :math:`\\tilde\\theta`): one linearisation per chunk, its jvp and its transpose."""
    obar_v = sum(jnp.sum(o * t) for o, t in zip(jax.tree.leaves(obar), jax.tree.leaves(v)))
    acc = _refs_like(theta)

    def body(k):
        x, wt = _chunk(samples, rows, plan, k)
        _, f_jvp = jax.linearize(lambda p: g(p, x), theta)
        dw = (f_jvp(v) - obar_v) * wt
        (ct,) = jax.linear_transpose(f_jvp, theta)(jnp.conj(dw))
        _add_into(acc, ct)

    for_each_chunk(body, plan)
    return _freeze(acc)


def jacobian_rows(g: Callable, theta: Any, x: Any, out_dtype) -> jax.Array:
    """The chunk's Jacobian as a ``(chunk, D)`` matrix of flat representation rows."""
    two = split_imag(theta, out_dtype)

    def row(xi):
        batch = jax.tree.map(lambda a: a[None], xi)
        out, f_vjp = jax.vjp(lambda p: g(p, batch), theta)
        one = jnp.ones_like(out)  # like the output: device-varying inside shard_map
        (re,) = f_vjp(one)
        flat_re = ravel_pytree(re)[0]
        if not two:
            return flat_re
        (im,) = f_vjp(-1j * one)
        return jax.lax.complex(flat_re, ravel_pytree(im)[0])

    return jax.vmap(row)(x)


def jacobian_pass(
    g: Callable,
    theta: Any,
    samples: Any,
    rows: Rows,
    plan: ChunkPlan,
    obar: Any,
    out_dtype,
    *,
    dense: bool,
    zeros: jax.Array,
) -> jax.Array:
    """This device's :math:`\\sum_i w_i |\\Delta O_{ik}|^2` (``dense=False``, shape ``(D,)``) or
    :math:`\\sum_i w_i \\Delta O_i^\\dagger \\Delta O_i` (``dense=True``, ``(D, D)``; its real part
    for a real :math:`\\tilde\\theta`). ``zeros`` is the device-varying accumulator to start from."""
    obar_flat = ravel_pytree(obar)[0]
    real_rep = all(not jnp.issubdtype(p.dtype, jnp.complexfloating) for p in jax.tree.leaves(theta))
    acc = jax.new_ref(zeros)

    def body(k):
        x, wt = _chunk(samples, rows, plan, k)
        d = (jacobian_rows(g, theta, x, out_dtype) - obar_flat) * wt[:, None]
        if dense:
            s = d.conj().T @ d
            acc[...] += s.real if real_rep else s
        else:
            acc[...] += jnp.sum((d * d.conj()).real, axis=0)

    for_each_chunk(body, plan)
    return jax.ref.freeze(acc)


def linearize_pass(g: Callable, theta: Any, samples: Any, rows: Rows, plan: ChunkPlan, vary: Callable):
    """Every chunk's linearisation, kept: ``(residuals, weights, treedef)``.

    ``residuals`` are the array leaves of each chunk's ``jax.linearize`` function, stacked along a
    new leading chunk axis (``vary`` makes them device-varying so that they can leave
    ``shard_map`` split over the devices); ``treedef`` rebuilds a chunk's linear map from its slice.
    """
    box = {}

    def step(_, k):
        x, wt = _chunk(samples, rows, plan, k)
        _, f_jvp = jax.linearize(lambda p: g(p, x), theta)
        leaves, box["treedef"] = jax.tree.flatten(f_jvp)
        return None, ([vary(leaf) for leaf in leaves], wt)

    _, (residuals, wts) = jax.lax.scan(step, None, jnp.arange(plan.count))
    return residuals, wts, box["treedef"]


def cached_product_pass(
    treedef: Any, residuals: list, wts: jax.Array, theta: Any, obar: Any, v: Any, count: int
) -> Any:
    """:func:`product_pass` from kept linearisations: the tangent and transpose only, no forward."""
    obar_v = sum(jnp.sum(o * t) for o, t in zip(jax.tree.leaves(obar), jax.tree.leaves(v)))
    acc = _refs_like(theta)

    def step(_, k):
        f_jvp = treedef.unflatten([jax.lax.dynamic_index_in_dim(r, k, keepdims=False) for r in residuals])
        dw = (f_jvp(v) - obar_v) * wts[k]
        (ct,) = jax.linear_transpose(f_jvp, theta)(jnp.conj(dw))
        _add_into(acc, ct)
        return None, None

    jax.lax.scan(step, None, jnp.arange(count))
    return _freeze(acc)
