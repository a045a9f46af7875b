r"""The chunk functions behind :class:`~vmcgrad.QGTOperator` and :class:`~vmcgrad.LinearizedQGT`.

Each has the signature ``chunk(fun, params, x, w, *extra) -> (sums, maps)`` (or ``(sums, maps,
slots)``) of :func:`vmcgrad._runner.primitive.map_reduce_problem` (:func:`kept_product_chunk`, which needs no
samples, that of :func:`vmcgrad._runner.primitive.map_reduce`) and returns one chunk's sums (``w`` the row
mask); the primitive walks the chunks and adds the one reduction, and JAX's transformations act on
them. The bodies work on the representation :math:`\tilde\theta` of the parameters
(:mod:`vmcgrad._sr.modes`) through :math:`g(\tilde\theta, x) = f(\mathrm{from\_rep}(\tilde\theta),
x)`. Rows carry the weights of :mod:`vmcgrad._chunks.plan` (0 for padded rows and rows an earlier chunk
covered).

- :func:`mean_chunk`: :math:`\sum_i w_i O_i` (real and imaginary parts by two pullbacks of one
  linearisation when the output is complex and :math:`\tilde\theta` real).
- :func:`product_chunk`, the fused product: per chunk, a jvp inside a vjp. The function whose vjp
  is taken runs ``jax.jvp`` of the chunk's forward pass along :math:`v`; its primal output is the
  vjp's output and its tangent, turned into :math:`\overline{\Delta w_i}` with
  :math:`\Delta w_i = w_i (O_i v - \bar O\cdot v)`, the auxiliary cotangent (not differentiated).
  The pullback with that cotangent gives :math:`\sum_i \overline{O_i}\, \Delta w_i`: one forward
  pass per chunk, whose residuals serve the tangent and the transpose (for a real
  :math:`\tilde\theta`, JAX's pullback of a real-to-complex map takes the real part, which is
  :math:`\mathrm{Re}\,O^\dagger w`). As :math:`\sum_i w_i \Delta O_i = 0`,
  :math:`O^\dagger \Delta w = \Delta O^\dagger \Delta O v`.
- :func:`product_jvp_vjp_chunk`: the same sums by a jvp, then the pullback of a second forward pass.
- :func:`tangent_chunk` / :func:`pullback_chunk`: the two loops of the two-loop design (NetKet's
  ``QGTOnTheFly``): the rows of :math:`O v`, then, after their centring by their mean,
  :math:`\sum_i \overline{O_i}\,\Delta w_i` by the pullback of a second forward pass. No
  :math:`\bar O` is read: :math:`\bar O\cdot v` is the mean of the first loop's rows.
- :func:`jacobian_chunk`: per chunk, the chunk's rows of :math:`\Delta O` (the shared per-sample
  Jacobian, :mod:`vmcgrad._sr.jacobian`) reduced to the diagonal :math:`\sum_i |\Delta O_{ik}|^2` or the full
  :math:`\Delta O^\dagger \Delta O` (for ``to_dense``).
- :func:`linearize_chunk` / :func:`kept_product_chunk`: every chunk's linearisation kept (a per-chunk
  output of the primitive: one slot per chunk, nothing reduced), and :func:`product_chunk`'s sums
  from it without a forward pass (the kept linearisation a per-chunk operand, read at the chunk)
  (:class:`vmcgrad.LinearizedQGT`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from vmcgrad._chunks.plan import cast_like, promote
from vmcgrad._runner.primitive import Pullback
from vmcgrad._sr.jacobian import components, flat_jacobian, gram
from vmcgrad._sr.modes import from_rep, to_rep


def _on_rep(fun: Callable, params: Any, mode: str) -> tuple[Callable, Any]:
    """``(g, theta)``: the function of the representation and the representation of ``params``."""
    return (lambda theta, x: fun(from_rep(mode, theta), x)), to_rep(mode, params)


def _real_theta(theta: Any) -> bool:
    return all(not jnp.issubdtype(p.dtype, jnp.complexfloating) for p in jax.tree.leaves(theta))


def split_imag(theta: Any, out_dtype: Any) -> bool:
    """Whether :math:`O` is complex over a real :math:`\\tilde\\theta` (needs two pullbacks)."""
    return _real_theta(theta) and jnp.issubdtype(out_dtype, jnp.complexfloating)


def _dtype(tree: Any) -> Any:
    """The dtype all of ``tree``'s leaves promote to."""
    return jnp.result_type(*jax.tree.leaves(tree))


