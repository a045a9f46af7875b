"""Automatic chunk size: among the powers of two (or other candidates) whose compiled program fits a
memory budget, the one of least modelled time on the platform the choice is for.

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
(tests/test_param_sharding_and_auto_chunk.py counts them). Among the fitting chunks the one of least
modelled time :math:`n_\\text{ops} t_\\text{op} + \\text{FLOPs}/\\text{peak} +
\\text{bytes}/\\text{bandwidth}` (:func:`vmcgrad._hlo.cost.program_cost`, with the constants of the
platform :func:`vmcgrad._hlo.platform.resolve_platform` names) is taken (:func:`choose_chunk`; usually
the largest, which walks the fewest trips); :func:`cheapest` is the same rule for a knob whose
candidates are not ordered by memory. Choices are cached per program, function, shapes, dtypes,
shardings, budget and platform, as :class:`Choice` records (the value, its modelled time, the
platform: what a driver logs), so a training loop compiles the candidates once;
the cache is bounded and holds the function weakly (:mod:`vmcgrad._cache`).

Every entry point takes the budget as ``memory_budget=`` (bytes per device). The default budget is
half the device's free memory where the backend reports it (``device.memory_stats()``: GPUs, TPUs),
else 2 GiB (CPU reports nothing), read once per device
(:mod:`vmcgrad._chunks.default_budget`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax

from vmcgrad._cache import Cache
from vmcgrad._chunks.plan import plan_chunks
from vmcgrad._hlo.cost import Platform, ProgramCost, program_cost
from vmcgrad._hlo.platform import resolve_platform

log = logging.getLogger("vmcgrad")  # each candidate a search compiles, at DEBUG (_price)

#: The chunk chosen per (program, function, inputs' signature, samples per device, budget).
_cache = Cache(maxsize=256, name="chunk_size='auto': the chosen chunk")
_RAISE = object()  # choose_chunk's default none_fits: raise MemoryError


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
        return tuple(x.shape), x.dtype, sharding  # (objects: their str() costs a step's time)

    return treedef, tuple(leaf(x) for x in leaves)


class Choice(NamedTuple):
    """An automatic choice and what it was chosen on: the record a driver logs.

    Attributes:
        value: the chosen candidate (a chunk, a design, a route, a batch).
        seconds: its modelled time on ``platform``
            (:meth:`vmcgrad._hlo.cost.ProgramCost.time`: ``ops * t_op + flops / peak +
            bytes / bandwidth``); None where it was not priced (a chunk remembered after an
            out-of-memory error).
        platform: the name of the platform it was priced for (:func:`vmcgrad._hlo.platform.resolve_platform`).
        memory: its compiled footprint in bytes per device (temporaries, arguments, outputs).
        ops: its operations in sequence (trip-weighted; :func:`vmcgrad._hlo.cost.program_cost`).
        priced: ``(candidate, modelled seconds)`` of every candidate compiled and found to fit, the
            chosen one included, in the order they were compiled.
        compiled: the programs compiled to make the choice (fitting or not).
        cost: the chosen program's :class:`vmcgrad._hlo.cost.ProgramCost` (not in :meth:`as_dict`).
        probes: ``(candidate, bytes)`` of every candidate compiled, fitting or not, in the order they
            were compiled (not in :meth:`as_dict`): what a related search can predict its own from.
    """

    value: Any
    seconds: float | None
    platform: str
    memory: int
    ops: float | None = None
    priced: tuple = ()
    compiled: int = 0
    cost: ProgramCost | None = None
    probes: tuple = ()

    def as_dict(self) -> dict:
        """The record as plain JSON-able values (a log's ``info``): everything but ``cost`` and
        ``probes``; a tuple value (a design and its chunk) as a list."""
        record = self._asdict()
        del record["cost"], record["probes"]
        record["value"] = _plain(self.value)
        record["priced"] = [[_plain(v), t] for v, t in self.priced]
        return record


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value if isinstance(value, int | float | str | None) else repr(value)


class _Priced(NamedTuple):
    memory: int
    fixed: int
    cost: ProgramCost | None  # None: over the budget (not priced)


def _price(compiled: Any, budget: int, platform: Platform, candidate: Any = None, where: str = "") -> _Priced:
    """The footprint of a compiled candidate and, where it fits ``budget``, its cost; logged at DEBUG
    (``where``, ``candidate``, its bytes per device, the budget)."""
    memory, fixed = _measure(compiled)
    log.debug("%s: candidate %r compiled, %d bytes per device, budget %d", where, candidate, memory, budget)
    return _Priced(memory, fixed, program_cost(compiled, platform) if memory <= budget else None)


def _better(a: tuple[float, int], b: tuple[float, int] | None) -> bool:
    """``(seconds, -order)`` keys: less time wins; on a tie, the later (larger) candidate."""
    return b is None or a < b


def cheapest(
    candidates: Sequence[Any],
    compile_at: Callable[[Any], Any],
    budget: int,
    platform: str | Platform | None = None,
    *,
    bound: Callable[[Any, Choice], float] | None = None,
    score: Callable[[Choice], float] | None = None,
) -> Choice | None:
    r"""Among ``candidates``, the one whose compiled program fits ``budget`` bytes per device and whose
    modelled time on ``platform`` is least, or None where none fits.

    The reusable chooser of every automatic knob whose candidates are not ordered by memory (MinSR's
    route, the QGT product's design) or are few: each candidate is compiled (nothing runs), its
    footprint :math:`\mathrm{temp} + \mathrm{arguments} + \mathrm{outputs}` (``memory_analysis()``)
    compared with the budget, and a fitting one priced by
    :func:`vmcgrad._hlo.cost.program_cost`,

    .. math::

        t = n_{\text{ops}}\, t_{\text{op}} + \frac{\text{FLOPs}}{\text{peak}}
            + \frac{\text{bytes}}{\text{bandwidth}},

    with the platform's constants (trip-weighted counts: on a GPU or TPU the fewest, largest
    operations win; on a CPU, about the fewest FLOPs and bytes). A tie goes to the later candidate.
    To keep compilations few, ``bound(candidate, best) -> seconds``, a lower bound on a candidate's
    modelled time given the best choice so far, skips (compiles nothing for) a candidate that cannot
    beat it. Order the candidates so that the likely winner comes first.

    For a knob whose memory grows along the candidates (a chunk, a Jacobian batch), use
    :func:`choose_chunk`: it searches for the largest that fits in few compilations, then prices
    only the fitting candidates that could win.

    Args:
        candidates: the values to choose from.
        compile_at: ``candidate -> jax.stages.Compiled`` (lowered and compiled, not run).
        budget: bytes per device.
        platform: the platform to price for (a name of :data:`vmcgrad._hlo.cost.PLATFORMS` or a
            :class:`vmcgrad._hlo.cost.Platform`); None: :func:`vmcgrad._hlo.platform.resolve_platform`
            (an override in context, ``$VMCGRAD_COST_PLATFORM``, else the default device's).
        bound: optional lower bound on a candidate's modelled seconds (its ``score``), given the best
            :class:`Choice` so far.
        score: what is compared, ``score(choice)``; default its modelled seconds. For a platform
            whose constants are known to misprice a knob, a measured rule in its place (the QGT
            design on the CPU: :func:`vmcgrad._sr.qgt.qgt.design_choice`); the record still carries
            the modelled seconds.

    ``compile_at`` may also return a :class:`Choice` already made for the candidate (a design that
    chooses its own chunk with :func:`choose_chunk`), whose ``value`` then stands for the candidate
    (say ``(design, chunk)``), or raise :class:`MemoryError` where nothing of the candidate fits.

    Returns:
        A :class:`Choice` (the candidate, its modelled seconds, the platform, its footprint, the
        priced candidates), or None where no candidate fits. Not cached: a caller that chooses again
        caches the choice under its own key (as :func:`choose_chunk` does).

    Raises:
        MemoryError: where no candidate fits and some raised it (the one needing the least memory).

    Example (MinSR's route, the way its chooser can be wired)::

        choice = cheapest(
            ("kept", "blocks"), lambda r: program.lower(prob, route=r).compile(), budget
        )
        route = choice.value if choice is not None else "blocks"
    """
    p = resolve_platform(platform)
    best: Choice | None = None
    best_key = None
    priced, compiled, errors = [], 0, []
    for order, value in enumerate(candidates):
        if best is not None and bound is not None and bound(value, best) >= best_key[0]:
            continue
        try:
            got = compile_at(value)
        except MemoryError as err:  # a candidate that chooses its own chunk, none of which fits
            errors.append(err)
            continue
        if isinstance(got, Choice):  # already chosen and priced (a knob with its own chunk)
            compiled += got.compiled
            if got.cost is None or got.memory > budget:
                continue
            value, seconds, memory, cost = got.value, got.cost.time(p), got.memory, got.cost
        else:
            priced_one = _price(got, budget, p, value, "cheapest")
            compiled += 1
            if priced_one.cost is None:
                continue
            seconds, memory, cost = priced_one.cost.time(p), priced_one.memory, priced_one.cost
        priced.append((value, seconds))
        choice = Choice(value, seconds, p.name, memory, cost.ops, cost=cost)
        key = (seconds if score is None else score(choice), -order)
        if _better(key, best_key):
            best_key, best = key, choice
    if best is None:
        if errors:
            raise min(errors, key=lambda err: getattr(err, "need", 0))
        return None
    return best._replace(priced=tuple(priced), compiled=compiled)


def choose_chunk(
    key: Hashable,
    n_local: int,
    compile_at: Callable[[int], Any],
    budget: int,
    *,
    where: str,
    candidates: Sequence[int] | None = None,
    none_fits: Any = _RAISE,
    platform: str | Platform | None = None,
    chunks: bool | None = None,
    first: float | None = None,
    held: int = 0,
) -> Any:
    r"""Among the candidate chunks (by default the powers of two at most ``n_local``) whose program
    fits ``budget`` bytes, the one of least modelled time on the platform.

    Two steps, compile only. First the largest candidate that fits: the search of this module's
    docstring (the largest candidate first, then the straight line through the bytes measured, then
    bisection), which compiles a few candidates. Then, among the fitting ones, the least modelled
    time :math:`t = n_\text{ops} t_\text{op} + \text{FLOPs}/\text{peak} +
    \text{bytes}/\text{bandwidth}` (:func:`vmcgrad._hlo.cost.program_cost` on ``platform``): the
    fitting candidates the search compiled are priced as they are; one it did not compile is compiled
    only where the time predicted for it from a priced one, :func:`predicted_seconds` (the chunk
    loop's ops per trip times its trips, FLOPs and bytes in proportion to the rows walked), beats the
    best priced. A smaller chunk walks more trips of the same loop body over about as many rows, so
    on any platform the largest fitting chunk is usually the cheapest and the second step compiles
    nothing; it chooses otherwise where the compiled programs say so (a larger chunk whose program
    moves more bytes per row). A tie goes to the larger chunk.

    The choice is cached per ``key``, ``n_local``, ``budget`` and platform, as a :class:`Choice`
    (:func:`recorded` reads it back).

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
        platform: the platform to price for; None: :func:`vmcgrad._hlo.platform.resolve_platform`.
        chunks: whether the candidates are chunk sizes of ``n_local`` rows (so that the time of one
            not compiled can be predicted from the plan's trips); default: True where ``candidates``
            is None. Where False (the values of another knob), only the compiled ones are priced.
        first: the caller's prediction of the answer: the largest candidate at most ``first`` is
            compiled first, then (where it fits) the next one up; the search stays exact, and a right
            prediction ends it in two compilations. Not in the cache key.
        held: bytes every candidate's program holds besides its arguments and outputs, whatever the
            candidate (a kept Jacobian): the straight line through one compiled candidate starts
            there, not at the arguments and outputs alone, so that its second probe lands near the
            answer. Like ``first``, it decides how soon the search ends, not where; not in the key.

    Returns:
        The chosen candidate (or ``none_fits``).

    Raises:
        MemoryError: when even a chunk of one sample does not fit (attributes ``need``, the bytes of
            chunk 1, and ``budget``), unless ``none_fits`` is given.
    """
    p = resolve_platform(platform)
    key = (key, n_local, budget, p)
    if key in _cache:
        got = _cache.get(key)
        return got.value if isinstance(got, Choice) else got
    if chunks is None:
        chunks = candidates is None
    if candidates is None:
        candidates = [2**k for k in range(n_local.bit_length())]  # 1, 2, 4, ... <= n_local
    candidates = list(candidates)
    probed: dict[int, _Priced] = {}  # candidate index -> its footprint and, where it fits, its cost
    lo, hi = 0, len(candidates) - 1  # bytes(c) is non-decreasing in c: candidates[:lo] fit, [hi+1:] not
    start = None if first is None else min(max(bisect.bisect_right(candidates, first) - 1, lo), hi)
    while lo <= hi:
        if not probed and start is not None:
            i = start
        elif start is not None and len(probed) == 1 and probed[start].memory <= budget:
            i = lo  # the prediction fits: is it the largest? (the next candidate up)
        else:
            measured = {j: (q.memory, q.fixed + held) for j, q in probed.items()}
            i = _next_probe(candidates, measured, lo, hi, budget)
        probed[i] = _price(compile_at(candidates[i]), budget, p, candidates[i], where)
        if probed[i].memory <= budget:
            lo = i + 1
        else:
            hi = i - 1
    if hi < 0 and none_fits is not _RAISE:
        _cache[key] = none_fits
        return none_fits
    if hi < 0:  # not even the smallest chunk (one sample by default) fits
        need = probed[0].memory if 0 in probed else program_bytes(compile_at(candidates[0]))
        smallest = "one sample" if candidates[0] == 1 else f"{candidates[0]} samples"
        err = MemoryError(
            f"{where}: chunk_size='auto' found no chunk that fits the memory budget of {budget} bytes "
            f"per device; even {smallest} per chunk needs {need} bytes. Fix: pass a larger budget to "
            f"{where}, e.g. memory_budget={2 * need}, use more devices, or reduce the model size."
        )
        err.need, err.budget = need, budget  # for callers that word their own advice (vmcgrad.netket)
        raise err
    choice = _least_time(candidates, probed, hi, n_local, compile_at, budget, p, chunks, where)
    _cache[key] = choice
    return choice.value


def _least_time(
    candidates: list,
    probed: dict,
    hi: int,
    n_local: int,
    compile_at: Callable,
    budget: int,
    p: Platform,
    chunks: bool,
    where: str,
) -> Choice:
    """Step two of :func:`choose_chunk`: the least modelled time among ``candidates[: hi + 1]`` (all
    fit), pricing the probed ones and compiling an unprobed one only where its predicted time beats
    the best priced."""

    def best_of() -> int:
        fitting = [i for i in probed if i <= hi and probed[i].cost is not None]
        return min(fitting, key=lambda i: (probed[i].cost.time(p), -i))

    best = best_of()
    if chunks:
        for i in sorted(set(range(hi + 1)) - set(probed), reverse=True):
            b = probed[best]
            guess = predicted_seconds(b.cost, n_local, candidates[best], candidates[i], p)
            if guess < b.cost.time(p):
                probed[i] = _price(compile_at(candidates[i]), budget, p, candidates[i], where)
                best = best_of()
    b = probed[best]
    priced = tuple(
        (candidates[i], q.cost.time(p)) for i, q in probed.items() if i <= hi and q.cost is not None
    )
    probes = tuple((candidates[i], q.memory) for i, q in probed.items())
    return Choice(
        candidates[best], b.cost.time(p), p.name, b.memory, b.cost.ops, priced, len(probed), b.cost, probes
    )


def predicted_seconds(cost: ProgramCost, n_local: int, chunk: int, other: int, platform: Platform) -> float:
    r"""The modelled time of the same program at chunk ``other``, predicted from its ``cost`` at
    ``chunk`` without compiling it.

    The plan walks :math:`k` chunks of :math:`s` rows (:func:`vmcgrad._chunks.plan.plan_chunks`) in
    one loop whose body does not change with the chunk's size. With :math:`o` the ops of one trip of
    that loop (the loop of :math:`k` trips in ``cost.loops``; all the program's ops where it has none,
    one chunk), the prediction at :math:`k', s'` is

    .. math::

        t' = \bigl(n_\text{ops} + (k' - k)\, o\bigr) t_\text{op}
             + \Bigl(\frac{\text{FLOPs}}{\text{peak}} + \frac{\text{bytes}}{\text{bandwidth}}\Bigr)
               \frac{k' s'}{k s}.
    """
    k, s = _plan(n_local, chunk)
    k2, s2 = _plan(n_local, other)
    per_trip = _trip_ops(cost.loops, k) if k > 1 else None
    per_trip = cost.ops if per_trip is None else per_trip
    rest = cost.flops / platform.peak_flops + cost.bytes / platform.bandwidth
    return (cost.ops + (k2 - k) * per_trip) * platform.t_op + rest * (k2 * s2) / (k * s)


def _plan(n: int, chunk: int) -> tuple[int, int]:
    plan = plan_chunks(n, chunk)
    return plan.count, plan.size


def _trip_ops(loops: tuple, trips: int) -> float | None:
    """Ops per trip of the outermost loop of ``trips`` trips (breadth first), or None."""
    level = list(loops)
    while level:
        for lp in level:
            if lp.trip_count == trips:
                return lp.ops_per_trip
        level = [inner for lp in level for inner in lp.loops]
    return None


def recorded(
    key: Hashable, n_local: int, budget: int, platform: str | Platform | None = None
) -> Choice | None:
    """The :class:`Choice` :func:`choose_chunk` cached for these arguments (None: not chosen yet, or
    none fitted)."""
    got = _cache.get((key, n_local, budget, resolve_platform(platform)))
    return got if isinstance(got, Choice) else None


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
    arguments and outputs and the bytes the caller knows every candidate holds (``probed``'s second
    entries). After :data:`INTERPOLATED_PROBES` compilations, or where the line says nothing (not
    growing), the middle of ``[lo, hi]``, except where the line puts the answer at the largest
    candidate known to fit: then the next one up, whose compilation ends the search if it does not
    fit. Any index in ``[lo, hi]`` keeps the search exact; the line only decides how soon it ends.
    """
    if not probed:
        return hi
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
    if len(probed) >= INTERPOLATED_PROBES:  # bisection, but where the line confirms its answer
        return lo if k < lo else (lo + hi) // 2
    return min(max(k, lo), hi)


def remember(
    key: Hashable, n_local: int, budget: int, chunk: int, platform: str | Platform | None = None
) -> None:
    """Records a smaller chunk for ``key`` after an out-of-memory error at run time (unpriced)."""
    p = resolve_platform(platform)
    _cache[(key, n_local, budget, p)] = Choice(chunk, None, p.name, 0)
