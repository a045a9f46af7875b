"""Automatic chunk size: the largest power of two (or other candidate) whose compiled program fits a
memory budget.

NetKet's ``AutoChunkSize`` halves the chunk after an out-of-memory crash. Here the choice is made
before running, from the compiled program itself: for a candidate chunk ``c`` the program is
lowered and compiled (nothing runs) and its per-device footprint

.. math::

    \\mathrm{bytes}(c) = \\mathrm{temp}(c) + \\mathrm{arguments} + \\mathrm{outputs}

(``memory_analysis()``) is compared with the budget. ``temp(c)`` grows with ``c`` and not with N,
so a search over the powers of two finds the largest fitting chunk. It compiles the largest
candidate first (one compilation where all of a device's samples fit in one chunk), then candidates
interpolated from a straight line through the bytes measured so far, and bisects after three
compilations. It finds the chunk a bisection finds, in fewer compilations
(tests/test_param_sharding_and_auto_chunk.py counts them). Choices are cached per program,
function, shapes, dtypes, shardings and budget, so a training loop compiles the candidates once;
the cache is bounded and holds the function weakly (:mod:`vmcgrad._cache`).

Every entry point takes the budget as ``memory_budget=`` (bytes per device). The default budget is
half the device's free memory where the backend reports it (``device.memory_stats()``: GPUs, TPUs),
else :data:`DEFAULT_MEMORY_BUDGET` (CPU reports nothing).
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from vmcgrad._cache import Cache
from vmcgrad._warnings import ChunkRetryWarning

#: Budget in bytes per device when the backend does not report its free memory (CPU): 2 GiB.
DEFAULT_MEMORY_BUDGET = 2 * 2**30
#: Fraction of the reported free device memory used as the default budget.
FREE_MEMORY_FRACTION = 0.5

#: The chunk chosen per (program, function, inputs' signature, samples per device, budget).
_cache = Cache(maxsize=256, name="chunk_size='auto': the chosen chunk")
_RAISE = object()  # choose_chunk's default none_fits: raise MemoryError


def default_memory_budget(device: Any = None) -> int:
    """Half the free memory of ``device`` (default: the first local device), or 2 GiB if unknown."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(FREE_MEMORY_FRACTION * free)
    return DEFAULT_MEMORY_BUDGET


def budget_or_default(budget: int | float | None) -> int | float:
    """``budget`` (bytes per device, as the user gave it), or :func:`default_memory_budget` where it
    is None: every entry point's ``memory_budget=None`` means this."""
    return default_memory_budget() if budget is None else budget


def program_bytes(compiled: Any) -> int:
    """Per-device bytes a compiled program needs: temporaries plus its arguments and outputs."""
    return _measure(compiled)[0]


def signature(tree: Any) -> Hashable:
    """Structure, shapes, dtypes and shardings of a pytree of arrays: a cache key."""
    leaves, treedef = jax.tree.flatten(tree)

    def leaf(x):
        if isinstance(x, str):
            return x  # a static argument (a vector kind)
        if not hasattr(x, "shape"):
            return type(x).__name__  # a Python scalar: traced, its value does not matter
        sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        return tuple(x.shape), str(x.dtype), str(sharding)

    return treedef, tuple(leaf(x) for x in leaves)


