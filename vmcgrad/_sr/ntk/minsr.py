r"""``minsr_update``: the sample-space SR (MinSR, SPRING) update of NetKet's ``VMC_SR``, by three routes.

.. math::

    \delta\theta = \frac{1}{\sqrt N}\Delta J^\dagger (T + \lambda)^{-1}\varepsilon + \mu\,\delta_\mathrm{old}
                 = (S + \lambda)^{-1}\frac{\Delta J^\dagger\varepsilon}{\sqrt N} + \mu\,\delta_\mathrm{old},
    \qquad T = \frac1N \Delta J\Delta J^\dagger,\quad S = \frac1N \Delta J^\dagger \Delta J

(push-through identity; :math:`\varepsilon` already holds SPRING's
:math:`-\mu\Delta J\delta_\mathrm{old}/\sqrt N`).
The routes (:data:`vmcgrad._sr.ntk.routes.ROUTES`); unless one is given, the fastest whose compiled
update fits the memory budget (:func:`vmcgrad._sr.ntk.routes.choose`):

* ``"dense"``: the :math:`NK \times NK` kernel :math:`T` in blocks (:mod:`vmcgrad._sr.ntk.dense`) and a
  dense solve: per-sample Jacobians about :math:`N(1 + (N - c)/2c)`, then :math:`(NK)^3/3` for the factor;
  where one device holds all N and their Jacobian fits the budget (or one chunk holds them), the
  Jacobian is kept (:func:`_whole_jacobian`): N, derived a chunk at a time as NetKet's ``srt``,
  held once (centred in place, :func:`_centred_in_place`);
* ``"parameter"``: the :math:`P \times P` matrix :math:`S` from each row chunk's Jacobian (N per-sample
  Jacobians, once each) and a dense solve, then :math:`P^3/3`: the cheaper one when :math:`P < NK`;
* ``"cg"``: matrix-free conjugate gradient on :math:`T v` (one vjp and one jvp pass per iteration), with
  the Nyström preconditioner of :mod:`vmcgrad._sr.ntk.nystrom` (r samples, r set by the budget): no N×N or
  P×P matrix, for when neither fits (or is slower).
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from vmcgrad._chunks.budget import Choice
from vmcgrad._chunks.default_budget import budget_or_default
from vmcgrad._hlo.cost import expected_trips
from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Problem, call, chosen, compile_only, problem
from vmcgrad._problem.sharding import unsplit_explicit
from vmcgrad._runner.primitive import map_reduce_problem
from vmcgrad._runner.runner import REPLICATED
from vmcgrad._sr.jacobian import components, flat_jacobian, gram
from vmcgrad._sr.ntk import nystrom, routes
from vmcgrad._sr.ntk.dense import KEPT_JACOBIAN_PROGRAMS, dense_program, dense_solve, keeps_jacobian
from vmcgrad._sr.ntk.modes import (
    choose_ntk_mode,
    jacobian_batch,
    jacobian_split,
    k_of,
    mean_jacobian,
    params_of,
    pinned,
    rows_fun,
    theta_of,
    vector_dtype,
)
from vmcgrad._sr.ntk.ntk import NTKOperator, check_solver, kernel_product
from vmcgrad._sr.ntk.routes import system_sizes
from vmcgrad._sr.solve import cg

_UPDATE = "vmcgrad.minsr_update"
_HOW = 5  # the position of ``how`` (static: route, solver, rank) in _update_program's arguments


def minsr_update(
    logpsi: Any,
    params: Any,
    samples: Any,
    local_energies: Any,
    *,
    diag_shift: float | jax.Array,
    mode: str | None = None,
    proj_reg: float | jax.Array | None = None,
    momentum: float | jax.Array | None = None,
    old_updates: Any = None,
    solver: Any = None,
    route: str | None = None,
    nystrom_rank: int | str | None = "auto",
    chunk_size: int | str | None = None,
    memory_budget: float | None = None,
    tol: float = 1e-10,
    maxiter: int | None = None,
) -> tuple[Any, Any, Any]:
    r"""The update of sample-space stochastic reconfiguration (MinSR, SPRING), as NetKet's ``VMC_SR``.

    .. math::

        \varepsilon = \frac{2}{\sqrt N}\big(E_\mathrm{loc} - \bar E\big)
                      - \mu\,\frac{\Delta J\,\delta_\mathrm{old}}{\sqrt N},
        \qquad
        x = \Big(T + \lambda\mathbb 1 + \frac{r}{N}\mathbf 1\mathbf 1^T\Big)^{-1} \varepsilon,

        \delta\theta = \frac{1}{\sqrt N}\Delta J^\dagger x + \mu\, \delta_\mathrm{old},

    with :math:`T` the kernel of :func:`NTK` in the mode's representation (:math:`\varepsilon` split
    into (Re, Im) per sample in 'complex' mode, its real part in 'real' mode), :math:`\lambda` =
    ``diag_shift``, :math:`r` = ``proj_reg`` and :math:`\mu` = ``momentum`` (NetKet's ``srt`` and
    ``srt_onthefly``; by the push-through identity it equals
    :math:`(S + \lambda)^{-1}\Delta J^\dagger\varepsilon/\sqrt N + \mu\delta_\mathrm{old}`, the
    ``"parameter"`` route). :math:`\Delta J^\dagger x` is one chunked pullback with one reduction, the
    path of :func:`vmcgrad.batched_vjp`.

    Args:
        logpsi, params, samples, chunk_size, mode, memory_budget: as for :func:`NTK`.
        local_energies: :math:`E_\mathrm{loc}(\sigma_i)`, shape ``(N,)``.
        diag_shift: :math:`\lambda \ge 0`.
        proj_reg: :math:`r \ge 0` or None (changes nothing in exact arithmetic: :math:`\varepsilon`
            and the solution are orthogonal to the constant vectors; it regularises the solver).
        momentum: :math:`\mu` (SPRING) or None.
        old_updates: :math:`\delta_\mathrm{old}`, a pytree like ``params`` (the previous call's second
            result), or None for zeros. Only read with ``momentum``.
        solver: the dense solver of the ``"dense"`` and ``"parameter"`` routes: None (Cholesky) or a
            NetKet-style ``solver(A, b)``; or ``"cg"``, the same as ``route="cg"``.
        route: ``"dense"`` (the N×N kernel in blocks), ``"parameter"`` (the P×P matrix) or ``"cg"``
            (matrix-free), or None: the route of least modelled time whose compiled update fits the
            budget (``memory_budget``, else the default budget; :func:`vmcgrad._sr.ntk.routes.choose`,
            compile only, cached), or ``"cg"`` when ``solver="cg"``.
        nystrom_rank: samples of the ``"cg"`` route's Nyström preconditioner: ``"auto"``
            (:func:`vmcgrad._sr.ntk.nystrom.nystrom_rank` of the budget, at most N/2; where the rule
            finds no route at it, plain CG), an int in ``[0, N]``, or None / 0 for plain CG.
        tol, maxiter: for ``"cg"`` (relative residual of the kernel system, iteration cap).

    Returns:
        ``(updates, old_updates, info)``: ``updates`` a pytree like ``params`` (apply it with the
        optimiser as NetKet does, :math:`\theta \leftarrow \theta - \eta\,\delta\theta`); ``old_updates``
        the same pytree with ``momentum`` (else None); ``info`` the solver's info (a
        :class:`vmcgrad.CGInfo` for ``"cg"``) or None.

    Raises:
        TypeError, ValueError: for bad input, before anything is traced.
        MemoryError: (:class:`vmcgrad._sr.ntk.routes.NoRouteFits`) when no route fits the budget, not
            even matrix-free CG, before anything runs; it names a ``memory_budget=`` that holds it.
        TypeError: when differentiated (see the message for the alternative).
    """
    options = dict(
        diag_shift=diag_shift,
        mode=mode,
        proj_reg=proj_reg,
        momentum=momentum,
        old_updates=old_updates,
        solver=solver,
        route=route,
        nystrom_rank=nystrom_rank,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        tol=tol,
        maxiter=maxiter,
    )
    prob, args, choose = _program(logpsi, params, samples, local_energies, options)
    return call(_update_program, prob, *args, choose=choose)


def update_executable(
    logpsi: Any, params: Any, samples: Any, local_energies: Any, **options: Any
) -> tuple[Any, tuple]:
    """``(compiled, arguments)``, ``compiled(*arguments)`` being :func:`vmcgrad.minsr_update` on these
    arguments (its keywords). Compile only: after ``chunk_size="auto"``'s choice, the choice's own
    executable (JAX keeps the executable of a lowering it has seen): nothing compiles again."""
    prob, args, choose = _program(logpsi, params, samples, local_energies, _with_defaults(options))
    chunk, args = chosen(_update_program, prob, *args, choose=choose)
    compiled = compile_only(_update_program, prob.at_chunk(chunk), *args)
    return compiled, args[:_HOW] + args[_HOW + 1 :]  # (``how`` is static: compiled in)


def _program(logpsi: Any, params: Any, samples: Any, local_energies: Any, options: dict) -> tuple:
    """``(problem, arguments, choose)``: :func:`_update_program`'s on the route taken
    (:func:`_prepared`), and its chunk's chooser (:func:`vmcgrad._sr.ntk.routes.chooser`)."""
    prob, args_at, route, _ = _prepared(logpsi, params, samples, local_energies, options)
    args = args_at(route)
    return prob, args, routes.chooser(route, int(args[_HOW][2]))


