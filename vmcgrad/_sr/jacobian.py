r"""Per-sample Jacobians, and the matrix :math:`S` summed from them: one definition for both wings
(:mod:`vmcgrad._sr.qgt`'s dense QGT and :mod:`vmcgrad._sr.ntk`'s sample-space kernel and MinSR update).

A function ``f(theta, batch) -> (batch, K)`` gives each sample K output components: real ones (the
real and imaginary parts of :math:`\log\psi` of a real parametrisation, or its real part alone), or
one complex component of a holomorphic function of complex parameters. Its per-sample Jacobian has
rows :math:`J_{ia} = \partial f_a(\theta, \sigma_i)/\partial\theta`, and

.. math::

    S \propto \sum_i w_i \tilde J_i^\dagger \tilde J_i, \qquad \tilde J_i = J_i - s,

summed over the K components, is the P×P matrix of both wings: :math:`\mathrm{Re}(\Delta O^\dagger
\Delta O)` for a real parametrisation whose rows are :math:`(\mathrm{Re}\,O_i, \mathrm{Im}\,O_i)`,
:math:`\Delta O^\dagger\Delta O` for a holomorphic one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


def components(mode: str, y: jax.Array) -> jax.Array:
    """A per-sample output ``(N,)`` as the mode's ``(N, K)`` components (the one mode -> components
    map): 'complex' (Re, Im), 'real' Re alone, 'holomorphic' the output itself."""
    if mode == "complex":
        return jnp.stack([jnp.real(y), jnp.imag(y)], axis=-1)
    if mode == "real":
        return jnp.real(y)[:, None]
    return y[:, None]


def jacobian(
    f: Callable,
    theta: Any,
    x: Any,
    mode: str,
    batch: int | None = None,
    shift: Any = None,
    in_turn: bool = False,
) -> Any:
    """Per-sample Jacobians of ``f``: leaves of shape ``(rows, K, *leaf)`` (vmap of one-sample jacrev,
    complex-analytic in 'holomorphic' mode), ``batch`` rows at a time (``lax.map``; None: all at
    once), so that the model's intermediates are held for ``batch`` samples only, next to the
    Jacobians of all ``rows``; less ``shift`` (leaves ``(K, *leaf)``), taken per batch so that no
    second copy of the rows is made.

    ``in_turn``: the K components' pullbacks one after another (:func:`_pullbacks_in_turn`), not at
    once (jacrev's vmap over the K cotangents): a sample's reverse-pass intermediates are held for
    one component at a time, not K, so about K times the samples fit a trip of the model's
    derivative in the same bytes, each trip one forward and K reverse passes in sequence instead of
    one forward and one reverse pass (more ops a trip). The same rows to rounding (each is the same
    pullback of the same cotangent; XLA fuses the two programs differently)."""

    def one(xi):
        row = lambda t: f(t, jax.tree.map(lambda a: a[None], xi))[0]
        if in_turn:
            j = _pullbacks_in_turn(row, theta)
        else:
            j = jax.jacrev(row, holomorphic=mode == "holomorphic")(theta)
        return j if shift is None else jax.tree.map(jnp.subtract, j, shift)

    if batch is None:
        return jax.vmap(one)(x)
    return jax.lax.map(one, x, batch_size=batch)


def _pullbacks_in_turn(row: Callable, theta: Any) -> Any:
    """jacrev of ``row`` (a real ``(K,)`` output), its K pullbacks one after another: one forward pass,
    then the pullback of each unit cotangent, each made to start after the previous one's result
    (:func:`_after`), so that XLA's scheduler does not run the K reverse passes side by side (their
    intermediates live at once), as it may for independent ones."""
    y, pull = jax.vjp(row, theta)
    eye = jnp.eye(y.shape[0], dtype=y.dtype)
    rows: list = []
    for k in range(y.shape[0]):
        ct = eye[k] if not rows else _after(eye[k], rows[-1])
        rows.append(pull(ct)[0])
    return jax.tree.map(lambda *r: jnp.stack(r), *rows)


def _after(ct: jax.Array, previous: Any) -> jax.Array:
    """``ct`` unchanged, made to depend on ``previous`` (a pytree of arrays): a zero taken from one of
    its numbers added, finite whatever that number (a non-finite one counts 0, so no NaN leaks into
    ``ct``). A data dependence orders the two computations where an optimisation barrier does not
    (XLA's CPU compiler drops barriers); a zero product of a float is not folded away (``0 * x`` is
    NaN for a non-finite ``x``, which the compiler cannot rule out)."""
    v = jnp.ravel(jax.tree.leaves(previous)[0])[0]
    return ct + (jnp.where(jnp.isfinite(v), v, 0) * 0).astype(ct.dtype)


def flat_jacobian(
    f: Callable,
    theta: Any,
    x: Any,
    mode: str,
    batch: int | None = None,
    shift: Any = None,
    in_turn: bool = False,
) -> jax.Array:
    """:func:`jacobian` as one ``(rows, K, P)`` array of flat rows (``ravel_pytree``'s order of
    ``theta``), ``shift`` flat too (``(K, P)``): differentiated at the flat parameters, so that each
    batch's rows land in the output as they are, with no concatenation of the leaves' rows (a second
    copy)."""
    flat, unravel = ravel_pytree(theta)
    return jacobian(lambda t, x: f(unravel(t), x), flat, x, mode, batch, shift, in_turn)


def gram(rows: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""``(G, t)``: :math:`G = \sum_i w_i \tilde J_i^\dagger \tilde J_i` (``(P, P)``, summed over the K
    components) and :math:`t = \sum_i w_i \tilde J_i` (``(K, P)``) of a chunk's flat rows ``(c, K,
    P)`` (:func:`flat_jacobian`, its shift taken off) and row weights ``w`` (0 for padded rows)."""
    c, k = rows.shape[:2]
    weighted = rows * w.astype(jnp.finfo(rows.dtype).dtype)[:, None, None]
    mat = rows.reshape(c * k, -1)
    return jnp.conj(mat).T @ weighted.reshape(c * k, -1), jnp.sum(weighted, axis=0)