def choose_chunk(
    key: Hashable,
    n_local: int,
    compile_at: Callable[[int], Any],
    budget: int,
    *,
    where: str,
    candidates: Sequence[int] | None = None,
    none_fits: Any = _RAISE,
) -> Any:
    """The largest candidate chunk (by default a power of two at most ``n_local``) whose program fits
    ``budget`` bytes.

    Args:
        key: cache key identifying the program, the function and its inputs (see :func:`signature`),
            holding no user function (:func:`vmcgrad._function.cache_key`).
        n_local: samples per device.
        compile_at: ``chunk -> jax.stages.Compiled`` (lowered and compiled, not run).
        budget: bytes per device.
        where: the public function's name, for the error message.
        candidates: the chunks to choose from, increasing (default: the powers of two up to
            ``n_local``); the program's bytes must not decrease along them. Part of the cache key
            through ``key`` only: a caller passing its own must key them.
        none_fits: returned (and cached) where no candidate fits, instead of raising.

    Raises:
        MemoryError: when even a chunk of one sample does not fit (attributes ``need``, the bytes of
            chunk 1, and ``budget``), unless ``none_fits`` is given.
    """
    key = (key, n_local, budget)
    if key in _cache:
        return _cache.get(key)
    if candidates is None:
        candidates = [2**k for k in range(n_local.bit_length())]  # 1, 2, 4, ... <= n_local
    candidates = list(candidates)
    probed: dict[int, tuple[int, int]] = {}  # candidate index -> (bytes, bytes that do not grow with c)
    lo, hi = 0, len(candidates) - 1  # bytes(c) is non-decreasing in c: candidates[:lo] fit, [hi+1:] not
    while lo <= hi:
        i = _next_probe(candidates, probed, lo, hi, budget)
        probed[i] = _measure(compile_at(candidates[i]))
        if probed[i][0] <= budget:
            lo = i + 1
        else:
            hi = i - 1
    if hi < 0 and none_fits is not _RAISE:
        _cache[key] = none_fits
        return none_fits
    if hi < 0:  # not even the smallest chunk (one sample by default) fits
        need = probed[0][0] if 0 in probed else program_bytes(compile_at(candidates[0]))
        smallest = "one sample" if candidates[0] == 1 else f"{candidates[0]} samples"
        err = MemoryError(
            f"{where}: chunk_size='auto' found no chunk that fits the memory budget of {budget} bytes "
            f"per device; even {smallest} per chunk needs {need} bytes. Fix: pass a larger budget to "
            f"{where}, e.g. memory_budget={2 * need}, use more devices, or reduce the model size."
        )
        err.need, err.budget = need, budget  # for callers that word their own advice (vmcgrad.netket)
        raise err
    _cache[key] = candidates[hi]
    return candidates[hi]


#: Compilations guided by the straight-line model before :func:`choose_chunk` bisects.
INTERPOLATED_PROBES = 3


def _measure(compiled: Any) -> tuple[int, int]:
    """(bytes the program needs, its arguments and outputs: the part that does not grow with c)."""
    m = compiled.memory_analysis()
    fixed = int(m.argument_size_in_bytes + m.output_size_in_bytes)
    return int(m.temp_size_in_bytes) + fixed, fixed


def _next_probe(candidates: list[int], probed: dict, lo: int, hi: int, budget: int) -> int:
    """The candidate index to compile next, in ``[lo, hi]``.

    First the largest. Then the largest candidate a straight line ``bytes(c) = a + b c`` puts within
    the budget: through the two measured points nearest the boundary (the largest that fits and the
    smallest that does not, else the two smallest), or after one point through it with ``a`` its
    arguments and outputs. After :data:`INTERPOLATED_PROBES` compilations, or where the line says
    nothing (not growing), the middle of ``[lo, hi]``. Any index in ``[lo, hi]`` keeps the search
    exact; the line only decides how soon it ends.
    """
    if not probed:
        return hi
    if len(probed) >= INTERPOLATED_PROBES:
        return (lo + hi) // 2
    if len(probed) == 1:
        ((i, (total, fixed)),) = probed.items()
        (c1, b1), (c2, b2) = (0, fixed), (candidates[i], total)
    else:
        fit = [i for i in probed if probed[i][0] <= budget]
        over = [i for i in probed if probed[i][0] > budget]
        i, j = (max(fit), min(over)) if fit and over else sorted(probed)[:2]
        (c1, b1), (c2, b2) = (candidates[i], probed[i][0]), (candidates[j], probed[j][0])
    slope = (b2 - b1) / (c2 - c1)
    if slope <= 0:
        return (lo + hi) // 2
    largest = (budget - b1) / slope + c1  # where the line crosses the budget
    k = bisect.bisect_right(candidates, largest) - 1  # the largest candidate below it
    return min(max(k, lo), hi)


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
            f"with chunk_size={smaller}. To avoid this, pass {where} a smaller memory_budget (bytes per "
            "device) or a fixed chunk_size.",
            ChunkRetryWarning,
            stacklevel=3,
        )
        on_retry(smaller)
        return jax.block_until_ready(run(smaller))