def update_route(logpsi: Any, params: Any, samples: Any, local_energies: Any, **options: Any) -> str:
    """The route :func:`vmcgrad.minsr_update` takes on these arguments (its keywords): the one given,
    or the rule's, the fastest that fits the memory budget (:func:`vmcgrad._sr.ntk.routes.choose`;
    compile only, cached: the update's own call then searches nothing again).

    Raises:
        vmcgrad._sr.ntk.routes.NoRouteFits: when no route fits the budget (a MemoryError).
    """
    return _prepared(logpsi, params, samples, local_energies, _with_defaults(options))[2]


def update_choice(
    logpsi: Any, params: Any, samples: Any, local_energies: Any, **options: Any
) -> Choice | None:
    """The record of the route :func:`vmcgrad.minsr_update` takes on these arguments (its keywords):
    the rule's :class:`vmcgrad._chunks.budget.Choice` (``value`` ``(route, chunk)``, ``seconds`` its
    modelled time, ``platform``, the routes ``priced``; :func:`vmcgrad._sr.ntk.routes.choose`), or
    for a route given, that route priced alone the same way (None where it does not fit the budget:
    the update itself then says why). Compile only, cached, as :func:`update_route`.

    Raises:
        vmcgrad._sr.ntk.routes.NoRouteFits: when the rule chooses and no route fits the budget.
    """
    options = _with_defaults(options)
    return _prepared(logpsi, params, samples, local_energies, options, price=True)[3]


