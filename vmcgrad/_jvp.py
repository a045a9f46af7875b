"""``batched_jvp``: per-sample Jacobian-vector products O·t, chunked, no communication."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from . import _validation as check
from ._auto_chunk import run_auto
from ._chunking import map_chunks, plan_chunks
from ._function import join_fun, split_fun
from ._sharding import (
    SampleAxis,
    find_sample_axis,
    local_count,
    pad_to_devices,
    per_device,
    repeat_last,
    replicate,
    to_varying,
    unpad,
)


def batched_jvp(
    fun: Callable[[Any, Any], jax.Array],
    params: Any,
    samples: Any,
    tangent: Any,
    *,
    chunk_size: int | None = None,
) -> jax.Array:
    r"""Per-sample Jacobian-vector products of a batched function, chunk by chunk.

    Computes what ``jax.jvp(lambda p: fun(p, samples), (params,), (tangent,))[1]`` returns,

    .. math::

        (O t)_i = \sum_k \frac{\partial f(\theta, \sigma_i)}{\partial \theta_k} \, t_k ,

    walking each device's samples ``chunk_size`` at a time in one ``lax.scan``. The result is
    sharded like the samples and no data moves between devices.

    Args:
        fun: ``fun(params, batch) -> (batch_size,)`` array, real or complex; a plain callable, or
            a ``jax.tree_util.Partial`` whose arrays are traced (see :func:`batched_vjp`).
        params: a pytree of real and/or complex floating arrays.
        samples: an array, or pytree of arrays, with the N samples along axis 0.
        tangent: a pytree with the structure, shapes and dtypes of ``params``.
        chunk_size: samples per chunk on each device, any positive int, or None for one chunk.

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
    chunk_size = check.check_chunk_size(name, chunk_size)
    params, samples, n, out = check.check_problem(name, fun, params, samples)
    tangent = check.as_arrays(name, "tangent", tangent)
    check.check_tangent(name, tangent, params)
    where = find_sample_axis(samples)
    static, data = split_fun(fun)
    params, tangent, data = replicate((params, tangent, data), where)
    args = (data, params, samples, tangent)
    statics = dict(static=static, where=where, out_dtype=out.dtype)
    if chunk_size == "auto":
        return run_auto(name, _batched_jvp, args, statics, local_count(n, where))
    return _batched_jvp(*args, chunk_size=chunk_size, **statics)


@partial(jax.jit, static_argnames=("static", "chunk_size", "where", "out_dtype"))
def _batched_jvp(data, params, samples, tangent, *, static, chunk_size, where: SampleAxis | None, out_dtype):
    n = jax.tree.leaves(samples)[0].shape[0]
    samples, n_padded = pad_to_devices(samples, where, repeat_last)
    n_local = n_padded if where is None else n_padded // where.size

    def local(data, params, samples, tangent):
        params, tangent = to_varying((params, tangent), where)
        fun = join_fun(static, data)
        init = to_varying(jnp.zeros((n_local,), out_dtype), where)

        def body(x):
            return jax.jvp(lambda p: fun(p, x), (params,), (tangent,))[1]

        return map_chunks(body, plan_chunks(n_local, chunk_size), samples, init)

    run = per_device(local, where, ("params", "params", "samples", "params"), "samples")
    out = run(data, params, samples, tangent)
    return out if n_padded == n else unpad(out, n, where)
