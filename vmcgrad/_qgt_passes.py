r"""The loop bodies behind :class:`~vmcgrad.QGTOperator`, each run by :func:`vmcgrad._runner.run`.

The chunk functions (``*_chunk``) have the signature ``chunk(fun, params, x, w, *extra) -> (sums, ())``
of :func:`vmcgrad._chunked.map_reduce_problem` and return one chunk's sums (``w`` the row mask); the
primitive walks the chunks and adds the one reduction, and JAX's transformations act on them. The
kept-linearisation bodies (``linearize_body``, ``cached_product_body``) have the runner's signature
``body(fun, params, samples, chunks, *extra)`` and loop themselves. The bodies work on the
representation :math:`\tilde\theta` of the parameters (:mod:`vmcgrad._qgt_modes`) through
:math:`g(\tilde\theta, x) = f(\mathrm{from\_rep}(\tilde\theta), x)`. Rows carry the weights of
:mod:`vmcgrad._chunking` (0 for padded rows and rows an earlier chunk covered).

- :func:`mean_chunk`: :math:`\sum_i w_i O_i` (real and imaginary parts by two pullbacks of one
  linearisation when the output is complex and :math:`\tilde\theta` real).
- :func:`product_chunk`, the fused product: per chunk, one ``jax.linearize`` gives
  :math:`\Delta w_i = w_i (O_i v - \bar O\cdot v)` and the transpose of the same linear map gives
  :math:`\sum_i \overline{O_i}\, \Delta w_i` (for a real :math:`\tilde\theta`, JAX's transpose of a
  real-to-complex map takes the real part, which is :math:`\mathrm{Re}\,O^\dagger w`). As
  :math:`\sum_i w_i \Delta O_i = 0`, :math:`O^\dagger \Delta w = \Delta O^\dagger \Delta O v`.
- :func:`jacobian_chunk`: per chunk, the chunk's rows of :math:`\Delta O` (one vmapped per-sample
  pullback) reduced to the diagonal :math:`\sum_i |\Delta O_{ik}|^2` or the full
  :math:`\Delta O^\dagger \Delta O` (for ``to_dense``).
- :func:`linearize_body` / :func:`cached_product_body`: every chunk's linearisation kept, and the
  product from them without a forward pass (:class:`vmcgrad.LinearizedQGT`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ._chunked import Pullback
from ._qgt_modes import from_rep, to_rep
from ._runner import accumulators, cast_like, freeze, promote


def _on_rep(fun: Callable, params: Any, mode: str) -> tuple[Callable, Any]:
    """``(g, theta)``: the function of the representation and the representation of ``params``."""
    return (lambda theta, x: fun(from_rep(mode, theta), x)), to_rep(mode, params)


def _real_theta(theta: Any) -> bool:
    return all(not jnp.issubdtype(p.dtype, jnp.complexfloating) for p in jax.tree.leaves(theta))


def split_imag(theta: Any, out_dtype: Any) -> bool:
    """Whether :math:`O` is complex over a real :math:`\\tilde\\theta` (needs two pullbacks)."""
    return _real_theta(theta) and jnp.issubdtype(out_dtype, jnp.complexfloating)


def _dot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_k a_k b_k` over all leaves (no conjugation)."""
    return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def mean_chunk(fun, params, x, w, *, mode: str, out_dtype) -> tuple[Pullback, tuple]:
    r"""One chunk's :math:`\sum_i w_i O_i`, shaped like the representation, as a
    :class:`~vmcgrad._chunked.Pullback` (added into the accumulators through ``with_refs``): the
    pullback with the weights as cotangent.

    Where :math:`O` is complex over a real representation, the sums are the pair
    ``(Re, Im)`` of :math:`\sum_i w_i O_i`: the pullbacks with cotangents :math:`w` and :math:`-i w`,
    taken at two copies of the primals so that each has its own accumulator (join them with
    :func:`join_mean`).
    """
    g, theta = _on_rep(fun, params, mode)
    wide = promote(theta)  # pullbacks arrive in the accumulators' dtype (see vmcgrad._vjp.vjp_chunk)
    weights = w.astype(out_dtype)
    at = lambda p: g(cast_like(p, theta), x)
    if not split_imag(theta, out_dtype):
        return Pullback(lambda p: (at(p), weights), wide), ()
    minus_i = (-1j * weights).astype(out_dtype)
    return Pullback(lambda pp: ((at(pp[0]), at(pp[1])), (weights, minus_i)), (wide, wide)), ()