def _with_defaults(options: dict) -> dict:
    kinds = inspect.signature(minsr_update).parameters.items()
    defaults = {k: p.default for k, p in kinds if p.kind == p.KEYWORD_ONLY}
    return {**defaults, **options}


def update_fits(logpsi: Any, params: Any, samples: Any, local_energies: Any, **options: Any) -> bool:
    """Whether :func:`vmcgrad.minsr_update` on these arguments (its keywords) fits the memory budget on
    some route (the one given, else any) at some chunk, without choosing the route: a route whose
    matrix alone is over the budget is out uncompiled, and one fits exactly when its program at one
    sample per chunk does (:func:`vmcgrad._sr.ntk.routes.fits_at_all`; one compilation per route
    tried, the matrix-free one first). What a search of the largest sample count a budget holds asks
    at each count (:meth:`vmcgrad.netket.VMC_SR.route_at`'s error), where most counts fit no route."""
    options = _with_defaults(options)
    prob, args_at, route, sizes = _prepared(logpsi, params, samples, local_energies, options, decide=False)
    among = routes.ROUTES if route is None else (route,)
    if routes.fits_at_all(_update_program, prob, args_at, sizes, among):
        return True
    if route is not None or not routes.plain_cg_next(sizes.rank, options["nystrom_rank"]):
        return False
    return update_fits(logpsi, params, samples, local_energies, **{**options, "nystrom_rank": 0})


