r"""The routes of :func:`vmcgrad.minsr_update` and the rule that chooses one: the fastest that fits.

The update solves one of two dense systems or neither (:data:`ROUTES`): the :math:`NK \times NK`
kernel :math:`T` (``"dense"``), the :math:`P \times P` matrix :math:`S` (``"parameter"``), or the
kernel system matrix-free by preconditioned conjugate gradient (``"cg"``).

The rule (:func:`choose`), for a given memory budget, is the rule of every automatic choice of the
package (the chunk, the QGT's design, the Jacobian batch): a route *fits* when its compiled update
fits the budget at some chunk (``memory_analysis()``, as ``chunk_size="auto"`` sizes every program:
:func:`fit`); among the routes that fit, the one of least modelled time on the platform the choice is
for, :math:`n_\text{ops} t_\text{op} + \text{FLOPs}/\text{peak} + \text{bytes}/\text{bandwidth}`
(:func:`vmcgrad._hlo.cost.program_cost` of the program at the chunk its search chose), is taken. CG's
loop is counted :data:`CG_ITERATIONS` times (:func:`vmcgrad._hlo.cost.expected_trips`). A route whose
matrix alone is over the budget (:func:`floor_bytes`) is not compiled. Only where no route fits, the
matrix-free one included (:func:`vmcgrad.minsr_update` tries it with plain CG too, where its
preconditioner took the room), does the update stop, with the bytes that the smallest one needs
(:class:`NoRouteFits`), before anything runs.

:func:`system_sizes` gives the sides of the two dense systems, :func:`check_route` checks a route a
caller gave (the one place every entry point checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vmcgrad._cache import Cache
from vmcgrad._chunks.budget import Choice, cheapest, program_bytes
from vmcgrad._function import cache_key
from vmcgrad._hlo.cost import ProgramCost, program_cost
from vmcgrad._problem.problem import (
    Inputs,
    Problem,
    auto_choice,
    budget_of,
    compile_only,
    cost_platform_of,
    program_key,
)
from vmcgrad._sr.ntk.dense import KEPT_JACOBIAN_PROGRAMS, choose_dense, dense_choice, keeps_jacobian
from vmcgrad._sr.ntk.modes import k_of, vector_dtype
from vmcgrad._sr.ntk.nystrom import cg_choice, choose_cg

ROUTES = ("dense", "parameter", "cg")

#: Iterations the route's rule expects of the matrix-free route's preconditioned CG: its loop is
#: traced inside :func:`vmcgrad._hlo.cost.expected_trips` with this count, so that the modelled time of
#: the ``"cg"`` program counts its body this many times (its real count depends on the state and the
#: shift; a run logs it as ``cg_iterations``): the bound the issue set for it; ``docs/performance.md``'s
#: measured counts on the 1-D GCNN (36 at the budget's Nyström rank, 30 to 70 at others) sit below it.
CG_ITERATIONS = 50


def system_sizes(mode: str, n: int, params: Any) -> tuple[int, int, int]:
    """``(NK, P, itemsize)``: the sides of the two dense systems, in the mode's parametrisation (P
    counts real entries, a complex leaf twice, except in 'holomorphic' mode), and bytes per entry."""
    leaves = jax.tree.leaves(params)
    split = mode != "holomorphic"
    p = sum(x.size * (2 if split and jnp.iscomplexobj(x) else 1) for x in leaves)
    itemsize = jnp.dtype(vector_dtype(mode, params)).itemsize
    return n * k_of(mode), int(p), int(itemsize)


def check_route(where: str, route: Any, solver: Any) -> str | None:
    """The route a caller fixed (``route``, or ``"cg"`` for ``solver="cg"``), checked; None: the rule
    chooses (:func:`choose`)."""
    if route is not None and (not isinstance(route, str) or route not in ROUTES):
        raise ValueError(
            f"{where}: `route` must be one of {ROUTES} or None; got {route!r}. Fix: leave it None to "
            "take the fastest route that fits the memory budget."
        )
    if isinstance(solver, str):  # "cg"
        if route not in (None, "cg"):
            raise ValueError(
                f"{where}: solver='cg' is the matrix-free route; got route={route!r} with it. Fix: pass "
                "a dense solver (or None) with that route, or drop one of the two."
            )
        return "cg"
    return route


class Sizes(NamedTuple):
    """What the floor of a route's memory depends on (:func:`floor_bytes`): N, K, P (real entries, as
    :func:`system_sizes`), bytes per entry, and the Nyström rank of the ``"cg"`` route."""

    n: int
    k: int
    p: int
    itemsize: int
    rank: int


def sizes_of(mode: str, prob: Problem, inputs: Inputs, rank: int) -> Sizes:
    """The :class:`Sizes` of an update."""
    _, p, itemsize = system_sizes(mode, prob.n, inputs.params)
    return Sizes(prob.n, k_of(mode), p, itemsize, rank)


def floor_bytes(route: str, s: Sizes) -> int:
    """Bytes no program of ``route`` can go below: its dense matrix, once (0 for ``"cg"``)."""
    side = {"dense": s.n * s.k, "parameter": s.p, "cg": 0}[route]
    return side * side * s.itemsize


def chooser(route: str, rank: int = 0) -> Callable | None:
    """The ``choose`` of :func:`vmcgrad._problem.problem.call` for ``chunk_size="auto"`` on ``route``:
    the dense kernel's (:func:`~vmcgrad._sr.ntk.dense.choose_dense`), the matrix-free one's with a
    preconditioner of ``rank`` samples (:func:`~vmcgrad._sr.ntk.nystrom.choose_cg`), else the powers
    of two."""
    if route == "dense":
        return choose_dense
    if route == "cg":
        return partial(choose_cg, rank=rank)
    return None


class Fit(NamedTuple):
    """Whether a route's update fits the budget, at which chunk; where it does not, the bytes it needs
    at its least (one sample per chunk with ``chunk_size="auto"``, else at the given chunk; None where
    it fits); where it fits, the cost of its program at that chunk
    (:class:`vmcgrad._hlo.cost.ProgramCost`), its compiled bytes, the programs compiled to know, and
    whether the program keeps every sample's Jacobian (:func:`~vmcgrad._sr.ntk.dense.keeps_jacobian`,
    the dense route of a program of :data:`~vmcgrad._sr.ntk.dense.KEPT_JACOBIAN_PROGRAMS`)."""

    fits: bool
    chunk: Any
    need: int | None
    cost: ProgramCost | None = None
    memory: int = 0
    compiled: int = 0
    kept: bool = False


#: Where a route's floor (:func:`floor_bytes`) is above this part of the budget, :func:`fit` compiles
#: its one-sample chunk first: its matrix, factor and blocks may well not fit at any chunk.
TIGHT_FLOOR = 0.25


def fit(program: Any, prob: Problem, args: tuple, route: str, floor: int = 0, rank: int = 0) -> Fit:
    """:class:`Fit` of ``program(prob, *args)`` on ``route`` (compile only). With ``chunk_size="auto"``
    the chunk is searched as :func:`vmcgrad._problem.problem.call` searches it, largest candidate
    first (cached: the update's own call compiles nothing more): a route that fits whole costs one
    compilation; one that fits no chunk raises the search's :class:`MemoryError`, whose ``need`` is
    the one-sample chunk's bytes. Where the route's ``floor`` (its dense matrix's bytes) is over
    :data:`TIGHT_FLOOR` of the budget, the one-sample chunk is compiled first instead: a route over
    the budget is then out after one compilation (the search, which would descend to it through
    larger chunks, compiles it no more: the same lowering is cached). The matrix-free route with a
    preconditioner of ``rank`` samples searches its build's Jacobian batch apart from the chunk
    (:func:`~vmcgrad._sr.ntk.nystrom.cg_choice`). The cost is the search's record of the program it
    chose: no program is compiled twice."""
    budget, platform = budget_of(prob), cost_platform_of(prob)
    if prob.chunk_size != "auto":
        compiled = compile_only(program, prob, *args)
        need = program_bytes(compiled)
        if need > budget:
            return Fit(False, prob.chunk_size, need, compiled=1)
        cost, kept = program_cost(compiled, platform), _kept(program, prob, args, route)
        return Fit(True, prob.chunk_size, None, cost, need, 1, kept)
    spent = 0
    if floor > TIGHT_FLOOR * budget:
        need = program_bytes(compile_only(program, prob.at_chunk(1), *args))
        spent = 1
        if need > budget:
            return Fit(False, None, need, compiled=1)
    try:
        if route == "dense":
            chunk, at_args, found = dense_choice(program, prob, *args)
        elif route == "cg" and rank:  # (its preconditioner's batch searched apart from the chunk)
            chunk, at_args, found = cg_choice(program, prob, *args, rank=rank)
        else:
            at_args, found = args, auto_choice(program, prob, *args)
            chunk = found.value
    except MemoryError as err:  # not even one sample per chunk fits
        need = getattr(err, "need", None)
        if need is None:  # (a chooser's own error: the one-sample chunk's bytes)
            need = program_bytes(compile_only(program, prob.at_chunk(1), *args))
        return Fit(False, None, need, compiled=spent + 1)
    kept = _kept(program, prob.at_chunk(chunk), at_args, route)
    if found is None or found.cost is None:  # a chunk remembered after an out-of-memory error
        compiled = compile_only(program, prob.at_chunk(chunk), *at_args)
        cost = program_cost(compiled, platform)
        return Fit(True, chunk, None, cost, program_bytes(compiled), spent + 2, kept)
    return Fit(True, chunk, None, found.cost, found.memory, spent + found.compiled, kept)


def _kept(program: Any, prob: Problem, args: tuple, route: str) -> bool:
    """Whether ``program(prob, *args)`` on ``route`` keeps every sample's Jacobian
    (:func:`~vmcgrad._sr.ntk.dense.keeps_jacobian`; ``args[0]`` the operator)."""
    return route == "dense" and program in KEPT_JACOBIAN_PROGRAMS and keeps_jacobian(prob, args[0])


def fits_at_all(
    program: Any,
    prob: Problem,
    args_at: Callable[[str], tuple],
    sizes: Sizes,
    among: tuple[str, ...] = ROUTES,
) -> bool:
    """Whether some route of ``among`` fits the budget at some chunk, without choosing one: a route
    whose matrix alone is over the budget (:func:`floor_bytes`) is out uncompiled; another fits
    exactly when its program at one sample per chunk does (``chunk_size="auto"``: the chunk search
    takes the bytes as non-decreasing in the chunk, so the smallest candidate decides whether any
    fits; at a chunk given, that chunk's program). One compilation per route compiled, the
    matrix-free one first (its floor is the lowest), stopping at the first that fits: where
    :func:`choose` descends through larger chunks of every route before it knows that none fits.
    Compile only."""
    budget = budget_of(prob)
    at = prob.at_chunk(1) if prob.chunk_size == "auto" else prob
    for route in sorted(among, key=lambda r: floor_bytes(r, sizes)):
        if floor_bytes(route, sizes) > budget:
            continue
        if program_bytes(compile_only(program, at, *args_at(route))) <= budget:
            return True
    return False


class NoRouteFits(MemoryError):
    """No route of the update fits the memory budget. Attributes: ``need`` (the bytes of the smallest
    route, the matrix-free one, at one sample per chunk), ``budget``, ``n`` and ``needs`` (route ->
    bytes at its least, or the floor of a route not compiled)."""

    def __init__(self, message: str, need: int, budget: int, n: int, needs: dict):
        super().__init__(message)
        self.need, self.budget, self.n, self.needs = need, budget, n, needs


def enough(need: int) -> int:
    """A budget that holds the matrix-free route that needs ``need`` bytes at the budget it failed:
    ``2 * need``. Its Nyström preconditioner takes at most half the budget it is given
    (:data:`vmcgrad._sr.ntk.nystrom.BUDGET_FRACTION`), so it may grow with the budget, but the rest of
    the program (at most ``need``) and the preconditioner (at most half of ``2 * need``) fit."""
    return 2 * need


#: The route chosen per update program, arguments' signature, budget, platform and score (or, where
#: none fits, each route's bytes at its least, :class:`_Unfit`).
_CHOSEN = Cache(maxsize=256, name="minsr_update: the route chosen (the fastest that fits)")

#: ``score(choice) -> float``: what :func:`choose` compares in place of the modelled seconds.
Score = Callable[[Choice], float]


def choose(
    where: str,
    program: Any,
    prob: Problem,
    args_at: Callable[[str], tuple],
    sizes: Sizes,
    score: Score | None = None,
    among: tuple[str, ...] = ROUTES,
) -> Choice:
    r"""The route of the update: among the routes ``among`` whose compiled program fits the budget at
    some chunk (:func:`fit`), the one of least modelled time on the problem's platform
    (:func:`vmcgrad._problem.problem.cost_platform_of`: ``vmcgrad.cost_platform(...)``,
    ``$VMCGRAD_COST_PLATFORM``, else the devices'),

    .. math::

        t = n_{\text{ops}}\, t_{\text{op}} + \frac{\text{FLOPs}}{\text{peak}}
            + \frac{\text{bytes}}{\text{bandwidth}}

    (:meth:`vmcgrad._hlo.cost.ProgramCost.time`) of the program at the chunk its own search chose
    (the same rule), read from the programs that search compiled: nothing is compiled to price a
    route. The ``"cg"`` route's loop stops on its tolerance, so its program does not know its trip
    count: it is traced inside :func:`vmcgrad._hlo.cost.expected_trips` with :data:`CG_ITERATIONS`,
    and its body is counted that many times (the Nyström build and the final pass once). A route
    whose matrix alone is over the budget (:func:`floor_bytes`) is not compiled, nor, where the dense
    route fits in one block or keeps every sample's Jacobian over chunks
    (:func:`~vmcgrad._sr.ntk.dense.keeps_jacobian`) and :math:`NK \le P`, are the others: that
    route dominates them (N
    Jacobians derived once, as the parameter route derives them and CG twice per iteration; algebra
    :math:`(NK)^2P + (NK)^3/3` against :math:`NKP^2 + P^3/3`; one loop), so the first update compiles
    one program, as NetKet's does. This is
    :func:`vmcgrad._chunks.budget.cheapest` over the routes (a tie goes to the later of
    :data:`ROUTES`). ``args_at(route)`` gives the program's arguments on that route; ``score``,
    optional, replaces the modelled seconds in the comparison (the record keeps them). Compile
    only; cached.

    Returns:
        A :class:`vmcgrad._chunks.budget.Choice`: ``value`` ``(route, chunk)``, ``seconds`` its
        modelled time, ``platform``, ``memory`` its compiled bytes per device, ``priced`` each route
        that fits with its modelled seconds, ``compiled`` the programs compiled on every route's
        way (the chunk and batch searches under it included), ``cost`` its program's
        :class:`vmcgrad._hlo.cost.ProgramCost`.

    Raises:
        NoRouteFits: when no route fits, not even the matrix-free one (before anything runs).
    """
    budget, platform = budget_of(prob), cost_platform_of(prob)
    key = program_key(program, prob, args_at("cg"))
    key = None if key is None else (key, budget, platform, cache_key(score), sizes, among)
    if key in _CHOSEN:
        known = _CHOSEN.get(key)
        if isinstance(known, _Unfit):  # known not to fit: a fresh error (a raised one keeps its frames)
            raise _no_route(where, prob, budget, dict(known.needs))
        return known
    needs: dict[str, int] = {}
    spent: dict[str, int] = {}  # the programs compiled on each route's way (fitting or not)

    def compile_at(route: str) -> Choice:
        floor = floor_bytes(route, sizes)
        if floor > budget:
            needs[route] = floor
            raise _Over(floor)
        found = fit(program, prob, args_at(route), route, floor, sizes.rank)
        needs[route], spent[route] = found.need, found.compiled
        if not found.fits:
            raise _Over(found.need)
        if found.kept:
            kept.add(route)
        cost = found.cost
        return Choice(
            (route, found.chunk), None, platform.name, found.memory, cost.ops, (), found.compiled, cost
        )

    kept: set[str] = set()

    def bound(route: str, best: Choice) -> float:
        # dense in one block, or keeping every sample's Jacobian over chunks, dominates where
        # NK <= P: N Jacobians derived once (the parameter route derives as many, CG two passes per
        # iteration), (NK)^2 P + (NK)^3/3 FLOPs of algebra against NK P^2 + P^3/3, one loop over the
        # samples: the others are not compiled
        whole = best.value[0] == "dense" and (
            best.value[1] is None or best.value[1] >= prob.n_local or "dense" in kept
        )
        return float("inf") if whole and sizes.n * sizes.k <= sizes.p else 0.0

    try:
        best = cheapest(among, compile_at, budget, platform, bound=None if score else bound, score=score)
    except _Over:
        best = None
    if best is None:
        _CHOSEN[key] = _Unfit(tuple(needs.items()))
        raise _no_route(where, prob, budget, needs)
    priced = tuple((value[0], t) for value, t in best.priced)
    best = best._replace(priced=priced, compiled=sum(spent.values()))
    _CHOSEN[key] = best
    return best


class _Unfit(NamedTuple):
    """What :data:`_CHOSEN` keeps where no route fits: each route's bytes at its least."""

    needs: tuple


class _Over(MemoryError):
    def __init__(self, need: int):
        super().__init__(need)
        self.need = need


def _no_route(where: str, prob: Problem, budget: int, needs: dict) -> NoRouteFits:
    named = {"dense": "the dense kernel", "parameter": "the parameter-space matrix"}
    parts = [f"{named[r]} needs {b} bytes or more" for r, b in needs.items() if r != "cg"]
    if "cg" in needs:
        need = needs["cg"]
        parts.append(f"the smallest, matrix-free CG, {need} at one sample per chunk")
    else:  # (the routes tried exclude CG)
        need = min(needs.values())
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + ", and " + parts[-1]
    return NoRouteFits(
        f"{where}: no route of the update fits the memory budget of {budget} bytes per device at "
        f"N = {prob.n}: {listed}. Fix: pass memory_budget={enough(need)}, fewer samples, or more devices.",
        need,
        budget,
        prob.n,
        needs,
    )


def plain_cg_next(rank: int, nystrom_rank: Any) -> bool:
    """Whether, where no route fits, the rule tries plain CG next (:func:`vmcgrad.minsr_update`, and
    its check of a budget): the Nyström rank it chose itself (``nystrom_rank="auto"``) is not 0, and
    its preconditioner takes half the budget."""
    return bool(rank) and nystrom_rank == "auto"
