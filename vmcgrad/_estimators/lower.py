"""``vmcgrad.lower``: the program an eager estimator call would run, lowered and not run.

:func:`lower` sets :data:`vmcgrad._problem.problem.LOWERING` and calls the estimator: the
estimator's :func:`~vmcgrad._problem.problem.call` then returns the lowered program instead of
running it. It is a module of its own, not part of :mod:`vmcgrad._problem.problem`, because it
imports the estimators (:mod:`vmcgrad._estimators.vjp`, :mod:`vmcgrad._estimators.jvp`,
:mod:`vmcgrad._estimators.grad`), which import :mod:`vmcgrad._problem.problem`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from vmcgrad._estimators import grad as _grad
from vmcgrad._estimators import jvp as _jvp
from vmcgrad._estimators import vjp as _vjp
from vmcgrad._problem.problem import LOWERING


def lower(estimator: Callable, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The lowered program an eager call ``estimator(*args, **kwargs)`` would run, without running it.

    For :func:`vmcgrad.batched_vjp`, :func:`vmcgrad.batched_jvp` and :func:`vmcgrad.expect_grad`:
    the same validation, placement and parameter layout as the eager call (parameter-sharded leaves
    are read from the arrays' concrete shardings, which a user's ``jax.jit`` hides on Auto meshes),
    and for ``chunk_size="auto"`` the chunk it would pick. ``.compile()`` it to read
    ``memory_analysis()`` or :func:`vmcgrad.collective_report`. For a QGT product, lower
    ``jax.jit(lambda S, v: S @ v)`` instead: the operator carries its layout.

    Examples:
        >>> import jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w)
        >>> w, x, ct = jnp.ones(3), jnp.ones((10, 3)), jnp.ones(10)
        >>> compiled = vmcgrad.lower(vmcgrad.batched_vjp, fun, w, x, ct, chunk_size=4).compile()
        >>> vmcgrad.program_bytes(compiled) > 0
        True
    """
    allowed = (_vjp.batched_vjp, _jvp.batched_jvp, _grad.expect_grad)
    if estimator not in allowed:
        raise TypeError(
            f"vmcgrad.lower: `estimator` must be vmcgrad.batched_vjp, vmcgrad.batched_jvp or "
            f"vmcgrad.expect_grad; got {estimator!r}. Fix: for a QGT product lower "
            "jax.jit(lambda S, v: S @ v).lower(S, v); for other functions use jax.jit(f).lower(...)."
        )
    token = LOWERING.set(True)
    try:
        return estimator(*args, **kwargs)
    finally:
        LOWERING.reset(token)