def _prepared(
    logpsi: Any,
    params: Any,
    samples: Any,
    local_energies: Any,
    options: dict,
    price: bool = False,
    decide: bool = True,
) -> tuple:
    """``(problem, args_at, route, choice)`` of an update: the inputs checked (before anything is
    traced), ``args_at(route)`` the program's arguments on a route, the route taken, and the rule's
    record (:func:`vmcgrad._sr.ntk.routes.choose`); for a route given, that route priced alone where
    ``price`` (None where it does not fit), else None. Without ``decide``, nothing is chosen or
    priced: the route given or None, and in the record's place the update's
    :class:`vmcgrad._sr.ntk.routes.Sizes`."""
    name = _UPDATE
    o = options
    budget = {"chunk_size": o["chunk_size"], "memory_budget": o["memory_budget"]}
    prob, inputs, _ = problem(name, logpsi, params, samples, arg="logpsi", **budget)
    prob = pinned(prob)  # the platform in force: its programs (their Jacobian batch) and prices
    mode = choose_ntk_mode(name, inputs.params, prob.out_dtype, o["mode"])
    real = jnp.finfo(vector_dtype(mode, inputs.params)).dtype
    local_energies = check.as_arrays(name, "local_energies", local_energies)
    if isinstance(local_energies, jax.Array):
        local_energies = local_energies.reshape(-1) if local_energies.size == prob.n else local_energies
    check.check_local_values(name, local_energies, prob.n)
    diag_shift = check.check_nonnegative_scalar(name, "diag_shift", o["diag_shift"], real)
    proj_reg, momentum, old_updates = o["proj_reg"], o["momentum"], o["old_updates"]
    if proj_reg is not None:
        proj_reg = check.check_nonnegative_scalar(name, "proj_reg", proj_reg, real, example="1.0")
    if momentum is not None:
        momentum = check.check_nonnegative_scalar(name, "momentum", momentum, real, example="0.8")
        if old_updates is not None:
            old_updates = check.as_arrays(name, "old_updates", old_updates)
            check.check_tangent(name, old_updates, inputs.params)
    else:
        old_updates = None
    solver = check_solver(name, o["solver"])
    route = routes.check_route(name, o["route"], solver)
    _, p, itemsize = system_sizes(mode, prob.n, inputs.params)
    budget_bytes = budget_or_default(prob.memory_budget)
    rank = nystrom.check_rank(name, o["nystrom_rank"], prob.n, k_of(mode), p, itemsize, budget_bytes)
    tol, atol = check.check_tolerances(name, o["tol"], 0.0)
    maxiter = check.check_maxiter(name, o["maxiter"], default=10 * prob.n * k_of(mode))
    op = NTKOperator(inputs=inputs, diag_shift=diag_shift, problem=prob, mode=mode)
    cg_opts = (tol, atol, maxiter)

    def args_at(route: str) -> tuple:
        # (the rank as a string: the automatic chunk's key, vmcgrad._chunks.budget.signature, keys a
        # string by its value and a Python int by its type only, and each rank needs its own chunk)
        how = (route, None if solver == "cg" else solver, str(rank if route == "cg" else 0))
        return (op, local_energies, proj_reg, momentum, old_updates, how, cg_opts)

    sizes = routes.sizes_of(mode, prob, inputs, rank)
    choice = None
    if not decide:
        return prob, args_at, route, sizes
    if route is None:
        try:
            choice = routes.choose(name, _update_program, prob, args_at, sizes)
        except routes.NoRouteFits:  # its preconditioner took half the budget: plain CG may fit
            if not routes.plain_cg_next(rank, o["nystrom_rank"]):
                raise
            rank, sizes = 0, sizes._replace(rank=0)  # (args_at reads rank)
            choice = routes.choose(name, _update_program, prob, args_at, sizes)
        route = choice.value[0]
    elif price:
        try:
            choice = routes.choose(name, _update_program, prob, args_at, sizes, among=(route,))
        except routes.NoRouteFits:
            choice = None
    return prob, args_at, route, choice


