"""The problem every estimator solves: one constructor for the prologue, one way to call a program.

:func:`problem` does, once for every public entry point (``batched_vjp``, ``batched_jvp``,
``expect_grad``, ``QGT``, ``auto_chunk_size``):

1. validation of ``fun``, ``params`` and ``samples`` (:mod:`vmcgrad._validation`), before tracing;
2. the sample axis (:func:`vmcgrad._sharding.find_sample_axis`);
3. replication of concrete parameters and function data onto the sample mesh (one input signature
   whatever their placement, so a second call does not compile again);
4. the parameter layout (replicated or split leaves, :func:`vmcgrad._sharding.layout_of`);
5. the per-device row count after padding to the device count;
6. the chunk size, including ``"auto"`` and the memory budget.

It returns a static, hashable :class:`Problem` and the traced :class:`Inputs`. An estimator's
compiled program is ``program(problem, inputs, *args)`` (``problem`` static), which calls
:func:`vmcgrad._runner.run` with its loop body; :func:`call` runs it, choosing ``"auto"`` chunks from
the compiled program's memory and halving once after an out-of-memory error.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _validation as check
from ._auto_chunk import choose_chunk, default_memory_budget, remember, run_with_oom_retry, signature
from ._function import join_fun, on_chunks, split_fun
from ._runner import Space
from ._sharding import SampleAxis, find_sample_axis, layout_of, local_count, replicate


class Inputs(NamedTuple):
    """The traced data of a problem: the function's arrays, the parameters and the samples."""

    fun_data: tuple
    params: Any
    samples: Any


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one estimator call (hashable: a static argument of ``jax.jit``).

    Attributes:
        name: the public function's name, for messages.
        fun: the static part of the user's function, keyed by identity (:mod:`vmcgrad._function`).
        where: the sample mesh axis, or None on one device.
        layout: per parameter leaf, the dimension split over the sample axis, or None.
        n: N, the global number of samples.
        n_local: rows per device after padding to the device count.
        out_dtype: the dtype of ``fun``'s per-sample output.
        chunk_size: rows per chunk on each device, None for one chunk, or ``"auto"``.
        memory_budget: bytes per device for ``"auto"``, or None for the default.
    """

    name: str
    fun: Any
    where: SampleAxis | None
    layout: tuple
    n: int
    n_local: int
    out_dtype: Any
    chunk_size: int | str | None
    memory_budget: int | None = None

    @property
    def space(self) -> Space:
        """The rows and how each device walks them (:class:`vmcgrad._runner.Space`)."""
        return Space(self.where, self.n, self.n_local, self.chunk_size)

    def user_fun(self, fun_data: tuple) -> Callable:
        """The user's function inside the program, from its static part and traced data; an
        exception it raises on a chunk carries this problem's context
        (:func:`vmcgrad._function.on_chunks`)."""
        return on_chunks(join_fun(self.fun, tuple(fun_data)), self.name, self.n, self.chunk_size)

    def at_chunk(self, chunk_size: int | None) -> Problem:
        """The same problem at a fixed chunk size."""
        return dataclasses.replace(self, chunk_size=chunk_size)


def problem(
    name: str,
    fun: Callable,
    params: Any,
    samples: Any,
    *,
    chunk_size: Any = None,
    memory_budget: Any = None,
    arg: str = "fun",
    extra: Any = (),
) -> tuple[Problem, Inputs, Any]:
    """Validates and places the inputs of ``name`` and returns ``(problem, inputs, extra)``.

    ``extra`` is a pytree of further concrete arrays to replicate with the parameters (a tangent,
    shifts), returned placed.
    """
    check.check_not_in_shard_map(name)
    chunk_size = check.check_chunk_size(name, chunk_size)
    memory_budget = check.check_memory_budget(name, memory_budget)
    params, samples, n, out = check.check_problem(name, fun, params, samples, arg=arg)
    check.warn_if_sharding_unseen(name, samples)
    where = find_sample_axis(samples)
    static, data = split_fun(fun)
    params, data, extra = replicate((params, data, extra), where)
    prob = Problem(
        name=name,
        fun=static,
        where=where,
        layout=layout_of(params, where),
        n=n,
        n_local=local_count(n, where),
        out_dtype=np.dtype(out.dtype),
        chunk_size=chunk_size,
        memory_budget=memory_budget,
    )
    return prob, Inputs(data, params, samples), extra


def call(program: Any, prob: Problem, *args: Any) -> Any:
    """Runs ``program(prob, *args)``; with ``chunk_size="auto"``, at the automatic chunk.

    The chunk is the largest power of two whose compiled program fits the memory budget (cached per
    program, problem and argument signature; nothing runs to choose it). An eager call that still runs
    out of memory is retried once at half the chunk, with a warning, and the smaller chunk is
    remembered.
    """
    if _LOWERING.get():
        chunk = prob.chunk_size if prob.chunk_size != "auto" else auto_chunk(program, prob, *args)
        return program.lower(prob.at_chunk(chunk), *args)
    if prob.chunk_size != "auto":
        return program(prob, *args)
    chunk = auto_chunk(program, prob, *args)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        return program(prob.at_chunk(chunk), *args)
    key, budget = _key(program, prob, args), _budget(prob)
    return run_with_oom_retry(
        lambda c: program(prob.at_chunk(c), *args),
        chunk,
        lambda c: remember(key, prob.n_local, budget, c),
        prob.name,
    )


def auto_chunk(program: Any, prob: Problem, *args: Any) -> int:
    """The automatic chunk of ``program`` on ``args`` (see :func:`call`), compile only."""
    abstract = _abstract(args)

    def compile_at(c):
        return program.lower(prob.at_chunk(c), *abstract).compile()

    return choose_chunk(_key(program, prob, args), prob.n_local, compile_at, _budget(prob), where=prob.name)


def _budget(prob: Problem) -> int:
    return prob.memory_budget if prob.memory_budget is not None else default_memory_budget()


def _key(program: Any, prob: Problem, args: tuple) -> Any:
    return (program, prob.at_chunk("auto"), signature(args))


def _abstract(tree: Any) -> Any:
    """Tracers become ShapeDtypeStructs (lowering happens outside the user's trace)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.Tracer) else x, tree
    )


_LOWERING = contextvars.ContextVar("vmcgrad_lowering", default=False)


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
    from . import _grad, _jvp, _vjp

    allowed = (_vjp.batched_vjp, _jvp.batched_jvp, _grad.expect_grad)
    if estimator not in allowed:
        raise TypeError(
            f"vmcgrad.lower: `estimator` must be vmcgrad.batched_vjp, vmcgrad.batched_jvp or "
            f"vmcgrad.expect_grad; got {estimator!r}. Fix: for a QGT product lower "
            "jax.jit(lambda S, v: S @ v).lower(S, v); for other functions use jax.jit(f).lower(...)."
        )
    token = _LOWERING.set(True)
    try:
        return estimator(*args, **kwargs)
    finally:
        _LOWERING.reset(token)
