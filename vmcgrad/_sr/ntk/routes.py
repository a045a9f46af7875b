r"""The routes of :func:`vmcgrad.minsr_update` and the rule that chooses one.

The update solves one of two dense systems or neither (:data:`ROUTES`): the :math:`NK \times NK`
kernel :math:`T` (``"dense"``), the :math:`P \times P` matrix :math:`S` (``"parameter"``), or the
kernel system matrix-free by conjugate gradient (``"cg"``). :func:`system_sizes` gives the sides of
the two dense systems, :func:`choose_route` picks a route from them and the budget, and
:func:`resolve_route` checks a route the caller gave (the one place every entry point checks it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._chunks.budget import default_memory_budget
from vmcgrad._sr.ntk.modes import k_of, vector_dtype

ROUTES = ("dense", "parameter", "cg")


def system_sizes(mode: str, n: int, params: Any) -> tuple[int, int, int]:
    """``(NK, P, itemsize)``: the sides of the two dense systems, in the mode's parametrisation (P
    counts real entries, a complex leaf twice, except in 'holomorphic' mode), and bytes per entry."""
    leaves = jax.tree.leaves(params)
    split = mode != "holomorphic"
    p = sum(x.size * (2 if split and jnp.iscomplexobj(x) else 1) for x in leaves)
    itemsize = jnp.dtype(vector_dtype(mode, params)).itemsize
    return n * k_of(mode), int(p), int(itemsize)


def choose_route(nk: int, p: int, itemsize: int, budget: float) -> str:
    r"""The route of the update, from the sizes of its two dense systems and the budget.

    The smaller of the kernel (side :math:`NK`) and the parameter-space matrix (side :math:`P`) is
    solved densely when it and its factor, :math:`2 d^2` entries, fit ``budget``: the smaller system
    costs less to build (:math:`NKd` per sample against the other's larger side) and to factor
    (:math:`d^3/3`), and both derive each row's Jacobian at most as often. Ties go to ``"dense"`` (the
    kernel, NetKet's MinSR system). When the smaller does not fit, neither does the larger:
    ``"cg"``, matrix-free.

    Args:
        nk: side of the kernel (N·K). p: side of the parameter-space matrix.
        itemsize: bytes per entry. budget: bytes per device.
    """
    route, side = ("parameter", p) if p < nk else ("dense", nk)
    return route if 2 * side * side * itemsize <= budget else "cg"


def resolve_route(
    where: str, route: Any, solver: Any, mode: str, n: int, params: Any, budget: float | None
) -> str:
    """The route the update takes: ``route`` checked, or :func:`choose_route` (``"cg"`` for
    ``solver="cg"``)."""
    if route is not None and (not isinstance(route, str) or route not in ROUTES):
        raise ValueError(
            f"{where}: `route` must be one of {ROUTES} or None; got {route!r}. Fix: leave it None to "
            "choose from N, P and the memory budget."
        )
    if isinstance(solver, str):  # "cg"
        if route not in (None, "cg"):
            raise ValueError(
                f"{where}: solver='cg' is the matrix-free route; got route={route!r} with it. Fix: pass "
                "a dense solver (or None) with that route, or drop one of the two."
            )
        return "cg"
    if route is not None:
        return route
    nk, p, itemsize = system_sizes(mode, n, params)
    return choose_route(nk, p, itemsize, budget if budget is not None else default_memory_budget())