def _block(mode: str, prob: Problem, params: Any, rank: int) -> int:
    """The Nyström block of ``rank`` at the problem's budget
    (:func:`~vmcgrad._sr.ntk.nystrom.nystrom_block`)."""
    _, p, itemsize = system_sizes(mode, prob.n, params)
    budget = budget_or_default(prob.memory_budget)
    return nystrom.nystrom_block(prob.n, k_of(mode), p, itemsize, budget, rank)


def _refuse_jvp(primals, tangents):
    del primals, tangents
    raise TypeError(
        f"{_UPDATE}: differentiating through the sample-space SR update is not supported. Fix: "
        "differentiate the parameter-space form, which is the same vector when momentum is None "
        "(push-through identity): vmcgrad.QGT(logpsi, params, samples, diag_shift=λ).solve(F) with "
        "F the force (vmcgrad.expect_grad), whose solve is differentiated implicitly; or wrap the "
        "update in jax.lax.stop_gradient if no derivative is needed."
    )


@partial(jax.jit, static_argnums=(0, 6))
def _update_program(
    prob: Problem, op: NTKOperator, e_loc, proj_reg, momentum, old_updates, how, cg_opts
) -> tuple[Any, Any, Any]:
    @jax.custom_jvp
    def run(op, e_loc, proj_reg, momentum, old_updates, cg_opts):
        return _update(op._at(prob), e_loc, proj_reg, momentum, old_updates, how, cg_opts)

    run.defjvp(_refuse_jvp)
    return run(op, e_loc, proj_reg, momentum, old_updates, cg_opts)


KEPT_JACOBIAN_PROGRAMS.add(_update_program)  # its dense route keeps the Jacobian over chunks


def _update(op: NTKOperator, e_loc, proj_reg, momentum, old_updates, how, cg_opts):
    route, solver, rank = how[0], how[1], int(how[2])
    n, k, mode = op.problem.n, k_of(op.mode), op.mode
    sqrt_n = math.sqrt(n)
    dv = components(mode, 2.0 * (e_loc - jnp.mean(e_loc)) / sqrt_n).astype(op.dtype)
    if route == "dense" and keeps_jacobian(op.problem, op):
        updates, info = _whole_jacobian(op, dv, proj_reg, momentum, old_updates, solver)
        return _with_momentum(updates, info, momentum, old_updates)
    if momentum is not None and old_updates is not None:
        dv = dv - momentum * op._j(old_updates) / sqrt_n
    info = None
    if route == "parameter":
        updates, info = _parameter_space(op, dv / sqrt_n, solver)
    else:
        dv = dv.reshape(-1)
        if route == "cg":
            x, info = _cg(op, dv, proj_reg, rank, cg_opts)
        else:
            a = dense_program(op.problem, op)
            if proj_reg is not None:
                a = a + proj_reg / n
            x, info = dense_solve(solver, a, dv)
        # one vjp pass (centred by _jdagger), at a chunk that tiles the rows where the kernel's does not
        pull = op if route == "cg" else op._at(op.problem.at_chunk(pullback_tiling(op.problem)))
        updates = pull._jdagger(x.reshape(n, k) / sqrt_n)
    return _with_momentum(updates, info, momentum, old_updates)


def pullback_tiling(prob: Problem) -> int | None:
    r"""The chunk of the dense route's pullback pass :math:`\Delta J^\dagger x`: the kernel's, or
    where its chunks do not tile a device's rows (a shifted last chunk, no padding to the device
    count), the largest chunk that tiles them in at most twice as many trips: a chunk holding rows
    that do not count makes the runner find finite stand-ins for them first
    (:func:`vmcgrad._runner.refs.pull_chunk`), one more lowering of the model's derivative in the
    program and a forward pass over that chunk. No larger than the kernel's chunk: no more memory."""
    plan, where = prob.plan, prob.space.where
    devices = 1 if where is None else where.size
    if plan.count == 1 or plan.n % plan.size == 0 or plan.n * devices != prob.n:
        return prob.chunk_size
    tiling = [m for m in range(plan.count, 2 * plan.count + 1) if plan.n % m == 0]
    return plan.n // tiling[0] if tiling else prob.chunk_size


