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

Cost: the Jacobians of the ``r`` samples, held (``rKP`` numbers, computed ``c`` at a time), one pass
over every device's rows deriving each row chunk's Jacobian once (:math:`N` per-sample Jacobians,
about two CG iterations' work) and contracting it with them, and the :math:`NK \times rK` matrices
:math:`C` and :math:`Z`. :func:`nystrom_rank` sizes ``r`` to a memory budget.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vmcgrad._problem.sharding import unsplit_explicit
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import REPLICATED
from vmcgrad._sr.jacobian import jacobian
from vmcgrad._sr.ntk.modes import contract, jacobian_batch, k_of, mean_jacobian, rows_fun, theta_of

#: Fraction of the memory budget the preconditioner's own arrays may take (the rest: the CG passes).
BUDGET_FRACTION = 0.5


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


def nystrom_rank(n: int, k: int, p: int, itemsize: int, budget: float) -> int:
    """Samples ``r`` of the preconditioner: at most N/2, and as many as fit
    :data:`BUDGET_FRACTION` of ``budget`` bytes: the held Jacobians (:math:`rKP` numbers) and three
    :math:`NK \\times rK` matrices (:math:`C`, its QR factor and :math:`Z`); 0 (plain CG) when none fit.

    Args:
        n: N, the samples. k: output components per sample (2 in 'complex' mode).
        p: real parameters (entries of the differentiated parametrisation).
        itemsize: bytes per entry of the kernel (16 for complex).
        budget: bytes per device.
    """
    per_sample = itemsize * (k * p + 3 * n * k * k)
    return int(max(0, min(n // 2, (BUDGET_FRACTION * budget) // per_sample)))


def nystrom_chunk(fun, params, x, w, js, shift, *, mode: str) -> tuple[tuple, jax.Array]:
    r"""One chunk of rows of :math:`C = \tilde J \tilde J_S^\dagger`: ``(c, K, r, K)``."""
    f = rows_fun(fun, mode, params)
    # (w: padded rows are cut after the pass)
    rows = jacobian(f, theta_of(mode, params), x, mode, jacobian_batch(w.shape[0]), shift)
    return (), contract(rows, js, k_of(mode))


def build(op: Any, rank: int, cols: int) -> Nystrom:
    """The preconditioner of ``op`` (an :class:`~vmcgrad.NTKOperator` at a concrete chunk, traced)
    from ``rank`` evenly strided samples, their Jacobians taken ``cols`` at a time."""
    prob, mode = op.problem, op.mode
    n, k = prob.n, k_of(mode)
    f = rows_fun(op._fun(), mode, op.params)
    theta = theta_of(mode, op.params)
    samples = unsplit_explicit(op.samples)
    shift = mean_jacobian(f, theta, samples, n, mode, cols)
    subset = jax.tree.map(lambda a: a[(jnp.arange(rank) * n) // rank], samples)

    js = jax.lax.stop_gradient(jacobian(f, theta, subset, mode, jacobian_batch(min(cols, rank)), shift))
    _, c = map_reduce_problem(prob, op.inputs, _partial_chunk(mode), (js, REPLICATED), (shift, REPLICATED))
    c = unsplit_explicit(c)
    c = (c - jnp.mean(c, axis=0, keepdims=True)).reshape(n * k, rank * k)  # Q C
    w = contract(js, js, k).reshape(rank * k, rank * k)
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


def _partial_chunk(mode: str):
    def chunk(fun, params, x, w, js, shift):
        return nystrom_chunk(fun, params, x, w, js, shift, mode=mode)

    return chunk
