"""The problem every estimator solves: one constructor for the prologue, one way to call a program.

:func:`problem` does, once for every public entry point (``batched_vjp``, ``batched_jvp``,
``expect_grad``, ``QGT``, ``auto_chunk_size``):

1. validation of ``fun``, ``params`` and ``samples`` (:mod:`vmcgrad._problem.validation`), before tracing;
2. the sample axis (:func:`vmcgrad._problem.sharding.find_sample_axis`);
3. replication of concrete parameters and function data onto the sample mesh (one input signature
   whatever their placement, so a second call does not compile again);
4. the parameter layout (replicated or split leaves, :func:`vmcgrad._problem.sharding.layout_of`);
5. the per-device row count after padding to the device count;
6. the chunk size, including ``"auto"`` and the memory budget.

It returns a static, hashable :class:`Problem` and the traced :class:`Inputs`. An estimator's
compiled program is ``program(problem, inputs, *args)`` (``problem`` static), which binds the chunked
primitive with its chunk function (:func:`vmcgrad._runner.primitive.map_reduce_problem`); :func:`call` runs
it, choosing ``"auto"`` chunks from
the compiled program's memory and halving once after an out-of-memory error.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from vmcgrad._cache import Cache
from vmcgrad._chunks.budget import Choice, choose_chunk, recorded, remember, signature
from vmcgrad._chunks.default_budget import budget_or_default
from vmcgrad._chunks.plan import ChunkPlan, Space
from vmcgrad._chunks.retry import run_with_oom_retry
from vmcgrad._function import cache_key, join_fun, on_chunks, split_fun, weak_structure
from vmcgrad._hlo.cost import Platform
from vmcgrad._hlo.platform import resolve_platform
from vmcgrad._problem import validation as check
from vmcgrad._problem.sharding import (
    SampleAxis,
    check_not_in_shard_map,
    find_sample_axis,
    layout_of,
    local_count,
    replicate,
    warn_if_sharding_unseen,
)


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
        platform: the platform its automatic choices are priced for, fixed when the problem was made
            for a program whose trace depends on it (:func:`vmcgrad._sr.ntk.modes.pinned`), else None:
            the platform in force at each choice (:func:`cost_platform_of`).
        jacobian_split: what a trace reads from that platform: the parts a chunk's per-sample
            Jacobians are derived in (:func:`vmcgrad._sr.ntk.modes.jacobian_split`), or None where
            no trace reads it. A field, so that ``jax.jit``, which keys a trace by its static
            arguments and not by :func:`vmcgrad.cost_platform`, traces each platform's program anew,
            and so that the automatic chunk's cache (:func:`program_key`) keys it.
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
    platform: Platform | None = None
    jacobian_split: int | None = None

    @property
    def space(self) -> Space:
        """The rows and how each device walks them (:class:`vmcgrad._chunks.plan.Space`)."""
        return Space(self.where, self.n, self.n_local, self.chunk_size)

    @property
    def plan(self) -> ChunkPlan:
        """How each device walks its rows at the (resolved) chunk size (:attr:`Space.plan`)."""
        return self.space.plan

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
    check_not_in_shard_map(name)
    chunk_size = check.check_chunk_size(name, chunk_size)
    memory_budget = check.check_memory_budget(name, memory_budget)
    params, samples, n, out = _check_problem_cached(name, fun, params, samples, arg)
    warn_if_sharding_unseen(name, samples)
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


#: The bound of :data:`_CHECKED`, read at every insertion (0 switches the cache off).
_CHECKED_MAX = 32
#: ``check_problem``'s results (``n``, the output's shape and dtype) per input signature, least
#: recently used last out: what ``jax.jit`` caches a trace by (see :func:`_signature`).
_CHECKED = Cache(maxsize=_CHECKED_MAX, name="check_problem's result per input signature")


def _signature(name: str, fun: Callable, params: Any, samples: Any, arg: str) -> Any:
    """The key of ``check_problem``'s result, or None when it must not be cached.

    Everything the checks read: the entry point and argument names, the function
    (:func:`vmcgrad._function.cache_key`: by weak references, so that the cache keeps no closure
    alive), the tree structures, and every array's shape, dtype, weak type and sharding (the
    function's own arrays included), the x64 flag and the mesh in context. Only concrete JAX arrays
    are cached (not tracers, not NumPy or Python values).
    """
    leaves = jax.tree.leaves((params, samples))
    if not leaves or not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    _, data = split_fun(fun)
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in data):
        return None
    static = cache_key(fun)
    try:
        hash(static)
    except TypeError:
        return None

    def sig(x: jax.Array) -> tuple:
        return (x.shape, x.dtype, x.weak_type, x.sharding)

    return (
        name,
        arg,
        static,
        jax.tree.structure(params),
        jax.tree.structure(samples),
        tuple(map(sig, leaves)),
        tuple(map(sig, data)),
        bool(jax.config.jax_enable_x64),
        jax.sharding.get_abstract_mesh(),
    )


def _check_problem_cached(name: str, fun: Callable, params: Any, samples: Any, arg: str) -> tuple:
    """``check.check_problem``, its result cached per :func:`_signature` (a bounded LRU): a driver
    calling an estimator every step with new values of the same shapes validates once. Failures
    are not cached (bad input raises every time)."""
    key = _signature(name, fun, params, samples, arg)
    if key in _CHECKED:
        return (params, samples, *_CHECKED.get(key))
    params, samples, n, out = check.check_problem(name, fun, params, samples, arg=arg)
    _CHECKED.maxsize = _CHECKED_MAX
    _CHECKED[key] = (n, out)
    return params, samples, n, out


def call(program: Any, prob: Problem, *args: Any, choose: Chooser | None = None) -> Any:
    """Runs ``program(prob, *args)``; with ``chunk_size="auto"``, at the automatic chunk.

    The chunk is, among the powers of two whose compiled program fits the memory budget, the one of
    least modelled time on the problem's platform (:func:`auto_chunk`; cached per program, problem,
    argument signature and platform; nothing runs to choose it), or what ``choose`` returns
    for programs with a knob besides the chunk (:func:`vmcgrad._sr.ntk.dense.choose_dense`). An
    eager call that still runs out of memory is retried once at half the chunk, with a warning, and
    the smaller chunk is remembered.

    Args:
        choose: ``choose(program, prob, *args) -> (chunk, args)``, the chunk and the arguments to run
            at (compile only); default :func:`auto_chunk` with the arguments unchanged.
    """
    if LOWERING.get():
        chunk, args = chosen(program, prob, *args, choose=choose)
        return program.lower(prob.at_chunk(chunk), *args)
    choose = choose or _powers_of_two
    if prob.chunk_size != "auto":
        return program(prob, *args)
    chunk, args = choose(program, prob, *args)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        return program(prob.at_chunk(chunk), *args)
    key, budget, platform = program_key(program, prob, args), budget_of(prob), cost_platform_of(prob)
    return run_with_oom_retry(
        lambda c: program(prob.at_chunk(c), *args),
        chunk,
        lambda c: remember(key, prob.n_local, budget, c, platform),
        prob.name,
    )


#: ``choose(program, prob, *args) -> (chunk, args)``: how :func:`call` resolves ``chunk_size="auto"``.
Chooser = Callable[..., tuple[int, tuple]]


def chosen(program: Any, prob: Problem, *args: Any, choose: Chooser | None = None) -> tuple[Any, tuple]:
    """``(chunk, args)``: the chunk and the arguments :func:`call` runs ``program`` at (compile only:
    ``chunk_size="auto"`` resolved by ``choose``, cached; a given chunk as it is)."""
    if prob.chunk_size != "auto":
        return prob.chunk_size, args
    return (choose or _powers_of_two)(program, prob, *args)


def _powers_of_two(program: Any, prob: Problem, *args: Any) -> tuple[int, tuple]:
    return auto_chunk(program, prob, *args), args


def auto_chunk(program: Any, prob: Problem, *args: Any, candidates: Any = None) -> int:
    """The automatic chunk of ``program`` on ``args`` (see :func:`call`), compile only: among
    ``candidates`` (default: powers of two) whose program fits the budget, the one of least modelled
    time on the problem's platform (:func:`vmcgrad._chunks.budget.choose_chunk`, :func:`cost_platform_of`)."""

    def compile_at(c):
        return compile_only(program, prob.at_chunk(c), *args)

    return choose_chunk(
        program_key(program, prob, args),
        prob.n_local,
        compile_at,
        budget_of(prob),
        where=prob.name,
        candidates=candidates,
        platform=cost_platform_of(prob),
        chunks=True,
    )


