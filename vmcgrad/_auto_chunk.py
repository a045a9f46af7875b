"""Automatic chunk size: the largest power of two whose compiled program fits a memory budget.

NetKet's ``AutoChunkSize`` halves the chunk after an out-of-memory crash. Here the choice is made
before running, from the compiled program itself: for a candidate chunk ``c`` the program is
lowered and compiled (nothing runs) and its per-device footprint

.. math::

    \\mathrm{bytes}(c) = \\mathrm{temp}(c) + \\mathrm{arguments} + \\mathrm{outputs}

(``memory_analysis()``) is compared with the budget. ``temp(c)`` grows with ``c`` and not with N,
so a binary search over powers of two finds the largest fitting chunk in ``log2`` compilations.
Choices are cached per program, shapes, dtypes, shardings and budget, so a training loop compiles
the candidates once.

The default budget is half the device's free memory where the backend reports it
(``device.memory_stats()``: GPUs, TPUs), else :data:`DEFAULT_MEMORY_BUDGET` (CPU reports nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax

#: Budget in bytes per device when the backend does not report its free memory (CPU): 2 GiB.
DEFAULT_MEMORY_BUDGET = 2 * 2**30
#: Fraction of the reported free device memory used as the default budget.
FREE_MEMORY_FRACTION = 0.5

_cache: dict[Hashable, int] = {}


def default_memory_budget(device: Any = None) -> int:
    """Half the free memory of ``device`` (default: the first local device), or 2 GiB if unknown."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(FREE_MEMORY_FRACTION * free)
    return DEFAULT_MEMORY_BUDGET


def program_bytes(compiled: Any) -> int:
    """Per-device bytes a compiled program needs: temporaries plus its arguments and outputs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def signature(tree: Any) -> Hashable:
    """Structure, shapes, dtypes and shardings of a pytree of arrays: a cache key."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves)


def choose_chunk(
    key: Hashable, n_local: int, compile_at: Callable[[int], Any], budget: int, *, where: str
) -> int:
    """The largest power-of-two chunk (at most ``n_local``) whose program fits ``budget`` bytes.

    Args:
        key: cache key identifying the program and its inputs (see :func:`signature`).
        n_local: samples per device.
        compile_at: ``chunk -> jax.stages.Compiled`` (lowered and compiled, not run).
        budget: bytes per device.
        where: the public function's name, for the error message.

    Raises:
        MemoryError: when even a chunk of one sample does not fit.
    """
    key = (key, n_local, budget)
    if key in _cache:
        return _cache[key]
    candidates = [2**k for k in range(n_local.bit_length()) if 2**k <= n_local]
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:  # bytes(c) is non-decreasing in c
        mid = (lo + hi) // 2
        if program_bytes(compile_at(candidates[mid])) <= budget:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        need = program_bytes(compile_at(1))
        raise MemoryError(
            f"{where}: chunk_size='auto' found no chunk that fits the memory budget of {budget} bytes "
            f"per device; even one sample per chunk needs {need} bytes. Fix: pass a larger "
            "memory_budget, use more devices, or reduce the model size."
        )
    _cache[key] = best
    return best


def remember(key: Hashable, n_local: int, budget: int, chunk: int) -> None:
    """Records a smaller chunk for ``key`` after an out-of-memory error at run time."""
    _cache[(key, n_local, budget)] = chunk


def run_with_oom_retry(run: Callable[[int], Any], chunk: int, on_retry: Callable[[int], None], where: str):
    """Runs ``run(chunk)``; on a RESOURCE_EXHAUSTED error, warns, halves the chunk and retries once."""
    try:
        return jax.block_until_ready(run(chunk))
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err) or chunk == 1:
            raise
        smaller = max(1, chunk // 2)
        warnings.warn(
            f"{where}: out of memory at chunk_size={chunk} chosen by chunk_size='auto'; retrying once "
            f"with chunk_size={smaller}. Pass memory_budget (or a fixed chunk_size) to avoid this.",
            RuntimeWarning,
            stacklevel=3,
        )
        on_retry(smaller)
        return jax.block_until_ready(run(smaller))


def _abstract(tree: Any) -> Any:
    """Tracers become ShapeDtypeStructs (lowering happens outside the user's trace)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.Tracer) else x, tree
    )


def run_auto(
    name: str,
    jitted: Any,
    args: tuple,
    static_kwargs: dict,
    n_local: int,
    *,
    memory_budget: int | None = None,
) -> Any:
    """Calls ``jitted(*args, chunk_size=c, **static_kwargs)`` with ``c`` chosen automatically.

    ``c`` is the largest power of two whose compiled program fits ``memory_budget`` bytes per device
    (default :func:`default_memory_budget`), cached; an eager call that still runs out of memory is
    retried once at ``c // 2`` with a warning, and the smaller chunk is remembered.
    """
    chunk = choose_for(name, jitted, args, static_kwargs, n_local, memory_budget=memory_budget)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        return jitted(*args, chunk_size=chunk, **static_kwargs)
    budget = memory_budget or default_memory_budget()
    key = _key(jitted, args, static_kwargs)
    return run_with_oom_retry(
        lambda c: jitted(*args, chunk_size=c, **static_kwargs),
        chunk,
        lambda c: remember(key, n_local, budget, c),
        name,
    )


def choose_for(
    name: str, jitted: Any, args: tuple, static_kwargs: dict, n_local: int, *, memory_budget: int | None
) -> int:
    """The automatic chunk for ``jitted`` on ``args`` (see :func:`run_auto`), without running it."""
    budget = memory_budget or default_memory_budget()
    abstract = _abstract(args)

    def compile_at(c):
        return jitted.lower(*abstract, chunk_size=c, **static_kwargs).compile()

    return choose_chunk(_key(jitted, args, static_kwargs), n_local, compile_at, budget, where=name)


def _key(jitted: Any, args: tuple, static_kwargs: dict) -> Hashable:
    return (jitted, signature(args), tuple(sorted(static_kwargs.items())))


ESTIMATORS = ("batched_vjp", "batched_jvp", "expect_grad", "QGT")


def auto_chunk_size(
    fun: Callable,
    params: Any,
    samples: Any,
    *,
    estimator: str = "batched_vjp",
    memory_budget: float | None = None,
) -> int:
    """The chunk size ``chunk_size="auto"`` picks for ``estimator`` on these inputs.

    The largest power of two (at most the per-device sample count) whose compiled program —
    temporaries plus arguments and outputs, per device, from ``memory_analysis()`` — fits
    ``memory_budget`` bytes. Nothing is run; choices are cached per estimator, function, shapes,
    dtypes, shardings and budget.

    Args:
        fun: ``fun(params, batch) -> (batch_size,)``, as for :func:`vmcgrad.batched_vjp`.
        params: the parameter pytree.
        samples: the samples (array or pytree, N along axis 0), placed as they will be used.
        estimator: the program to size: ``"batched_vjp"``, ``"batched_jvp"``, ``"expect_grad"``
            or ``"QGT"`` (one product ``S @ v``).
        memory_budget: bytes per device (any positive real number); default half the free device
            memory where the backend reports it, else :data:`DEFAULT_MEMORY_BUDGET`.

    Returns:
        The chunk size, a power of two.

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
    from ._problem import auto_chunk_for

    return auto_chunk_for(fun, params, samples, estimator=estimator, memory_budget=memory_budget)


def _leading_sharding(samples: Any) -> Any:
    leaf = jax.tree.leaves(samples)[0]
    sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:1]))
    return None
