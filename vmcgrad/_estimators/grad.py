r"""``expect_grad``: the VMC energy gradient in one pullback pass, for every dtype case.

The force and the gradient NetKet's optimisers use (``netket/vqs/mc/common.py:force_to_grad``):

.. math::

    F = \frac{1}{N} \sum_{i=1}^{N} O_i^* \, (L_i - \bar L), \qquad
    \bar L = \frac{1}{N} \sum_{i=1}^{N} L_i, \qquad
    O_i = \frac{\partial \log\psi_\theta(\sigma_i)}{\partial \theta},

    g = 2F \ \text{(complex leaves)}, \qquad g = 2\,\mathrm{Re}\,F \ \text{(real leaves)}.

For a complex leaf :math:`\theta = x + iy` this is
:math:`g = \partial E/\partial x + i\,\partial E/\partial y`, also when :math:`\log\psi` is not holomorphic.

**One cotangent for all cases.** JAX's pullback of :math:`f = \log\psi` is the transpose under the
pairing :math:`\langle a, b\rangle = \mathrm{Re}(ab)`: writing the per-sample tangent map as
:math:`\delta f_i = \alpha_i \delta\theta + \beta_i \delta\theta^*` (Wirtinger derivatives
:math:`\alpha = \partial f/\partial\theta`, :math:`\beta = \partial f/\partial\theta^*`),

.. math::

    \mathrm{vjp}(c) = \sum_i \big(\alpha_i c_i + \beta_i^* c_i^*\big) \ \text{(complex leaves)},
    \qquad \mathrm{vjp}(c) = \mathrm{Re} \sum_i c_i O_i \ \text{(real leaves)}.

With the single cotangent

.. math::

    c_i = \frac{(L_i - \bar L)^*}{N} \ \text{(complex output)}, \qquad
    c_i = \frac{\mathrm{Re}(L_i - \bar L)}{N} \ \text{(real output)}

one pullback gives every case at once, and :math:`g = 2\,\mathrm{vjp}(c)^*` leaf by leaf
(the conjugate is the identity on real leaves):

- R→R (real params, real output): :math:`\mathrm{vjp}(c) = \frac1N \sum_i O_i \mathrm{Re}\,\Delta L_i
  = \mathrm{Re}\,F`.
- R→C (real params, complex output, e.g. RBMModPhase): :math:`\mathrm{vjp}(c) =
  \mathrm{Re} \frac1N \sum_i O_i \Delta L_i^* = \mathrm{Re}\,F` (NetKet's ``nk.jax.vjp`` uses two
  forward traces and four pullbacks here).
- C→C holomorphic (:math:`\beta = 0`, :math:`O = \alpha`): :math:`\mathrm{vjp}(c)^* =
  \frac1N \sum_i O_i^* \Delta L_i = F`.
- C→C non-holomorphic: :math:`\mathrm{vjp}(c)^* = \frac1N \sum_i (\alpha_i^* \Delta L_i +
  \beta_i \Delta L_i^*)`, which is NetKet's force (its ``conjugate=True`` pullback of the same
  cotangent) and equals :math:`\frac12(\partial E/\partial x + i\,\partial E/\partial y)`.
- C→R (real output, e.g. :math:`\log|\psi|`): as non-holomorphic, with :math:`\beta = \alpha^*`.
- mixed real and complex leaves: each leaf by its own rule, same cotangent, same pass.

The mean :math:`\bar L` is over all samples on all devices (padding excluded); it is one scalar
all-reduce before the loop. The pass itself is :func:`vmcgrad.batched_vjp`'s: one loop of
chunks per device into ref accumulators and one ``psum`` after the loop (XLA emits it as one
all-reduce per parameter dtype); the conjugate and the factor 2 are applied to the reduced,
parameter-sized result.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._chunks.plan import cast_like
from vmcgrad._estimators.vjp import vjp_sum
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Inputs, Problem, call, problem
from vmcgrad._problem.sharding import check_same_devices


def expect_grad(
    logpsi: Callable[[Any, Any], jax.Array],
    params: Any,
    samples: Any,
    local_values: jax.Array,
    *,
    chunk_size: int | str | None = None,
    memory_budget: float | None = None,
) -> Any:
    r"""The VMC gradient :math:`g` (NetKet's ``force_to_grad`` of the force) in one chunked pass.

    .. math::

        F = \frac{1}{N} \sum_{i=1}^{N} O_i^* \, (L_i - \bar L), \quad
        O_i = \frac{\partial \log\psi(\theta, \sigma_i)}{\partial \theta}, \quad
        g = \begin{cases} 2F & \text{complex leaves} \\ 2\,\mathrm{Re}\,F & \text{real leaves}
        \end{cases}

    This is what ``nk.vqs.MCState.expect_and_grad`` returns for a Hermitian operator with
    ``local_values`` its local estimators :math:`L_i = E_{\mathrm{loc}}(\sigma_i)`; for a complex
    leaf :math:`\theta = x + iy` it is :math:`\partial E/\partial x + i\,\partial E/\partial y`,
    holomorphic or not. It is computed by a single pullback of the cotangent

    .. math::

        c_i = \frac{(L_i - \bar L)^*}{N} \ \text{(complex output; real part for real output)},
        \qquad g = 2\, \mathrm{vjp}(c)^* ,

    whatever the dtypes of parameters and output (derivation per case in the module docstring of
    ``vmcgrad._estimators.grad``). The pass is :func:`vmcgrad.batched_vjp`'s: chunked, sharded over the
    samples' devices, one reduction after the loop (plus one scalar all-reduce for
    :math:`\bar L`).

    Args:
        logpsi: ``logpsi(params, batch) -> (batch_size,)`` array, real or complex; a plain
            callable (compiled in, keyed by identity), or a pytree callable such as
            ``jax.tree_util.Partial(f, *arrays)`` whose array-like leaves are traced (e.g. a model
            state) so new values do not recompile.
            **Row by row:** row i of the output may depend on sample i only; ``logpsi`` is called on chunks of
            at most ``chunk_size`` rows (per device), so a batch statistic inside it (a mean, max or
            logsumexp of the batch subtracted without ``jax.lax.stop_gradient``) would become a per-chunk
            one. Where the analysis of its jaxpr proves such a coupling, a ValueError says so.
        params: a pytree of real and/or complex floating arrays.
        samples: an array, or pytree of arrays, with the N samples along axis 0.
        local_values: the local estimators :math:`L_i`, shape ``(N,)``, real or complex (complex
            local values with a real ``logpsi`` are allowed: only their real part enters).
        chunk_size: samples per chunk on each device; any positive int, None for one chunk, or
            ``"auto"`` (see :func:`vmcgrad.batched_vjp`).
        memory_budget: bytes per device for ``chunk_size="auto"``; None for the default.

    Returns:
        A pytree like ``params`` (same structure and dtypes), replicated over the devices.

    Raises:
        TypeError, ValueError: for bad input, before anything is traced.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> logpsi = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> e_loc = jnp.linspace(-1, 1, 10) ** 2
        >>> g = vmcgrad.expect_grad(logpsi, w, x, e_loc, chunk_size=4)
        >>> O = jax.jacrev(logpsi)(w, x)  # (N, P)
        >>> bool(jnp.allclose(g, 2 * O.T @ (e_loc - e_loc.mean()) / 10))
        True
    """
    name = "vmcgrad.expect_grad"
    prob, inputs, _ = problem(
        name, logpsi, params, samples, chunk_size=chunk_size, memory_budget=memory_budget, arg="logpsi"
    )
    local_values = check.as_arrays(name, "local_values", local_values)
    check.check_local_values(name, local_values, prob.n)
    check_same_devices(name, "local_values", local_values, prob.where)
    return call(grad_program, prob, inputs, local_values)


@partial(jax.jit, static_argnums=0)
def grad_program(prob: Problem, inputs: Inputs, local_values: jax.Array) -> Any:
    r"""The compiled ``expect_grad``: :math:`g = 2\,\mathrm{vjp}(c)^*`, cast to the parameters' dtypes."""
    vjp = vjp_sum(prob, inputs, centred_cotangent(local_values, prob.out_dtype))
    g = jax.tree.map(lambda g: 2 * jnp.conj(g) if jnp.iscomplexobj(g) else 2 * g, vjp)
    return cast_like(g, inputs.params)


def centred_cotangent(local_values: jax.Array, out_dtype: Any) -> jax.Array:
    r"""The cotangent :math:`c_i = (L_i - \bar L)^* / N` in ``out_dtype`` (real part if real).

    The mean is over all N local values, in their own precision (integers become
    ``out_dtype``); under sharding it is one scalar all-reduce. For a real output only
    :math:`\mathrm{Re}\,L` enters, so the mean is taken of the real part.
    """
    n = local_values.shape[0]
    if not jnp.issubdtype(local_values.dtype, jnp.inexact):
        local_values = local_values.astype(out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.complexfloating):
        local_values = jnp.real(local_values)
    centred = local_values - jnp.mean(local_values)
    return (jnp.conj(centred) / n).astype(out_dtype)