def join_mean(total: Any, theta_like: Any, out_dtype: Any) -> Any:
    """:func:`mean_chunk`'s reduced sums as one tree: ``Re + i Im`` leaf by leaf for the pair."""
    if not split_imag(theta_like, out_dtype):
        return total
    re, im = total
    return jax.tree.map(jax.lax.complex, re, im)


def product_chunk(fun, params, x, w, obar, v, *, mode: str) -> tuple[Pullback, tuple]:
    r"""One chunk's :math:`\sum_i \overline{O_i}\,w_i (O_i v - \bar O\cdot v)` (real part for a real
    :math:`\tilde\theta`): one forward pass with its jvp, and the pullback of the same forward pass
    with cotangent :math:`\overline{\Delta w}` (a :class:`~vmcgrad._chunked.Pullback`: added into the
    accumulators through ``with_refs``; for a real :math:`\tilde\theta` JAX's pullback of a
    real-to-complex map takes the real part, which is :math:`\mathrm{Re}\,O^\dagger w`)."""
    g, theta = _on_rep(fun, params, mode)
    obar_v = _dot(obar, v)
    real = jnp.finfo(obar_v.dtype).dtype

    def forward(p):
        y, ov = jax.jvp(lambda p: g(p, x), (p,), (v,))
        return y, jnp.conj((ov - obar_v) * w.astype(real))

    return Pullback(forward, theta), ()


def product_jvp_vjp_chunk(fun, params, x, w, obar, v, *, mode: str) -> tuple[Pullback, tuple]:
    r""":func:`product_chunk`'s sum by two linearisations of the chunk (the jvp-then-vjp design):
    :math:`\Delta w_i = w_i (O_i v - \bar O\cdot v)` by a jvp, then the pullback of a second forward
    pass with cotangent :math:`\overline{\Delta w}` (a :class:`~vmcgrad._chunked.Pullback`).

    Two things keep XLA from merging the two forward passes back into the fused one (it does so
    across ``lax.optimization_barrier`` when XLA CPU's YNN fusion is on): the jvp runs inside a
    ``lax.cond`` (on whether the chunk has a counted row), a computation of its own, and the second
    pass reads the samples through a zero that the cond returns with :math:`\Delta w` (``x + 0·Σw``). The
    chunk then holds about what NetKet's jvp pass holds (RBM, float64, CPU, whole program: 3.09
    chunk × L arrays with XLA's default flags and 3.07 with the YNN fusion off, against the fused
    design's 6.0 and 4.1, and NetKet's 3.2; either of the two alone leaves 4.1 or 5.0), at the price of
    a second forward pass. :class:`~vmcgrad.QGTOperator` takes it where the memory
    budget makes it the faster choice (``design="jvp_vjp"``).
    """
    g, theta = _on_rep(fun, params, mode)
    real = jnp.finfo(_dtype(obar)).dtype

    def tangent(x):
        _, ov = jax.jvp(lambda p: g(p, x), (theta,), (v,))
        return jnp.conj((ov - _dot(obar, v)) * w.astype(real)), 0 * jnp.sum(w.astype(real))

    out, zero = jax.eval_shape(tangent, x)
    dw, zero = jax.lax.cond(
        jnp.any(w), tangent, lambda x: (jnp.zeros(out.shape, out.dtype), jnp.zeros((), zero.dtype)), x
    )
    # the second forward pass reads the samples through a zero that leaves the cond with Δw (0·Σw),
    # so it cannot start before the jvp ends (a dependency on Δw itself, linear in v, would make the
    # product nonlinear in v for JAX's transpose)
    x2 = jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else a, x)
    return Pullback(lambda p: (g(p, x2), dw), theta), ()