def _with_momentum(updates, info, momentum, old_updates):
    if momentum is not None:
        if old_updates is not None:
            updates = jax.tree.map(lambda u, o: u + momentum * o, updates, old_updates)
        return updates, updates, info
    return updates, None, info


def jacobian_rows(
    fun, params, x, w, *, mode: str, batch: int | None, split: int, in_turn: bool = False
) -> tuple[tuple, jax.Array]:
    """One chunk's per-sample Jacobians in the mode's flat parametrisation, ``(c, K, P)``, derived a
    Jacobian batch at a time (:func:`~vmcgrad._sr.ntk.modes.jacobian_batch`), the K components in
    turn where ``in_turn`` (:func:`vmcgrad._sr.jacobian.jacobian`)."""
    f = rows_fun(fun, mode, params)
    b = jacobian_batch(w.shape[0], batch, split)
    return (), flat_jacobian(f, theta_of(mode, params), x, mode, b, in_turn=in_turn)


def _whole_jacobian(op: NTKOperator, dv: jax.Array, proj_reg, momentum, old_updates, solver):
    r"""The dense route where one device keeps every sample's Jacobian
    (:func:`~vmcgrad._sr.ntk.dense.keeps_jacobian`), derived a chunk at a time, as NetKet's
    ``srt``: :math:`\Delta J` exactly centred once,
    :math:`T = \Delta J\Delta J^\dagger/N + \lambda`, and :math:`\Delta J\delta_\mathrm{old}`,
    :math:`\Delta J^\dagger x` as products with it. N per-sample Jacobians in all, the model's
    derivative in the program once: no mean-Jacobian estimate, no column blocks derived again and no
    separate jvp or vjp pass, which the blocked kernel needs because it does not keep its rows."""
    prob, mode = op.problem, op.mode
    n, k = prob.n, k_of(mode)
    sqrt_n = math.sqrt(n)
    split, in_turn = jacobian_split(prob), op.components_in_turn
    chunk = partial(jacobian_rows, mode=mode, batch=op.jacobian_batch, split=split, in_turn=in_turn)
    _, j = map_reduce_problem(prob, op.inputs, chunk)
    j = unsplit_explicit(j)  # (on an Explicit mesh of one device: its rows are all of them)
    j = _centred_in_place(j.reshape(n, -1)).reshape(n * k, -1)  # ΔJ, exactly centred
    theta, unravel = ravel_pytree(theta_of(mode, op.params))
    if momentum is not None and old_updates is not None:
        old = ravel_pytree(theta_of(mode, old_updates))[0].astype(j.dtype)
        dv = dv - momentum * (j @ old).reshape(n, k).astype(dv.dtype) / sqrt_n
    a = (j @ jnp.conj(j).T / n).astype(op.dtype) + op.diag_shift * jnp.eye(n * k, dtype=op.dtype)
    if proj_reg is not None:
        a = a + proj_reg / n
    x, info = dense_solve(solver, a, dv.reshape(-1))
    delta = (jnp.conj(j).T @ x.astype(j.dtype)) / sqrt_n
    return params_of(mode, unravel(delta.astype(theta.dtype)), op.params), info


#: Blocks of rows :func:`_centred_in_place` centres one after another (at most).
CENTRING_BLOCKS = 8


