"""``batched_vjp``: Σ_i ct_i ∂f(θ, σ_i)/∂θ, chunked, accumulated in refs, reduced once."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._chunks.plan import cast_like, promote
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Inputs, Problem, call, problem
from vmcgrad._problem.sharding import check_same_devices
from vmcgrad._runner.primitive import Pullback, map_reduce_problem
from vmcgrad._runner.runner import SAMPLES


def batched_vjp(
    fun: Callable[[Any, Any], jax.Array],
    params: Any,
    samples: Any,
    cotangent: jax.Array,
    *,
    chunk_size: int | str | None = None,
    memory_budget: float | None = None,
) -> Any:
    r"""Vector-Jacobian product of a batched function, summed over samples chunk by chunk.

    Computes exactly what ``jax.vjp(lambda p: fun(p, samples), params)[1](cotangent)[0]``
    returns, without ever holding more than ``chunk_size`` samples' activations:

    .. math::

        \mathrm{vjp}(c) = \sum_{i=1}^{N} c_i \, \frac{\partial f(\theta, \sigma_i)}{\partial \theta}

    with JAX's conventions for complex numbers (for real parameters and a complex output the
    result is :math:`\mathrm{Re} \sum_i c_i O_i`; pass ``conj(v)`` to get :math:`\mathrm{Re}(O^\dagger v)`).

    On each device the local samples are walked ``chunk_size`` at a time by one loop; each
    chunk's pullback is added into ``jax.new_ref`` accumulators. When the
    samples are split over a mesh axis (their sharding, or the context mesh as NetKet sets it), each
    device works on its own shard and one ``psum`` after the loop is the only communication.
    Accumulators are at float32 or better whatever the parameter dtype; the result is cast back.

    It composes with JAX's transformations (:mod:`vmcgrad._runner.primitive`): ``jax.grad`` / ``jax.vjp`` /
    ``jax.jvp`` / ``jax.jacfwd`` in ``params``, ``samples`` and ``cotangent``, ``jax.vmap`` over any
    of them and ``jax.checkpoint``; each transformed computation is again one chunked pass with one
    reduction (the transpose in the cotangent is a :func:`batched_jvp`, the derivative in the
    parameters a chunked forward-over-reverse pass).

    Args:
        fun: ``fun(params, batch) -> (batch_size,)`` array, real or complex. A plain callable is
            compiled in (keyed by identity, as ``jax.jit`` keys a function); a pytree callable
            (``jax.tree_util.Partial(f, *arrays)``, an equinox ``Module``) has its array-like leaves,
            Python floats included, traced instead (model state; :mod:`vmcgrad._function`).
            **Row by row:** row i of the output may depend on sample i only; ``fun`` is called on chunks of
            at most ``chunk_size`` rows (per device), so a batch statistic inside it (a mean, max or
            logsumexp of the batch subtracted without ``jax.lax.stop_gradient``) would become a per-chunk
            one. Where the analysis of its jaxpr proves such a coupling, a ValueError says so.
        params: a pytree of real and/or complex floating arrays.
        samples: an array, or pytree of arrays, with the N samples along axis 0.
        cotangent: an array of shape ``(N,)`` with the dtype of ``fun``'s output.
        chunk_size: samples per chunk on each device; any positive int (it need not divide
            anything), None for one chunk per device, or ``"auto"``: the largest power of two whose
            compiled program fits ``memory_budget`` (see :func:`vmcgrad.auto_chunk_size`).
        memory_budget: bytes per device for ``chunk_size="auto"`` (any positive number); None for
            the default (half the free device memory, or 2 GiB where the backend does not say).

    Returns:
        A pytree like ``params`` (same structure and dtypes), replicated over the devices
        (parameter-sharded leaves come back sharded the same way).

    Raises:
        TypeError, ValueError: for bad input, before anything is traced; ValueError for a ``fun``
            whose rows provably depend on each other (see ``fun``).

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> ct = jnp.linspace(-1, 1, 10)
        >>> g = vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4)
        >>> (g_ref,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
        >>> bool(jnp.allclose(g, g_ref))
        True

        Differentiating through it (a chunked forward-over-reverse pass):

        >>> loss = lambda w: jnp.sum(vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4) ** 2)
        >>> loss_ref = lambda w: jnp.sum(jax.vjp(lambda w: fun(w, x), w)[1](ct)[0] ** 2)
        >>> bool(jnp.allclose(jax.grad(loss)(w), jax.grad(loss_ref)(w)))
        True
    """
    name = "vmcgrad.batched_vjp"
    prob, inputs, _ = problem(name, fun, params, samples, chunk_size=chunk_size, memory_budget=memory_budget)
    cotangent = check.as_arrays(name, "cotangent", cotangent)
    check.check_cotangent(name, "cotangent", cotangent, jax.ShapeDtypeStruct((prob.n,), prob.out_dtype))
    check_same_devices(name, "cotangent", cotangent, prob.where)
    return call(vjp_program, prob, inputs, cotangent)


@partial(jax.jit, static_argnums=0)
def vjp_program(prob: Problem, inputs: Inputs, cotangent: jax.Array) -> Any:
    """The compiled ``batched_vjp``: the summed pullback, cast to the parameters' dtypes."""
    return cast_like(vjp_sum(prob, inputs, cotangent), inputs.params)


def vjp_sum(prob: Problem, inputs: Inputs, cotangent: jax.Array) -> Any:
    """Σ_i ct_i ∂f_i/∂θ over all devices, at the accumulation dtype (one chunked pass, one reduction)."""
    sums, _ = map_reduce_problem(prob, inputs, vjp_chunk, (cotangent, SAMPLES), sum_layout=prob.layout)
    return sums


def vjp_chunk(
    fun: Callable, params: Any, x: Any, w: jax.Array, cotangent: jax.Array
) -> tuple[Pullback, tuple]:
    """One chunk's Σ_i w_i ct_i ∂f(θ, σ_i)/∂θ (the summed part; no per-sample part), as a
    :class:`~vmcgrad._runner.primitive.Pullback`: the runner adds it into its accumulators through
    ``f_vjp.with_refs`` (the seed's recipe).

    The pullback is taken with respect to the parameters at the accumulation dtype
    (:func:`vmcgrad._chunks.plan.acc_dtype`; ``fun`` sees them cast back), so the chunk's sum arrives in
    the accumulators' dtype (float32 or better for bfloat16 / float16 parameters).
    """
    ct = jnp.where(w, cotangent, jnp.zeros_like(cotangent))
    return Pullback(lambda p: (fun(cast_like(p, params), x), ct), promote(params)), ()