def jacobian_rows(g: Callable, theta: Any, x: Any, out_dtype) -> jax.Array:
    """The chunk's Jacobian as a ``(chunk, D)`` matrix of flat representation rows."""
    two = split_imag(theta, out_dtype)

    def row(xi):
        batch = jax.tree.map(lambda a: a[None], xi)
        out, f_vjp = jax.vjp(lambda p: g(p, batch), theta)
        one = jnp.ones_like(out)
        (re,) = f_vjp(one)
        flat_re = ravel_pytree(re)[0]
        if not two:
            return flat_re
        (im,) = f_vjp(-1j * one)
        return jax.lax.complex(flat_re, ravel_pytree(im)[0])

    return jax.vmap(row)(x)


def jacobian_chunk(fun, params, x, w, obar, *, mode: str, out_dtype, dense: bool) -> tuple[jax.Array, tuple]:
    r"""One chunk's :math:`\sum_i w_i |\Delta O_{ik}|^2` (``dense=False``, shape ``(D,)``) or
    :math:`\sum_i w_i \Delta O_i^\dagger \Delta O_i` (``dense=True``, ``(D, D)``; its real part
    for a real :math:`\tilde\theta`)."""
    g, theta = _on_rep(fun, params, mode)
    obar_flat = ravel_pytree(obar)[0]
    real = jnp.finfo(obar_flat.dtype).dtype
    rows = (jacobian_rows(g, theta, x, out_dtype) - obar_flat) * w.astype(real)[:, None]
    if not dense:
        return jnp.sum((rows * rows.conj()).real, axis=0), ()
    s = rows.conj().T @ rows
    return (s.real if _real_theta(theta) else s), ()


def linearize_body(fun, params, samples, chunks, *, mode: str) -> tuple[Any, jax.Array]:
    """Every chunk's linearisation, kept: ``(linear_maps, weights)`` stacked along a leading chunk axis.

    ``jax.linearize`` returns its linear map as a pytree (a ``Partial`` whose array leaves are the
    forward pass's residuals); the loop stacks those leaves chunk by chunk, so slicing the leaves at
    chunk ``k`` gives chunk ``k``'s linear map back. The result stays on its device.
    """
    g, theta = _on_rep(fun, params, mode)
    real = jnp.finfo(_dtype(theta)).dtype

    def step(_, k):
        x, w = chunks.take(k, samples, dtype=real)
        _, f_jvp = jax.linearize(lambda p: g(p, x), theta)
        return None, (f_jvp, w)

    _, (linear_maps, weights) = jax.lax.scan(step, None, jnp.arange(chunks.plan.count))
    return linear_maps, weights


def cached_product_body(fun, params, samples, chunks, obar, v, linear_maps, weights, *, mode: str) -> Any:
    """:func:`product_chunk` from kept linearisations (:func:`linearize_body`'s output on this
    device): the tangent and transpose only, no forward pass."""
    del fun, samples, chunks  # everything comes from the kept linear maps
    theta = to_rep(mode, params)
    obar_v = _dot(obar, v)
    acc = accumulators(theta)

    def step(k, _):
        f_jvp = jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, k, keepdims=False), linear_maps)
        dw = (f_jvp(v) - obar_v) * jax.lax.dynamic_index_in_dim(weights, k, keepdims=False)
        (ct,) = jax.linear_transpose(f_jvp, theta)(jnp.conj(dw))
        for ref, val in zip(jax.tree.leaves(acc), jax.tree.leaves(ct)):
            ref[...] += val.astype(ref.dtype)
        return None

    jax.lax.fori_loop(0, weights.shape[0], step, None)
    return freeze(acc)


def _dtype(tree: Any) -> Any:
    return jnp.result_type(*jax.tree.leaves(tree))