def auto_choice(program: Any, prob: Problem, *args: Any, candidates: Any = None) -> Choice | None:
    """The record of :func:`auto_chunk`'s choice for these arguments (chosen first where it was not):
    the chunk, its modelled time, the platform, its footprint (:class:`vmcgrad._chunks.budget.Choice`);
    a chunk remembered after an out-of-memory error has ``seconds`` None."""
    auto_chunk(program, prob, *args, candidates=candidates)
    return recorded(program_key(program, prob, args), prob.n_local, budget_of(prob), cost_platform_of(prob))


def auto_knob(
    program: Any,
    prob: Problem,
    args: tuple,
    candidates: Any,
    at: Callable,
    *,
    name: str,
    info: bool = False,
    first: float | None = None,
    held: int = 0,
) -> Any:
    """Among ``candidates``, values of a knob of ``program`` other than the chunk, the one of least
    modelled time on the problem's platform among those at which it fits the memory budget (the
    largest that fits, and the smaller ones compiled on the way), or None where none does:
    ``at(candidate) -> (chunk, args)``. Compile only, cached (the outcome None too) under the
    program, the problem, the signature of ``args`` and ``name``, which says what the candidates are
    (:func:`vmcgrad._sr.ntk.dense.choose_dense`: one chunk's Jacobian batch). With ``info``, the
    record of the choice (:class:`vmcgrad._chunks.budget.Choice`, its ``cost`` the chosen program's)
    instead of the value; None where none fits. ``first``: where the caller predicts the largest
    fitting candidate (:func:`vmcgrad._chunks.budget.choose_chunk`'s, compiled first); ``held``: the
    bytes every candidate holds besides its arguments and outputs (its search's line starts there)."""

    def compile_at(value):
        chunk, at_args = at(value)
        return compile_only(program, prob.at_chunk(chunk), *at_args)

    key = (program_key(program, prob, args), name)
    budget, platform = budget_of(prob), cost_platform_of(prob)
    value = choose_chunk(
        key,
        prob.n_local,
        compile_at,
        budget,
        where=prob.name,
        candidates=candidates,
        none_fits=None,
        platform=platform,
        chunks=False,
        first=first,
        held=held,
    )
    return recorded(key, prob.n_local, budget, platform) if info else value


