"""``batched_vjp``: Σ_i ct_i ∂f(θ, σ_i)/∂θ, chunked, accumulated in refs, reduced once."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from . import _validation as check
from ._auto_chunk import run_auto
from ._chunking import ChunkPlan, for_each_chunk, plan_chunks, take_chunk
from ._function import join_fun, split_fun
from ._sharding import (
    SampleAxis,
    find_sample_axis,
    gather_params,
    local_count,
    pad_to_devices,
    param_layout,
    param_specs,
    per_device,
    reduce_params,
    repeat_last,
    replicate,
    zeros_rows,
)


def batched_vjp(
    fun: Callable[[Any, Any], jax.Array],
    params: Any,
    samples: Any,
    cotangent: jax.Array,
    *,
    chunk_size: int | None = None,
) -> Any:
    r"""Vector-Jacobian product of a batched function, summed over samples chunk by chunk.

    Computes exactly what ``jax.vjp(lambda p: fun(p, samples), params)[1](cotangent)[0]``
    returns, without ever holding more than ``chunk_size`` samples' activations:

    .. math::

        \mathrm{vjp}(c) = \sum_{i=1}^{N} c_i \, \frac{\partial f(\theta, \sigma_i)}{\partial \theta}

    with JAX's conventions for complex numbers (for real parameters and a complex output the
    result is :math:`\mathrm{Re} \sum_i c_i O_i`; pass ``conj(v)`` to get :math:`\mathrm{Re}(O^\dagger v)`).

    On each device the local samples are walked ``chunk_size`` at a time by one loop; each
    chunk's pullback is added into ``jax.new_ref`` accumulators with ``f_vjp.with_refs``. When the
    samples are split over a mesh axis (their sharding, or the context mesh as NetKet sets it), each
    device works on its own shard and one ``psum`` after the loop is the only communication.

    Args:
        fun: ``fun(params, batch) -> (batch_size,)`` array, real or complex. A plain callable is
            compiled in (cached by identity, as ``jax.jit`` does); a
            ``jax.tree_util.Partial(f, *arrays)`` has its arrays traced instead (model state).
        params: a pytree of real and/or complex floating arrays.
        samples: an array, or pytree of arrays, with the N samples along axis 0.
        cotangent: an array of shape ``(N,)`` with the dtype of ``fun``'s output.
        chunk_size: samples per chunk on each device; any positive int (it need not divide
            anything), or None for one chunk per device.

    Returns:
        A pytree like ``params`` (same structure and dtypes), replicated over the devices.

    Raises:
        TypeError, ValueError: for bad input, before anything is traced.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> ct = jnp.linspace(-1, 1, 10)
        >>> g = vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4)
        >>> (g_ref,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
        >>> bool(jnp.allclose(g, g_ref))
        True
    """
    name = "vmcgrad.batched_vjp"
    chunk_size = check.check_chunk_size(name, chunk_size)
    params, samples, n, out = check.check_problem(name, fun, params, samples)
    cotangent = check.as_arrays(name, "cotangent", cotangent)
    check.check_cotangent(name, "cotangent", cotangent, out)
    where = find_sample_axis(samples)
    static, data = split_fun(fun)
    params, data = replicate((params, data), where)
    layout = param_layout(params, where)
    args = (data, params, samples, cotangent)
    statics = dict(static=static, where=where, layout=layout)
    if chunk_size == "auto":
        return run_auto(name, _batched_vjp, args, statics, local_count(n, where))
    return _batched_vjp(*args, chunk_size=chunk_size, **statics)


@partial(jax.jit, static_argnames=("static", "chunk_size", "where", "layout"))
def _batched_vjp(
    data, params, samples, cotangent, *, static, chunk_size, where: SampleAxis | None, layout=None
):
    (samples, cotangent), n = pad_to_devices((samples, cotangent), where, (repeat_last, zeros_rows))
    n_local = n if where is None else n // where.size
    layout = layout or param_layout(params, None)

    def local(data, params, samples, cotangent):
        params = gather_params(params, layout, where)
        fun = join_fun(static, data)
        acc = accumulate_vjp(fun, params, samples, cotangent, plan_chunks(n_local, chunk_size))
        return reduce_params(acc, layout, where)

    p_specs = "params" if where is None else param_specs(params, layout, where)
    run = per_device(local, where, ("params", p_specs, "samples", "samples"), p_specs)
    return run(data, params, samples, cotangent)


def accumulate_vjp(fun: Callable, params: Any, samples: Any, cotangent: jax.Array, plan: ChunkPlan) -> Any:
    """This device's Σ_i ct_i ∂f(θ, σ_i)/∂θ over its local samples, before any reduction.

    One loop over the chunks of ``plan``; every parameter leaf gets a ref accumulator (all
    leaves or none: mixing refs and values is wrong in jax 0.10.2 when ``fun`` scans, jax#32468).
    """
    accs = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

    def body(k):
        (x, ct), fresh = take_chunk((samples, cotangent), plan, k)
        ct = jnp.where(fresh, ct, jnp.zeros_like(ct))
        _, f_vjp = jax.vjp(lambda p: fun(p, x), params)
        f_vjp.with_refs(accs)(ct)

    for_each_chunk(body, plan)
    return jax.tree.map(jax.ref.freeze, accs)