def _centred_in_place(j: jax.Array) -> jax.Array:
    """``j - mean(j, axis=0)`` written into ``j``'s own buffer, in at most :data:`CENTRING_BLOCKS`
    blocks of rows: a loop whose carry is ``j``, each trip one fused subtraction of a block (updated in
    place), then the rows left over. As one expression XLA fuses the mean into the subtraction (or the
    subtraction into the products that read ``ΔJ``, keeping ``j`` alive), which writes a second copy
    of the rows; an optimisation barrier does not stop it on the CPU, whose compiler drops barriers.
    The block's own copy is the most held besides ``j``: at most ``1/CENTRING_BLOCKS`` of it."""
    mean = jnp.mean(j, axis=0)
    rows = j.shape[0]
    size = -(-rows // CENTRING_BLOCKS)
    full = rows // size

    def block(i, j):
        start = i * size
        part = jax.lax.dynamic_slice_in_dim(j, start, size) - mean
        return jax.lax.dynamic_update_slice_in_dim(j, part, start, 0)

    j = jax.lax.fori_loop(0, full, block, j)
    if full * size < rows:  # the rows left over: fewer than a block
        j = j.at[full * size :].add(-mean)
    return j


def _cg(op: NTKOperator, dv: jax.Array, proj_reg, rank: int, cg_opts):
    """Preconditioned CG on the kernel system. On samples split on an Explicit mesh axis the kernel's
    product (and the preconditioner's) comes back typed split where ``dv`` is replicated; both are
    replicated, so that CG's carry keeps one type (the vectors are N·K long: nothing to split)."""
    tol, atol, maxiter = cg_opts
    n = op.problem.n
    if proj_reg is None:
        apply = lambda v: unsplit_explicit(kernel_product(op, v))
    else:
        apply = lambda v: unsplit_explicit(kernel_product(op, v)) + proj_reg / n * jnp.sum(v)
    cols = min(op.problem.plan.size, n)
    block = _block(op.mode, op.problem, op.params, rank) if rank > 0 else 0
    build = nystrom.build(op, rank, cols, block) if rank > 0 else None
    precondition = None if build is None else (lambda r: unsplit_explicit(build(r)))
    with expected_trips(routes.CG_ITERATIONS):  # the route's modelled time counts the loop so often
        return cg(apply, unsplit_explicit(dv), None, tol=tol, atol=atol, maxiter=maxiter, M=precondition)


def gram_chunk(fun, params, x, w, shift, *, mode: str, split: int) -> tuple[tuple, tuple]:
    r"""One chunk's :math:`\sum_i w_i \tilde J_i^\dagger \tilde J_i` (``(P, P)``) and
    :math:`\sum_i w_i \tilde J_i` (``(K, P)``), with :math:`\tilde J = J - s` in the mode's flat
    parametrisation (:func:`vmcgrad._sr.jacobian.gram`, the dense QGT's too)."""
    f = rows_fun(fun, mode, params)
    rows = flat_jacobian(f, theta_of(mode, params), x, mode, jacobian_batch(w.shape[0], None, split), shift)
    return gram(rows, w), ()


def _parameter_space(op: NTKOperator, x: jax.Array, solver: Any) -> tuple[Any, Any]:
    r""":math:`(S + \lambda)^{-1}\Delta J^\dagger x` for ``x`` of shape ``(N, K)``, parameter-shaped: the
    matrix :math:`S` in one pass (each row chunk's Jacobian once), :math:`\Delta J^\dagger x` in one
    vjp pass at the chunk, a dense solve of side P."""
    prob, mode = op.problem, op.mode
    n = prob.n
    f = rows_fun(op._fun(), mode, op.params)
    theta = theta_of(mode, op.params)
    cols = min(prob.plan.size, n)
    shift = mean_jacobian(f, theta, unsplit_explicit(op.samples), n, mode, cols)
    k = k_of(mode)
    shift = jnp.concatenate([s.reshape(k, -1) for s in jax.tree.leaves(shift)], axis=-1)  # flat, (K, P)
    (gram, total), _ = map_reduce_problem(
        prob, op.inputs, partial(gram_chunk, mode=mode, split=jacobian_split(prob)), (shift, REPLICATED)
    )
    mean = total / n
    s = gram / n - jnp.conj(mean).T @ mean
    s = s + op.diag_shift * jnp.eye(s.shape[0], dtype=s.dtype)
    rhs, unravel = ravel_pytree(theta_of(mode, op._jdagger(x)))
    delta, info = dense_solve(solver, s.astype(rhs.dtype), rhs)
    return params_of(mode, unravel(delta.astype(rhs.dtype)), op.params), info
