"""Interim: the automatic chunk for each estimator (to be replaced by the one Problem)."""

from __future__ import annotations

import jax

from . import _validation as check
from ._auto_chunk import ESTIMATORS, _leading_sharding, choose_for
from ._function import split_fun
from ._sharding import find_sample_axis, local_count, param_layout, replicate


def auto_chunk_for(fun, params, samples, *, estimator: str, memory_budget) -> int:
    name = "vmcgrad.auto_chunk_size"
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"{name}: `estimator` must be one of {ESTIMATORS}; got {estimator!r}. "
            "Fix: pass the name of the function whose chunk you want, e.g. estimator='expect_grad'."
        )
    params, samples, n, out = check.check_problem(name, fun, params, samples)
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or memory_budget <= 0
    ):
        raise ValueError(
            f"{name}: `memory_budget` must be a positive number of bytes; got {memory_budget!r}. "
            "Fix: pass e.g. memory_budget=2**30, or None for the default."
        )
    memory_budget = None if memory_budget is None else int(memory_budget)
    if estimator == "QGT":
        from ._qgt import QGT, _auto_chunk_size

        op = QGT(fun, params, samples, chunk_size=1)
        return _auto_chunk_size(op) if memory_budget is None else _auto_chunk_size(op, memory_budget)
    where = find_sample_axis(samples)
    static, data = split_fun(fun)
    params, data = replicate((params, data), where)
    sh = _leading_sharding(samples)
    per_sample = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=sh)
    if estimator == "batched_vjp":
        from ._vjp import _batched_vjp as jitted

        statics = dict(static=static, where=where, layout=param_layout(params, where))
    elif estimator == "expect_grad":
        from ._grad import _expect_grad as jitted

        statics = dict(static=static, where=where, out_dtype=out.dtype, layout=param_layout(params, where))
    else:
        from ._jvp import _batched_jvp as jitted

        statics = dict(static=static, where=where, out_dtype=out.dtype)
        per_sample = params
    args = (data, params, samples, per_sample)
    return choose_for(name, jitted, args, statics, local_count(n, where), memory_budget=memory_budget)
