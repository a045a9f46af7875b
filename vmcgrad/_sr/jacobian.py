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


def jacobian(f: Callable, theta: Any, x: Any, mode: str, batch: int | None = None, shift: Any = None) -> Any:
    """Per-sample Jacobians of ``f``: leaves of shape ``(rows, K, *leaf)`` (vmap of one-sample jacrev,
    complex-analytic in 'holomorphic' mode), ``batch`` rows at a time (``lax.map``; None: all at
    once), so that the model's intermediates are held for ``batch`` samples only, next to the
    Jacobians of all ``rows``; less ``shift`` (leaves ``(K, *leaf)``), taken per batch so that no
    second copy of the rows is made."""

    def one(xi):
        row = lambda t: f(t, jax.tree.map(lambda a: a[None], xi))[0]
        j = jax.jacrev(row, holomorphic=mode == "holomorphic")(theta)
        return j if shift is None else jax.tree.map(jnp.subtract, j, shift)

    if batch is None:
        return jax.vmap(one)(x)
    return jax.lax.map(one, x, batch_size=batch)


def flat_jacobian(
    f: Callable, theta: Any, x: Any, mode: str, batch: int | None = None, shift: Any = None
) -> jax.Array:
    """:func:`jacobian` as one ``(rows, K, P)`` array of flat rows (``ravel_pytree``'s order of
    ``theta``), ``shift`` flat too (``(K, P)``): differentiated at the flat parameters, so that each
    batch's rows land in the output as they are, with no concatenation of the leaves' rows (a second
    copy)."""
    flat, unravel = ravel_pytree(theta)
    return jacobian(lambda t, x: f(unravel(t), x), flat, x, mode, batch, shift)


def gram(rows: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""``(G, t)``: :math:`G = \sum_i w_i \tilde J_i^\dagger \tilde J_i` (``(P, P)``, summed over the K
    components) and :math:`t = \sum_i w_i \tilde J_i` (``(K, P)``) of a chunk's flat rows ``(c, K,
    P)`` (:func:`flat_jacobian`, its shift taken off) and row weights ``w`` (0 for padded rows)."""
    c, k = rows.shape[:2]
    weighted = rows * w.astype(jnp.finfo(rows.dtype).dtype)[:, None, None]
    mat = rows.reshape(c * k, -1)
    return jnp.conj(mat).T @ weighted.reshape(c * k, -1), jnp.sum(weighted, axis=0)
