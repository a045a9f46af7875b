r"""The routes of :func:`vmcgrad.minsr_update` and the rule that chooses one: the fastest that fits.

The update solves one of two dense systems or neither (:data:`ROUTES`): the :math:`NK \times NK`
kernel :math:`T` (``"dense"``), the :math:`P \times P` matrix :math:`S` (``"parameter"``), or the
kernel system matrix-free by preconditioned conjugate gradient (``"cg"``).

The rule (:func:`choose`), for a given memory budget: a route *fits* when its compiled update fits
the budget at some chunk (``memory_analysis()``, as ``chunk_size="auto"`` sizes every program:
:func:`fit`); among the routes that fit, the one of least modelled time is taken
(:func:`modelled_flops`, or any ``cost`` plugged in). The routes are tried in the order of their
least possible time (each at its largest chunk); a route whose least time is no better than that
of a route found to fit is not compiled, nor is one whose matrix alone is over the budget
(:func:`floor_bytes`). Only where no route fits, the matrix-free one included, does the update stop,
with the bytes that the smallest one needs (:class:`NoRouteFits`), before anything runs.

:func:`system_sizes` gives the sides of the two dense systems, :func:`check_route` checks a route a
caller gave (the one place every entry point checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vmcgrad._cache import Cache
from vmcgrad._chunks.budget import program_bytes, signature
from vmcgrad._function import cache_key
from vmcgrad._problem.problem import Inputs, Problem, auto_chunk, budget_of, compile_only, program_key
from vmcgrad._sr.ntk.dense import choose_dense
from vmcgrad._sr.ntk.modes import k_of, vector_dtype

ROUTES = ("dense", "parameter", "cg")

#: Iterations the cost model expects of the matrix-free route's preconditioned CG (its real count
#: depends on the state and the shift; a run logs it as ``cg_iterations``): the bound the issue set
#: for it, ``docs/performance.md``'s measured counts on the 1-D GCNN sit below it.
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
    """What the cost of a route depends on: N, K, P (real entries, as :func:`system_sizes`), bytes
    per entry, the model's FLOPs per sample (:func:`forward_flops`), the Nyström rank of the
    ``"cg"`` route, whether the dense algebra is complex ('holomorphic'), and the passes over the rows
    that build the Nyström columns (:attr:`vmcgrad._sr.ntk.nystrom.Plan.passes`)."""

    n: int
    k: int
    p: int
    itemsize: int
    forward: float
    rank: int
    complex: bool
    passes: int = 1


def sizes_of(mode: str, prob: Problem, inputs: Inputs, rank: int, passes: int = 1) -> Sizes:
    """The :class:`Sizes` of an update (``passes``: the Nyström build's, for ``rank``)."""
    _, p, itemsize = system_sizes(mode, prob.n, inputs.params)
    forward = forward_flops(prob, inputs)
    if forward <= 0:  # (no cost analysis on this backend: a dense layer's)
        forward = 2.0 * p
    return Sizes(prob.n, k_of(mode), p, itemsize, forward, rank, mode == "holomorphic", passes)


def modelled_flops(route: str, s: Sizes, chunk: int | None) -> float:
    r"""The FLOPs of one update on ``route`` at ``chunk`` (None: one chunk), the default cost of
    :func:`choose`.

    With :math:`F` the model's FLOPs per sample, a per-sample Jacobian costs :math:`(1 + 2K)F` (one
    forward pass, K reverse passes), a jvp or vjp pass :math:`3F` per sample, and the dense algebra
    as counted (a complex multiply-add 4 real ones, 'holomorphic'):

    * ``"dense"``: :math:`N(1 + (N - c)/2c)` Jacobians (:mod:`vmcgrad._sr.ntk.dense`; N in one
      block), the kernel :math:`2(NK)^2P` (half of it in blocks, the other half filled), its factor
      :math:`(NK)^3/3` and one vjp pass;
    * ``"parameter"``: N Jacobians, :math:`S` :math:`2NKP^2`, its factor :math:`P^3/3`, one vjp pass;
    * ``"cg"``: the Nyström preconditioner of rank r built in m passes over the rows (:math:`mN + r`
      Jacobians, :math:`2NK\,rK\,P`)
      and :data:`CG_ITERATIONS` iterations of one jvp and one vjp pass and the preconditioner's
      :math:`4NK\,rK`.

    One rate for all FLOPs: a model's passes run slower per FLOP than a matrix product, so the
    model favours the matrix-free route somewhat; ``docs/performance.md`` has the measured times.
    """
    n, k, p, f = s.n, s.k, s.p, s.forward
    c = n if chunk is None else min(int(chunk), n)
    jac, one_pass, alg = (1 + 2 * k) * f, 3 * f, 4 if s.complex else 1
    nk = n * k
    if route == "dense":
        jacobians = n * (1 + max(0, n - c) / (2 * c))
        kernel = (2 if c >= n else 1) * nk * nk * p
        return jacobians * jac + alg * (kernel + nk**3 / 3) + n * one_pass
    if route == "parameter":
        return n * jac + alg * (2 * nk * p * p + p**3 / 3) + n * one_pass
    r = s.rank
    build = (s.passes * n + r) * jac + alg * 2 * nk * r * k * p if r else 0.0
    return build + CG_ITERATIONS * (2 * n * one_pass + alg * 4 * nk * r * k)


def floor_bytes(route: str, s: Sizes) -> int:
    """Bytes no program of ``route`` can go below: its dense matrix, once (0 for ``"cg"``)."""
    side = {"dense": s.n * s.k, "parameter": s.p, "cg": 0}[route]
    return side * side * s.itemsize


def chooser(route: str) -> Callable | None:
    """The ``choose`` of :func:`vmcgrad._problem.problem.call` for ``chunk_size="auto"`` on ``route``:
    the dense kernel's (:func:`~vmcgrad._sr.ntk.dense.choose_dense`), else the powers of two."""
    return choose_dense if route == "dense" else None


class Fit(NamedTuple):
    """Whether a route's update fits the budget, at which chunk, and the bytes it needs at its least
    (one sample per chunk with ``chunk_size="auto"``, else at the given chunk)."""

    fits: bool
    chunk: Any
    need: int


def fit(program: Any, prob: Problem, args: tuple, route: str) -> Fit:
    """:class:`Fit` of ``program(prob, *args)`` on ``route`` (compile only). With ``chunk_size="auto"``
    a chunk of one sample is compiled first (the least any chunk needs: a route whose one-sample
    chunk is over the budget is out after one compilation), then the chunk is searched as
    :func:`vmcgrad._problem.problem.call` searches it (cached: the update's own call compiles
    nothing more)."""
    budget = budget_of(prob)
    if prob.chunk_size != "auto":
        need = program_bytes(compile_only(program, prob, *args))
        return Fit(need <= budget, prob.chunk_size, need)
    need = program_bytes(compile_only(program, prob.at_chunk(1), *args))
    if need > budget:
        return Fit(False, None, need)
    choose = chooser(route)
    try:
        if choose is None:
            chunk = auto_chunk(program, prob, *args)
        else:
            chunk, _ = choose(program, prob, *args)
    except MemoryError as err:  # (a chunk's bytes were not monotone)
        return Fit(False, None, getattr(err, "need", need))
    return Fit(True, chunk, need)


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


#: The route chosen per update program, arguments' signature and budget (cost function included).
_CHOSEN = Cache(maxsize=256, name="minsr_update: the route chosen (the fastest that fits)")

Cost = Callable[[str, Sizes, Any], float]


def choose(
    where: str, program: Any, prob: Problem, args_at: Callable[[str], tuple], sizes: Sizes, cost: Cost = None
) -> str:
    """The route of the update: among those whose compiled program fits the budget, the one of least
    ``cost(route, sizes, chunk)`` (default :func:`modelled_flops`; any modelled or measured time of
    the same signature can be plugged in). ``args_at(route)`` gives the program's arguments on that
    route. Compile only; cached.

    Raises:
        NoRouteFits: when not even the matrix-free route fits (before anything runs).
    """
    cost = cost or modelled_flops
    budget = budget_of(prob)
    key = program_key(program, prob, args_at("cg"))
    key = None if key is None else (key, budget, cache_key(cost), sizes)
    if key in _CHOSEN:
        return _CHOSEN.get(key)
    least = lambda r: cost(r, sizes, prob.n_local)  # each route at its largest chunk
    best, needs = None, {}
    for route in sorted(ROUTES, key=least):
        if best is not None and least(route) >= best[1]:
            break
        floor = floor_bytes(route, sizes)
        if floor > budget:
            needs[route] = floor
            continue
        found = fit(program, prob, args_at(route), route)
        needs[route] = found.need
        if found.fits:
            t = cost(route, sizes, found.chunk)
            if best is None or t < best[1]:
                best = (route, t)
    if best is None:
        need = needs["cg"]
        raise NoRouteFits(
            f"{where}: no route of the update fits the memory budget of {budget} bytes per device at "
            f"N = {prob.n}: the dense kernel needs {needs['dense']} bytes or more, the parameter-space "
            f"matrix {needs['parameter']} or more, and the smallest, matrix-free CG, {need} at one "
            f"sample per chunk. Fix: pass memory_budget={enough(need)}, fewer samples, or more devices.",
            need,
            budget,
            prob.n,
            needs,
        )
    _CHOSEN[key] = best[0]
    return best[0]


#: The model's FLOPs per sample per function and input signature (:func:`forward_flops`).
_FORWARD = Cache(maxsize=64, name="minsr_update's route choice: the model's FLOPs per sample")


def forward_flops(prob: Problem, inputs: Inputs, rows: int = 8) -> float:
    """The model's FLOPs per sample: XLA's cost analysis of one call on ``rows`` samples (no loop:
    its count is the program's), divided by ``rows``; 0 where the backend gives none."""
    b = min(prob.n_local, rows)
    plain = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    data, params = jax.tree.map(plain, (tuple(inputs.fun_data), inputs.params))
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *a.shape[1:]), a.dtype), inputs.samples)
    key = Cache.key(prob.fun, signature((data, params, x)))
    if key in _FORWARD:
        return _FORWARD.get(key)
    call = jax.jit(lambda d, p, x: prob.user_fun(d)(p, x))
    try:
        analysis = call.lower(data, params, x).compile().cost_analysis()
    except Exception:  # a backend without a cost analysis: the caller's fallback
        analysis = None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    flops = float((analysis or {}).get("flops", 0.0)) / b
    _FORWARD[key] = flops
    return flops