def cost_platform_of(prob: Problem) -> Platform:
    """The platform ``prob``'s automatic choices are priced for
    (:func:`vmcgrad._hlo.platform.resolve_platform`): the one fixed when it was made (its
    ``platform``, where the program's trace depends on it), else an override in context or in
    ``$VMCGRAD_COST_PLATFORM``, else the platform of the devices of its sample mesh, else of the
    default device."""
    if prob.platform is not None:
        return prob.platform
    return resolve_platform(mesh=prob.where.mesh if prob.where is not None else None)


def budget_of(prob: Problem) -> int:
    """The memory budget of ``prob``'s automatic choices, bytes per device: its own, else the default
    (:func:`vmcgrad._chunks.default_budget.default_memory_budget`)."""
    return budget_or_default(prob.memory_budget)


def compile_only(program: Any, prob: Problem, *args: Any) -> Any:
    """``program(prob, *args)`` lowered and compiled, not run (traced arguments as their shapes): what
    a choice among programs reads ``memory_analysis()`` from, and the program a caller may then run
    (:func:`vmcgrad._sr.ntk.minsr.update_executable`): JAX keeps the executable of a lowering it has
    seen (the same jaxpr, shardings and options), so the same call again compiles nothing."""
    return program.lower(prob, *_abstract(args)).compile()


def program_key(program: Any, prob: Problem, args: tuple) -> Any:
    """The automatic chunk's cache key: the program, the problem and the arguments' signature, the
    user's function in it through :func:`vmcgrad._function.cache_key` only (held weakly where it can
    be), also where a problem is static data of an argument (an operator's: the arguments' tree
    structure by :func:`vmcgrad._function.weak_structure`)."""
    structure, leaves = signature(args)
    unkeyed = dataclasses.replace(prob, fun=None, chunk_size="auto")
    return Cache.key(prob.fun, program, unkeyed, weak_structure(structure), leaves)


def _abstract(tree: Any) -> Any:
    """Tracers become ShapeDtypeStructs (lowering happens outside the user's trace)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.Tracer) else x, tree
    )


#: True while :func:`vmcgrad.lower` runs an estimator: :func:`call` then lowers instead of running.
LOWERING = contextvars.ContextVar("vmcgrad_lowering", default=False)
