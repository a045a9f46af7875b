"""``auto_chunk_size``: what ``chunk_size="auto"`` picks for an estimator, from compiled programs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from vmcgrad._chunks.budget import Choice
from vmcgrad._estimators.grad import grad_program
from vmcgrad._estimators.jvp import jvp_program
from vmcgrad._estimators.vjp import vjp_program
from vmcgrad._hlo.platform import cost_platform, resolve_platform
from vmcgrad._problem.problem import auto_choice, auto_chunk, problem
from vmcgrad._problem.validation import check_memory_budget
from vmcgrad._sr.qgt.qgt import QGT

ESTIMATORS = ("batched_vjp", "batched_jvp", "expect_grad", "QGT")


def auto_chunk_size(
    fun: Callable,
    params: Any,
    samples: Any,
    *,
    estimator: str = "batched_vjp",
    memory_budget: float | None = None,
    platform: str | None = None,
    info: bool = False,
) -> int | Choice:
    r"""The chunk size ``chunk_size="auto"`` picks for ``estimator`` on these inputs.

    Among the powers of two (at most the per-device sample count) whose compiled program —
    temporaries plus arguments and outputs, per device, from ``memory_analysis()`` — fits
    ``memory_budget`` bytes, the one of least modelled time on the platform,
    :math:`n_\text{ops} t_\text{op} + \text{FLOPs}/\text{peak} + \text{bytes}/\text{bandwidth}`
    (:func:`vmcgrad.program_cost`): usually the largest, which walks the fewest trips. The platform
    is ``platform``, else the one of :func:`vmcgrad.cost_platform` or ``$VMCGRAD_COST_PLATFORM``,
    else the devices' own. The candidate programs are compiled, not run; for ``"QGT"`` the
    operator is built first, which runs one pass over the samples (the mean :math:`\bar O`, as
    :func:`vmcgrad.QGT` does). Choices are cached per estimator, function, shapes,
    dtypes, shardings and budget (the same cache the estimators use, so calling them with
    ``chunk_size="auto"`` afterwards compiles no candidate again).

    Args:
        fun: ``fun(params, batch) -> (batch_size,)``, as for :func:`vmcgrad.batched_vjp`.
        params: the parameter pytree.
        samples: the samples (array or pytree, N along axis 0), placed as they will be used.
        estimator: the program to size: ``"batched_vjp"``, ``"batched_jvp"``, ``"expect_grad"``
            or ``"QGT"`` (one product ``S @ v``, in the design :func:`vmcgrad.QGT` picks with the
            chunk: ``vmcgrad.QGT(..., chunk_size="auto").design`` says which).
        memory_budget: bytes per device (any positive real number); default half the free device
            memory where the backend reports it (read once per device), else 2 GiB.
        platform: the platform to choose for, ``"cpu"``, ``"gpu"`` or ``"tpu"`` (the programs are
            still compiled for the devices at hand: their counts price the choice); default as
            :func:`vmcgrad.cost_platform` says.
        info: return the choice's record instead of the chunk.

    Returns:
        The chunk size, a power of two; with ``info=True`` the record of the choice, a
        :class:`vmcgrad._chunks.budget.Choice`: ``value`` (the chunk; for ``"QGT"`` the pair
        ``(design, chunk)``), ``seconds`` (its modelled time), ``platform``, ``memory`` (its compiled
        bytes per device), ``ops``, ``priced`` (each compiled candidate that fits, with its modelled
        time), ``compiled``; ``record.as_dict()`` is JSON-able, for a log.

    Raises:
        MemoryError: if even one sample per chunk does not fit.

    Examples:
        >>> import jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w).sum(-1)
        >>> w, x = jnp.ones((16, 256)), jnp.ones((4096, 16))
        >>> c = vmcgrad.auto_chunk_size(fun, w, x, memory_budget=2**20)  # 1 MiB per device
        >>> c & (c - 1) == 0 and c < 4096  # a power of two, smaller than N
        True
    """
    name = "vmcgrad.auto_chunk_size"
    if platform is None:  # the platform in context (vmcgrad.cost_platform, $VMCGRAD_COST_PLATFORM, devices)
        return _auto_chunk_size(name, fun, params, samples, estimator, memory_budget, info)
    with cost_platform(_checked_platform(name, platform)):
        return _auto_chunk_size(name, fun, params, samples, estimator, memory_budget, info)


def _auto_chunk_size(
    name: str, fun: Callable, params: Any, samples: Any, estimator: str, memory_budget: Any, info: bool
) -> int | Choice:
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"{name}: `estimator` must be one of {ESTIMATORS}; got {estimator!r}. "
            "Fix: pass the name of the function whose chunk you want, e.g. estimator='expect_grad'."
        )
    if estimator == "QGT":
        # the operator's own rule: its products' program at the budget (builds Ō once)
        op = QGT(fun, params, samples, chunk_size="auto", memory_budget=_checked(name, memory_budget))
        return op.choice if info else op.chunk_size
    prob, inputs, _ = problem(name, fun, params, samples, chunk_size="auto", memory_budget=memory_budget)
    per_sample = jax.ShapeDtypeStruct((prob.n,), prob.out_dtype, sharding=_leading_sharding(samples))
    if estimator == "batched_jvp":
        program, args = jvp_program, (inputs, inputs.params)
    else:
        program = vjp_program if estimator == "batched_vjp" else grad_program
        args = (inputs, per_sample)
    return auto_choice(program, prob, *args) if info else auto_chunk(program, prob, *args)


def _checked_platform(name: str, platform: Any) -> Any:
    try:
        return resolve_platform(platform)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: `platform`: {str(err).partition(': ')[2]}") from None


def _checked(name: str, memory_budget: Any) -> Any:
    return check_memory_budget(name, memory_budget)


def _leading_sharding(samples: Any) -> Any:
    leaf = jax.tree.leaves(samples)[0]
    sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:1]))
    return None