def _dot(a: Any, b: Any) -> jax.Array:
    """:math:`\\sum_k a_k b_k` over all leaves (no conjugation)."""
    return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def mean_chunk(fun, params, x, w, *, mode: str, out_dtype) -> tuple[Pullback, tuple]:
    r"""One chunk's :math:`\sum_i w_i O_i`, shaped like the representation, as a
    :class:`~vmcgrad._runner.primitive.Pullback` (added into the accumulators through ``with_refs``): the
    pullback with the weights as cotangent.

    Where :math:`O` is complex over a real representation, the sums are the pair
    ``(Re, Im)`` of :math:`\sum_i w_i O_i`: the pullbacks with cotangents :math:`w` and :math:`-i w`,
    taken at two copies of the primals so that each has its own accumulator (join them with
    :func:`join_mean`).
    """
    g, theta = _on_rep(fun, params, mode)
    wide = promote(
        theta
    )  # pullbacks arrive in the accumulators' dtype (see vmcgrad._estimators.vjp.vjp_chunk)
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
    with cotangent :math:`\overline{\Delta w}` (a :class:`~vmcgrad._runner.primitive.Pullback`: added into the
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
    pass with cotangent :math:`\overline{\Delta w}` (a :class:`~vmcgrad._runner.primitive.Pullback`).

    Two things keep XLA from merging the two forward passes back into the fused one (it does so
    across ``lax.optimization_barrier`` when XLA CPU's YNN fusion is on): the jvp runs inside a
    ``lax.cond`` (on whether the chunk has a counted row), a computation of its own, and the second
    pass reads the samples through a zero that the cond returns with :math:`\Delta w`
    (``x + 0·Σw``). Both need ``w`` as a value of the run: where every row counts the runner passes
    a constant, which XLA would fold (the cond with it), so ``w`` passes an optimisation barrier
    first. The chunk then holds about what NetKet's jvp pass holds, less than the fused
    design's chunk (compiled bytes: ``benchmarks/qgt_design_bytes.py``), at the price of a second
    forward pass. :class:`~vmcgrad.QGTOperator` takes it where the memory budget makes it the faster
    choice (``design="jvp_vjp"``).
    """
    g, theta = _on_rep(fun, params, mode)
    real = jnp.finfo(_dtype(obar)).dtype
    w = jax.lax.optimization_barrier(w)  # not a constant to XLA (see above)

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


def tangent_chunk(fun, params, x, w, v, *, mode: str) -> tuple[tuple, jax.Array]:
    r"""One chunk's rows of :math:`O v` (the two-loop design's first loop: per-sample, nothing
    summed; rows where ``w`` is False are dropped by the primitive)."""
    del w
    g, theta = _on_rep(fun, params, mode)
    return (), jax.jvp(lambda p: g(p, x), (theta,), (v,))[1]


def pullback_chunk(fun, params, x, w, ct, *, mode: str) -> tuple[Pullback, tuple]:
    r"""One chunk's :math:`\sum_i w_i\, c_i\, \partial g(\tilde\theta, x_i)/\partial\tilde\theta`
    for the per-sample cotangent :math:`c` (the two-loop design's second loop, with
    :math:`c = \overline{\Delta w}`), as a :class:`~vmcgrad._runner.primitive.Pullback`."""
    g, theta = _on_rep(fun, params, mode)
    ct = jnp.where(w, ct, jnp.zeros_like(ct))
    return Pullback(lambda p: (g(p, x), ct), theta), ()


def jacobian_chunk(fun, params, x, w, obar, *, mode: str, out_dtype, dense: bool) -> tuple[jax.Array, tuple]:
    r"""One chunk's :math:`\sum_i w_i |\Delta O_{ik}|^2` (``dense=False``, shape ``(D,)``) or
    :math:`\sum_i w_i \Delta O_i^\dagger \Delta O_i` (``dense=True``, ``(D, D)``; its real part
    for a real :math:`\tilde\theta`), from the chunk's per-sample Jacobians (the shared
    :func:`vmcgrad._sr.jacobian.flat_jacobian` and :func:`~vmcgrad._sr.jacobian.gram`, MinSR's too):
    over a real :math:`\tilde\theta` a complex :math:`O` is taken as its two real rows
    :math:`(\mathrm{Re}\,O, \mathrm{Im}\,O)`, whose sum is :math:`\mathrm{Re}(\Delta O^\dagger\Delta O)`."""
    g, theta = _on_rep(fun, params, mode)
    parts = "complex" if split_imag(theta, out_dtype) else ("real" if _real_theta(theta) else "holomorphic")
    obar_flat = ravel_pytree(obar)[0]
    shift = components(parts, obar_flat).T  # (K, D), as the rows
    rows = flat_jacobian(lambda t, x: components(parts, g(t, x)), theta, x, parts, shift=shift)
    if dense:
        return gram(rows, w)[0], ()
    real = jnp.finfo(rows.dtype).dtype
    return jnp.einsum("c,ckd->d", w.astype(real), (rows * rows.conj()).real), ()


def linearize_chunk(fun, params, x, w, *, mode: str) -> tuple[tuple, tuple, Any]:
    """One chunk's linearisation, kept: no sums, no rows, and as this chunk's slot the linear map
    :math:`\\tilde v \\mapsto O_{[k]} \\tilde v` of ``jax.linearize``.

    ``jax.linearize`` returns its linear map as a pytree (a ``Partial`` whose array leaves are the
    forward pass's residuals); the primitive stacks those leaves chunk by chunk along a leading axis
    of every device's chunks, so slot ``k`` of the leaves is chunk ``k``'s linear map again.
    """
    del w  # the rows that count are weighted in the product (kept_product_chunk)
    g, theta = _on_rep(fun, params, mode)
    _, f_jvp = jax.linearize(lambda p: g(p, x), theta)
    return (), (), f_jvp


def kept_product_chunk(obar, v, f_jvp, w, *, theta: Any) -> tuple[Any, tuple]:
    r""":func:`product_chunk`'s sums from the chunk's kept linear map ``f_jvp``
    (:func:`linearize_chunk`'s slot): :math:`\sum_i \overline{O_i}\, w_i (O_i v - \bar O\cdot v)`
    by the tangent and its transpose only, no forward pass. ``theta`` gives the representation's
    shapes and dtypes (the transpose's input)."""
    obar_v = _dot(obar, v)
    real = jnp.finfo(obar_v.dtype).dtype
    dw = (f_jvp(v) - obar_v) * w.astype(real)
    (ct,) = jax.linear_transpose(f_jvp, theta)(jnp.conj(dw))
    return ct, ()
