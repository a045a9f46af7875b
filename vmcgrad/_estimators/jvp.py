"""``batched_jvp``: per-sample Jacobian-vector products O·t, chunked, no communication."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax

from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Inputs, Problem, call, problem
from vmcgrad._runner.primitive import map_reduce_problem


def batched_jvp(
    fun: Callable[[Any, Any], jax.Array],
    params: Any,
    samples: Any,
    tangent: Any,
    *,
    chunk_size: int | str | None = None,
    memory_budget: float | None = None,
) -> jax.Array:
    r"""Per-sample Jacobian-vector products of a batched function, chunk by chunk.

    Computes what ``jax.jvp(lambda p: fun(p, samples), (params,), (tangent,))[1]`` returns,

    .. math::

        (O t)_i = \sum_k \frac{\partial f(\theta, \sigma_i)}{\partial \theta_k} \, t_k ,

    walking each device's samples ``chunk_size`` at a time in one loop. The result is
    sharded like the samples and no data moves between devices.

    Args:
        fun: ``fun(params, batch) -> (batch_size,)`` array, real or complex; a plain callable, or
            a ``jax.tree_util.Partial`` whose arrays are traced (see :func:`batched_vjp`).
            **Row by row:** row i of the output may depend on sample i only; ``fun`` is called on chunks of
            at most ``chunk_size`` rows (per device), so a batch statistic inside it (a mean, max or
            logsumexp of the batch subtracted without ``jax.lax.stop_gradient``) would become a per-chunk
            one. Where the analysis of its jaxpr proves such a coupling, a ValueError says so.
        params: a pytree of real and/or complex floating arrays.
        samples: an array, or pytree of arrays, with the N samples along axis 0.
        tangent: a pytree with the structure, shapes and dtypes of ``params``.
        chunk_size: samples per chunk on each device, any positive int, None for one chunk, or
            ``"auto"`` (see :func:`vmcgrad.batched_vjp`).
        memory_budget: bytes per device for ``chunk_size="auto"``; None for the default.

    Returns:
        An array of shape ``(N,)`` with the dtype of ``fun``'s output, sharded like the samples.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> t = jnp.array([1.0, -2.0, 0.5])
        >>> out = vmcgrad.batched_jvp(fun, w, x, t, chunk_size=3)
        >>> bool(jnp.allclose(out, jax.jvp(lambda w: fun(w, x), (w,), (t,))[1]))
        True
    """
    name = "vmcgrad.batched_jvp"
    tangent = check.as_arrays(name, "tangent", tangent)
    prob, inputs, tangent = problem(
        name, fun, params, samples, chunk_size=chunk_size, memory_budget=memory_budget, extra=tangent
    )
    check.check_tangent(name, tangent, inputs.params)
    return call(jvp_program, prob, inputs, tangent)


@partial(jax.jit, static_argnums=0)
def jvp_program(prob: Problem, inputs: Inputs, tangent: Any) -> jax.Array:
    """The compiled ``batched_jvp``: per-sample outputs, split like the samples (no reduction)."""
    _, out = map_reduce_problem(prob, inputs, jvp_chunk, (tangent, prob.layout))
    return out


def jvp_chunk(fun: Callable, params: Any, x: Any, w: jax.Array, tangent: Any) -> tuple[tuple, jax.Array]:
    """One chunk's rows of :math:`O t` (the per-sample part; rows where ``w`` is False are dropped)."""
    del w
    return (), jax.jvp(lambda p: fun(p, x), (params,), (tangent,))[1]
