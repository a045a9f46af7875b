"""The routes of ``vmcgrad.minsr_update`` (dense kernel, parameter-space matrix, matrix-free CG with the
Nyström preconditioner), the rule that chooses them, and ``NTKOperator.solve``'s agreement with the QGT's.

References: the dense-kernel route, itself equal to NetKet's ``srt`` (tests/test_ntk.py); dense kernels
from ``vmcgrad.NTK(...).to_dense()`` (equal to jax.jacrev's, tests/test_ntk.py). N = 18 on 4 devices
divides neither the devices nor the chunk 5.
"""

import dataclasses
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NK_L as L
from helpers import NK_MODELS as MODELS
from helpers import assert_tree_allclose, compiled_names
from helpers import nk_data as _data
from helpers import nk_logpsi as _logpsi
from helpers import nk_params as _params
from jax.sharding import AxisType, Mesh

import vmcgrad
from vmcgrad._hlo.cost import ProgramCost
from vmcgrad._problem.problem import LOWERING, problem
from vmcgrad._sr.ntk import minsr, nystrom, routes

DIAG = 1e-3
N = 18
slow = pytest.mark.slow
pytestmark = pytest.mark.usefixtures("netket_mesh")


def _tree_norm(t):
    return float(jnp.sqrt(sum(jnp.sum(jnp.abs(a) ** 2) for a in jax.tree.leaves(t))))


def _tree_max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


#: (model, mode): complex (real parameters, complex output: K = 2, P = 29 < NK = 36) and holomorphic.
ROUTE_CASES = [
    ("r2c", "complex"),
    ("holo", "holomorphic"),
    pytest.param("real", "real", marks=slow),
    pytest.param("nonholo", "complex", marks=slow),
]


@pytest.mark.parametrize("model,mode", ROUTE_CASES)
def test_routes_equal_the_dense_kernel(model, mode):
    """The parameter-space route (push-through identity) and the preconditioned CG route give the dense
    route's update, with SPRING momentum, proj_reg and a given old_updates. CG's bound is derived:
    with the true residual below tol·‖b‖ and ‖(T + λ + r/N 11ᵀ)⁻¹‖ ≤ 1/λ,
    ‖δ_cg − δ‖ ≤ ‖ΔJ†/√N‖ ‖x_cg − x‖ ≤ √‖T‖ tol ‖b‖ / λ, ‖b‖ ≤ 2‖E − Ē‖/√N + μ √‖T‖ ‖δ_old‖."""
    apply, cplx = MODELS[model]
    params = _params(cplx)
    x, e = _data(N)
    lp = _logpsi(apply)
    old = jax.tree.map(lambda a: 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)).astype(a.dtype), params)
    kw = dict(diag_shift=DIAG, mode=mode, chunk_size=5, proj_reg=0.5, momentum=0.8, old_updates=old)
    ref, _, _ = vmcgrad.minsr_update(lp, params, x, e, route="dense", **kw)
    par, _, info = vmcgrad.minsr_update(lp, params, x, e, route="parameter", **kw)
    assert info is None
    assert_tree_allclose(par, ref, rtol=0, atol=1e-10)
    tol = 1e-12
    got, _, info = vmcgrad.minsr_update(lp, params, x, e, route="cg", tol=tol, **kw)
    assert bool(info.converged)
    t_norm = float(jnp.linalg.norm(vmcgrad.NTK(lp, params, x, mode=mode).to_dense(), 2))
    e_c = e.real if mode == "real" else e
    b_norm = 2 * float(jnp.linalg.norm(e_c - e_c.mean())) / np.sqrt(N) + 0.8 * np.sqrt(t_norm) * _tree_norm(
        old
    )
    bound = np.sqrt(t_norm) * tol * b_norm / DIAG + 1e-10
    assert _tree_max_diff(got, ref) <= bound, (_tree_max_diff(got, ref), bound)


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _walk(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _walk(sub)


def _what_ran(f, *args):
    """The sides of the matrices factorised by Cholesky and whether a while loop (CG) is traced."""
    eqns = list(_walk(jax.make_jaxpr(f)(*args).jaxpr))
    sides = sorted({e.invars[0].aval.shape[-1] for e in eqns if e.primitive.name == "cholesky"})
    return sides, any(e.primitive.name == "while" for e in eqns)


#: budget (bytes) -> the route and what it runs, for 'complex' mode at N = 18 (NK = 36) and P = 29, the
#: rule priced for the CPU: at 1 MiB every route fits and the parameter-space matrix's program is the
#: least modelled time (at chunk 5 it runs about a third of the dense route's ops, fewer FLOPs and
#: bytes); at 15 000 bytes no dense program fits (each needs its matrix and its factor, 2·36²·8 and
#: 2·29²·8 = 13 456 bytes, and more: 23 976 and 24 112 compiled at one sample per chunk), and
#: matrix-free CG does (with its Nyström preconditioner of rank 4, whose arrays take half the budget).
#: On one device the dense route keeps every sample's Jacobian (dense.keeps_jacobian: each derived once,
#: as NetKet's srt), and at 1 MiB its program is then the least modelled time (0.35 ms against the
#: parameter route's 0.44 ms; on 4 devices 0.43 against 0.15).
BUDGET_ROUTES = [
    (2**20, "dense", [36], False) if jax.device_count() == 1 else (2**20, "parameter", [29], False),
    (15_000, "cg", [], True),
]


@pytest.mark.parametrize("budget,route,sides,loop", BUDGET_ROUTES)
def test_the_rule_chooses_the_route_that_runs(budget, route, sides, loop):
    """The rule's route is the one whose program runs: the traced update holds exactly that route's
    factorisation (or CG's loop and none), and route= overrides it."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    assert routes.system_sizes("complex", N, params) == (36, 29, 8)

    def update(e, **kw):
        return vmcgrad.minsr_update(lp, params, x, e, diag_shift=DIAG, chunk_size=5, **kw)[0]

    with vmcgrad.cost_platform("cpu"):
        assert (
            minsr.update_route(lp, params, x, e, diag_shift=DIAG, chunk_size=5, memory_budget=budget) == route
        )
        assert _what_ran(lambda e: update(e, memory_budget=budget), e) == (sides, loop)
        assert _what_ran(lambda e: update(e, memory_budget=budget, route="dense"), e) == ([36], False)


def _stub_cost(ops, flops):
    return ProgramCost(ops, flops, 0.0, (), (), "cpu", 0.0)


def test_the_rule_takes_the_route_of_least_modelled_time(monkeypatch):
    """routes.choose on a stub of the compiled fits: among the routes that fit, the one whose program's
    modelled time (ProgramCost.time) is least on the platform the choice is for, so the CPU's
    constants (a µs an op, 50 GFLOP/s) and the TPU's (10 µs an op, 50 TFLOP/s) take different routes
    where one program runs fewer ops and the other fewer FLOPs; a plugged score replaces the time;
    a route whose matrix alone is over the budget is not compiled; none fitting is NoRouteFits with
    the matrix-free route's bytes and a budget that holds it."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, _ = _data(N)
    prob, _, _ = problem("t", _logpsi(apply), params, x, chunk_size="auto", memory_budget=10**6)
    compiled, fits = [], {}
    # dense: many ops, few FLOPs; parameter: few ops, many FLOPs; cg: many of both
    cost = {"dense": _stub_cost(1000, 1e6), "parameter": _stub_cost(10, 1e8), "cg": _stub_cost(5000, 1e9)}

    def fake_fit(program, prob, args, route, floor=0, rank=0):
        compiled.append(route)
        fits_, chunk, need = fits[route]
        return routes.Fit(fits_, chunk, need, cost[route] if fits_ else None, need, 1)

    monkeypatch.setattr(routes, "fit", fake_fit)
    sizes = routes.Sizes(n=N, k=2, p=29, itemsize=8, rank=4)

    def choose(budget, platform="cpu", score=None):
        compiled.clear()
        routes._CHOSEN.clear()
        at = dataclasses.replace(prob, memory_budget=budget)
        with vmcgrad.cost_platform(platform):
            return routes.choose("w", "program", at, lambda r: (r,), sizes, score=score)

    fits.update(dense=(True, 8, 1), parameter=(True, 4, 1), cg=(True, 8, 1))
    cpu, tpu = choose(10**6, "cpu"), choose(10**6, "tpu")
    # CPU: dense 1000 µs + 20 µs < parameter 10 µs + 2000 µs; TPU: parameter 100 µs + 2 µs < dense 10 ms
    assert cpu.value == ("dense", 8) and tpu.value == ("parameter", 4)
    assert cost[tpu.value[0]].ops < cost[cpu.value[0]].ops  # the TPU's choice runs fewer ops
    for choice, name in ((cpu, "cpu"), (tpu, "tpu")):
        assert choice.platform == name and compiled == ["dense", "parameter", "cg"]
        assert dict(choice.priced) == {r: cost[r].time(name) for r in routes.ROUTES}
        assert choice.seconds == min(dict(choice.priced).values()) and choice.cost is cost[choice.value[0]]
    assert choose(10**6, "tpu", score=lambda c: -c.cost.ops).value[0] == "cg"  # a plugged score
    fits["dense"] = (False, None, 10**7)
    assert choose(10**6, "cpu").value[0] == "parameter"  # the cheapest does not fit
    fits["dense"] = (True, 8, 1)  # its stub says it fits, but its kernel alone is over the budget:
    assert choose(36 * 36 * 8 - 1).value[0] == "parameter" and "dense" not in compiled
    assert choose(36 * 36 * 8).value[0] == "dense" and "dense" in compiled
    fits.update(dense=(False, None, 5), parameter=(False, None, 6), cg=(False, None, 700))
    with pytest.raises(routes.NoRouteFits, match=r"matrix-free CG, 700 .* memory_budget=1400,") as err:
        choose(10**6)
    assert (err.value.need, err.value.budget, compiled) == (700, 10**6, ["dense", "parameter", "cg"])


def _lowered_update(lp, params, x, e, **kw):
    """The compiled program ``vmcgrad.minsr_update`` runs on these arguments (at the chunk and
    Jacobian batch its ``chunk_size="auto"`` picks), not run."""
    token = LOWERING.set(True)
    try:
        return vmcgrad.minsr_update(lp, params, x, e, **kw).compile()
    finally:
        LOWERING.reset(token)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_route_is_the_least_program_cost_of_the_programs_that_run(platform):
    """With every route fitting (N = 18, chunk_size="auto", 1 MiB), the rule's route is the one whose
    program, as minsr_update compiles it on that route (each lowered and compiled anew here), has the
    least vmcgrad.program_cost time on the platform of vmcgrad.cost_platform; its record holds that
    time and each route's, and the platform. CG's loop, whose trip count only a run decides, counts
    routes.CG_ITERATIONS trips (an assumed count, reported as such), no loop is of unknown count.
    (Each platform's programs are its own in one process: the problem keys the platform,
    test_pricing_two_platforms_in_one_process_prices_each_platforms_program.)"""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    kw = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=2**20)
    with vmcgrad.cost_platform(platform):
        choice = minsr.update_choice(lp, params, x, e, **kw)
        costs = {
            r: vmcgrad.program_cost(_lowered_update(lp, params, x, e, route=r, **kw)) for r in routes.ROUTES
        }
    seconds = {r: c.time(platform) for r, c in costs.items()}
    assert choice.platform == platform and choice.value[0] == min(seconds, key=seconds.get), seconds
    np.testing.assert_allclose(choice.seconds, seconds[choice.value[0]], rtol=1e-12)
    assert dict(choice.priced).keys() == seconds.keys()
    np.testing.assert_allclose([dict(choice.priced)[r] for r in seconds], list(seconds.values()), rtol=1e-12)
    cg_cost = costs["cg"]
    assert cg_cost.unknown_trip_loops == () and len(cg_cost.assumed_trip_loops) == 1
    (cg_loop,) = [lp_ for lp_ in cg_cost.loops if lp_.name == cg_cost.assumed_trip_loops[0]]
    assert cg_loop.trip_count == routes.CG_ITERATIONS


def _wide(p, x):
    """A model of P = 5·17 + 17 = 102 real parameters with a complex output (K = 2)."""
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) * (1.0 + 0.5j), axis=-1)


def test_a_budget_the_kernel_estimate_passes_takes_the_route_that_fits():
    """Issue 48's failure, small: at a budget that holds the kernel and its factor by their sizes,
    2(NK)² numbers (the rule before: "dense"), the compiled dense update does not fit (the kernel is
    held whole with its blocks and factor), the P × P matrix alone is over it (P = 102 > NK = 64), and
    matrix-free CG fits. The update takes CG within the budget and gives the dense route's update
    within CG's bound ‖δ_cg − δ‖ ≤ √‖T‖ tol ‖b‖/λ (test_routes_equal_the_dense_kernel)."""
    n, k = 32, 2
    kw = jax.random.split(jax.random.key(5), 3)
    params = {"w": 0.3 * jax.random.normal(kw[0], (L, 17)), "b": 0.1 * jax.random.normal(kw[1], (17,))}
    x, e = _data(n)
    nk_, p, itemsize = routes.system_sizes("complex", n, params)
    assert (nk_, p, itemsize) == (n * k, 102, 8)
    budget = 2 * nk_ * nk_ * itemsize  # what the sizes said the dense route needs
    # CG's tolerance above what float64 can attain on the true residual, eps ‖T + λ‖ ‖x‖ with
    # ‖x‖ <= ‖b‖/λ (at 1e-12, below it here, the true residual missed it on some machines)
    t_norm = float(jnp.linalg.norm(vmcgrad.NTK(_wide, params, x, mode="complex").to_dense(), 2))
    tol = 100 * np.finfo(np.float64).eps * (t_norm + DIAG) / DIAG
    opts = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=budget, tol=tol)
    prob, inputs, _ = problem("t", _wide, params, x, chunk_size="auto", memory_budget=budget)
    dense = routes.fit(minsr._update_program, prob, _args_at(prob, inputs, e), "dense")
    assert not dense.fits and dense.need > budget, dense
    assert minsr.update_route(_wide, params, x, e, **opts) == "cg"
    got, _, info = vmcgrad.minsr_update(_wide, params, x, e, **opts)
    assert bool(info.converged)
    ref, _, _ = vmcgrad.minsr_update(_wide, params, x, e, diag_shift=DIAG, route="dense")
    b_norm = 2 * float(jnp.linalg.norm(e - e.mean())) / np.sqrt(n)
    assert _tree_max_diff(got, ref) <= np.sqrt(t_norm) * tol * b_norm / DIAG + 1e-10


def _args_at(prob, inputs, e):
    """The dense route's program arguments of minsr_update (its defaults) on ``prob``."""
    op = vmcgrad.NTKOperator(inputs=inputs, diag_shift=jnp.asarray(DIAG), problem=prob, mode="complex")
    return (op, e, None, None, None, ("dense", None, 0), (1e-12, 0.0, 10 * prob.n * 2))


def test_nystrom_preconditioner():
    """With every sample (r = N) the Nyström approximation is the kernel itself, so the preconditioned
    matrix has two eigenvalues (1 on T's range, λ/(θ_min + λ) off it) and PCG stops within 3
    iterations where plain CG takes many; M is Hermitian positive definite; the rank from the budget
    is at most N/2, grows with the budget and is 0 when nothing fits."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    kw = dict(diag_shift=DIAG, chunk_size=5, route="cg", tol=1e-10)
    _, _, full = vmcgrad.minsr_update(lp, params, x, e, nystrom_rank=N, **kw)
    _, _, plain = vmcgrad.minsr_update(lp, params, x, e, nystrom_rank=None, **kw)
    assert bool(full.converged) and bool(plain.converged)
    assert int(full.iterations) <= 3 < 10 <= int(plain.iterations), (full.iterations, plain.iterations)

    op = vmcgrad.NTK(lp, params, x, chunk_size=5, diag_shift=DIAG, mode="complex")
    m = jax.jit(lambda op: jax.vmap(nystrom.build(op._at(op.problem), 6, 5))(jnp.eye(op.dim)))(op)
    np.testing.assert_allclose(m, m.T, rtol=0, atol=1e-12 * float(jnp.max(jnp.abs(m))))
    assert float(jnp.min(jnp.linalg.eigvalsh(m))) > 0

    ranks = [nystrom.nystrom_rank(1000, 2, 10_000, 8, b) for b in (1e3, 1e6, 1e8, 1e10)]
    assert ranks[0] == 0 and ranks[1] < ranks[2] < ranks[3] == 500, ranks


def _jacobian(apply, params, x, mode):
    """Per-sample Jacobians ``(N, K, P)`` from jax.jacrev, in the mode's parametrisation."""
    if mode == "holomorphic":
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        j = jax.jacrev(lambda f: apply({"params": unravel(f)}, x), holomorphic=True)(flat)
        return j[:, None, :]
    flat, unravel = jax.flatten_util.ravel_pytree(params)  # real parameters ('r2c')
    out = lambda f: apply({"params": unravel(f)}, x)
    return jnp.stack([jax.jacrev(lambda f: out(f).real)(flat), jax.jacrev(lambda f: out(f).imag)(flat)], 1)


@pytest.mark.parametrize("model,mode", [("r2c", "complex"), ("holo", "holomorphic")])
def test_nystrom_columns_built_block_wise_equal_the_dense_ones(model, mode):
    """C = J̃ J̃_S† built a block of b subset samples at a time (b = 1; b = 3, whose last block of
    r = 7 overlaps the one before; b = r, every Jacobian held) equals jax.jacrev's, J̃ = J − s with s
    NetKet's estimate (the mean of min(N, 32, chunk) evenly strided rows), to the rounding of a dot
    product of P terms: |ΔC_ab| ≤ 4 P ε ‖J̃_a‖ ‖J̃_b‖ (each Jacobian's rounding included)."""
    apply, cplx = MODELS[model]
    params = _params(cplx)
    x, _ = _data(N)
    rank, cols = 7, 5
    op = vmcgrad.NTK(_logpsi(apply), params, x, chunk_size=cols, diag_shift=DIAG, mode=mode)
    j = _jacobian(apply, params, x, mode)
    m = min(N, 32, cols)
    jt = j - j[jnp.arange(m) * (N // m)].mean(0)
    idx = (jnp.arange(rank) * N) // rank
    ref = jnp.einsum("akp,bip->akbi", jt, jnp.conj(jt[idx]))
    norms = jnp.linalg.norm(jt, axis=-1)
    bound = 4 * j.shape[-1] * jnp.finfo(jnp.float64).eps * norms[:, :, None, None] * norms[idx][None, None]
    for block in (1, 3, rank):
        c, got_idx = jax.jit(lambda op, b=block: nystrom.columns(op._at(op.problem), rank, cols, b))(op)
        np.testing.assert_array_equal(got_idx, idx)
        err = jnp.abs(c - ref)
        assert bool(jnp.all(err <= bound)), (block, float(jnp.max(err / bound)))


def test_nystrom_rank_is_not_bound_by_held_jacobians():
    """At issue 48's sizes (N = 512, K = 2, P = 10 608, float64, 8 MiB) the plan's rank is over twice
    the rank whose r Jacobians were held (the formula before: 19) and its arrays, the block's b
    Jacobians and the three NK × rK matrices, fit half the budget; the block given for that rank is at
    least the plan's. The compiled build at a block of one sample needs fewer bytes than r held
    Jacobians, which the build holding them all (b = r) needs at least (P = 2 000 ≫ NK = 32)."""
    n, k, p, item, budget = 512, 2, 10_608, 8, 8 * 2**20
    held = int(0.5 * budget // (item * (k * p + 3 * n * k * k)))
    plan = nystrom.nystrom_plan(n, k, p, item, budget)
    assert held == 19 and nystrom.nystrom_rank(n, k, p, item, budget) == plan.rank > 2 * held, plan
    assert item * (plan.block * k * p + 3 * n * k * k * plan.rank) <= 0.5 * budget
    assert nystrom.nystrom_block(n, k, p, item, budget, plan.rank) >= plan.block

    kw = jax.random.split(jax.random.key(7), 2)
    params = {"w": 0.1 * jax.random.normal(kw[0], (L, 400))}
    wide = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]), axis=-1) * (1.0 + 0.5j)
    x, _ = _data(32)
    op = vmcgrad.NTK(wide, params, x, chunk_size=2, diag_shift=DIAG, mode="complex")
    rank, jac_bytes = 16, 2 * 2000 * 8

    def nbytes(block):
        build = lambda op, v: nystrom.build(op._at(op.problem), rank, 2, block)(v)
        compiled = jax.jit(build).lower(op, jnp.ones(64)).compile()
        return vmcgrad.program_bytes(compiled)

    assert nbytes(1) < rank * jac_bytes <= nbytes(rank), (nbytes(1), nbytes(rank))


def test_cg_with_a_block_wise_preconditioner_equals_the_dense_route():
    """With every sample (r = N = 18) in blocks of 3 (the budget holds the rank's columns and three
    Jacobians beside them: 6 passes), PCG stops within 3 iterations and gives the dense route's update
    within CG's bound (test_routes_equal_the_dense_kernel)."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    _, p, item = routes.system_sizes("complex", N, params)
    budget = 2 * item * (3 * N * 4 * N + 3 * 2 * p)
    assert nystrom.nystrom_block(N, 2, p, item, budget, N) == 3
    kw = dict(diag_shift=DIAG, chunk_size=5, route="cg", tol=1e-12, nystrom_rank=N, memory_budget=budget)
    got, _, info = vmcgrad.minsr_update(lp, params, x, e, **kw)
    assert bool(info.converged) and int(info.iterations) <= 3, info
    ref, _, _ = vmcgrad.minsr_update(lp, params, x, e, diag_shift=DIAG, chunk_size=5, route="dense")
    t_norm = float(jnp.linalg.norm(vmcgrad.NTK(lp, params, x, mode="complex").to_dense(), 2))
    b_norm = 2 * float(jnp.linalg.norm(e - e.mean())) / np.sqrt(N)
    assert _tree_max_diff(got, ref) <= np.sqrt(t_norm) * 1e-12 * b_norm / DIAG + 1e-10


def test_each_nystrom_rank_has_its_own_chunk():
    """The automatic chunk is chosen per Nyström rank: after plain CG's update (rank 0) chose its
    chunk, the preconditioned update at the same budget is compiled within the budget (it does not
    take plain CG's chunk, too large beside the preconditioner's arrays; P = 2 000 ≫ NK = 64)."""
    kw = jax.random.split(jax.random.key(7), 2)
    params = {"w": 0.1 * jax.random.normal(kw[0], (L, 400))}
    wide = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]), axis=-1) * (1.0 + 0.5j)
    x, e = _data(32)
    budget = 300_000
    opts = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=budget, route="cg")
    for rank in (None, "auto"):
        f = jax.jit(lambda p, x, e, r=rank: vmcgrad.minsr_update(wide, p, x, e, nystrom_rank=r, **opts)[0])
        assert vmcgrad.program_bytes(f.lower(params, x, e).compile()) <= budget, rank


def test_the_preconditioners_jacobians_do_not_bound_the_chunk_on_an_accelerator():
    """Priced for a TPU (a Jacobian batch is the whole chunk), the matrix-free update's automatic
    chunk is searched apart from the Nyström build's Jacobian batch (nystrom.cg_choice), and the
    build holds a batch's Jacobians, not the chunk's rows (nystrom.nystrom_chunk). On a model whose
    per-sample Jacobians (P = 2 000 ≫ 400 activations) outweigh its passes, at a budget between the
    programs at chunks c and 2c (c = N_local / 4; each at a chunk given, so its build derives the
    whole chunk's Jacobians at once), the chosen chunk is over c, and its program with the whole
    chunk's Jacobians at once is over the budget: the build no longer bounds the chunk of every
    iteration's passes. The program run fits the budget, and the update equals the dense route
    within CG's bound (test_routes_equal_the_dense_kernel)."""
    kw = jax.random.split(jax.random.key(7), 2)
    params = {"w": 0.1 * jax.random.normal(kw[0], (L, 400))}
    wide = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]), axis=-1) * (1.0 + 0.5j)
    n, rank = 128, 16
    x, e = _data(n)
    n_local = n // jax.device_count()
    opts = dict(diag_shift=DIAG, route="cg", nystrom_rank=rank, tol=1e-12)

    def need(chunk, budget=None):  # the program at a chunk given: its Jacobians at the whole chunk
        run = lambda p, x, e: vmcgrad.minsr_update(
            wide, p, x, e, chunk_size=chunk, memory_budget=budget, **opts
        )
        return vmcgrad.program_bytes(jax.jit(lambda p, x, e: run(p, x, e)[0]).lower(params, x, e).compile())

    c = n_local // 4
    with vmcgrad.cost_platform("tpu"):
        budget = (need(c) + need(2 * c)) // 2
        chosen = minsr.update_choice(wide, params, x, e, chunk_size="auto", memory_budget=budget, **opts)
        chunk = chosen.value[1]
        assert chosen.value[0] == "cg" and chunk > c, chosen
        assert chosen.memory <= budget < need(chunk, budget), (chosen.memory, budget)
        auto = dict(chunk_size="auto", memory_budget=budget, **opts)
        run = jax.jit(lambda p, x, e: vmcgrad.minsr_update(wide, p, x, e, **auto)[0])
        assert vmcgrad.program_bytes(run.lower(params, x, e).compile()) <= budget
        got = run(params, x, e)
    ref, _, _ = vmcgrad.minsr_update(wide, params, x, e, diag_shift=DIAG, chunk_size=n_local, route="dense")
    t_norm = float(jnp.linalg.norm(vmcgrad.NTK(wide, params, x, mode="complex").to_dense(), 2))
    b_norm = 2 * float(jnp.linalg.norm(e - e.mean())) / np.sqrt(n)
    assert _tree_max_diff(got, ref) <= np.sqrt(t_norm) * 1e-12 * b_norm / DIAG + 1e-10


@slow
def test_ntk_solve_agrees_with_the_qgt_solve():
    """Same default tolerance as AbstractQGT.solve, and the CG solve is differentiated implicitly (a
    reverse derivative through CG's loop is not defined): its gradient in the parameters and in b
    equals the dense solve's."""
    default = lambda f: inspect.signature(f).parameters["tol"].default
    assert default(vmcgrad.NTKOperator.solve) == default(vmcgrad.QGTOperator.solve) == 1e-5
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, _ = _data(N)
    lp = _logpsi(apply)
    b = jnp.cos(jnp.arange(2 * N) + 0.3)

    def loss(p, b, **kw):
        T = vmcgrad.NTK(lp, p, x, chunk_size=5, diag_shift=1e-1, mode="complex")
        return jnp.sum(jnp.sin(T.solve(b, **kw)[0]))

    ref = jax.grad(loss, argnums=(0, 1))(params, b)
    got = jax.grad(partial_cg(loss), argnums=(0, 1))(params, b)
    assert_tree_allclose(got, ref, rtol=0, atol=1e-8)


def partial_cg(loss):
    return lambda p, b: loss(p, b, solver="cg", tol=1e-13)


#: (route given, memory budget, the route logged): RBM(alpha=1) on 6 spins, P = 48 real parameters,
#: N = 120, real mode (K = 1): P < N, so the rule takes the parameter-space matrix when it fits
#: (2·48²·8 = 36 864 bytes) and CG below that; route= overrides it. On one device the dense route
#: keeps every sample's Jacobian (dense.keeps_jacobian) and its program is the least modelled time
#: without a budget (1.74 ms against the parameter route's 1.85 ms; on 4 devices 8.3 against 0.49).
DRIVER_ROUTES = [
    pytest.param(None, None, "dense" if jax.device_count() == 1 else "parameter", marks=slow),
    pytest.param(None, 30_000, "cg", marks=slow),
    pytest.param("dense", None, "dense", marks=slow),
]


@pytest.mark.parametrize("route,budget,logged", DRIVER_ROUTES)
def test_vmc_sr_logs_the_route_it_took(route, budget, logged):
    """VMC_SR takes the rule's route (or the given one), logs it as ``minsr_route`` each step (and CG's
    iterations as ``cg_iterations``), and its update is minsr_update's on that route."""
    import optax

    with jax.set_mesh(None):
        import netket as nk

        import vmcgrad.netket as vnk

    hi = nk.hilbert.Spin(0.5, 6)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * jax.device_count())
    vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), n_samples=120, seed=3, chunk_size=7)
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)
    drv = vnk.VMC_SR(
        H,
        optax.sgd(0.02),
        diag_shift=1e-3,
        variational_state=vs,
        use_ntk=True,
        route=route,
        memory_budget=budget,
    )
    log = nk.logging.RuntimeLog()
    drv.run(1, out=log, show_progress=False)
    assert drv.route == logged
    assert list(log.data["minsr_route"]["value"]) == [logged]
    # the time the rule modelled for the route, on the platform it priced for (the route given: priced alone)
    choice = drv.route_choice
    assert choice.value[0] == logged and choice.seconds > 0 and dict(choice.priced)[logged] == choice.seconds
    assert list(log.data["minsr_modelled_time"]["value"]) == [choice.seconds]
    assert list(log.data["minsr_cost_platform"]["value"]) == [choice.platform] == ["cpu"]
    assert ("cg_iterations" in log.data) == (logged == "cg")
    if logged == "cg":
        assert 0 < int(log.data["cg_iterations"]["value"][0]) < 10 * vs.n_samples


@pytest.mark.heavy
def test_dense_blocks_sized_by_the_budget():
    """With chunk_size="auto" the dense route's chunk is the largest whose whole update program (kernel
    blocks, the N×N kernel, its factor, the pullback) fits the budget: at budgets near those fixed
    chunks 4, 8 and 16 compile to, the compiled program and its temporaries stay within each budget and
    the chosen chunk grows with the budget (N = 64; the last two passes traced are the chosen
    program's: the kernel's at the chunk, then the pullback's, at the chunk too or at one that tiles the
    rows: one pass a chunk,
    its memory counted in the program the search compiles). The model is the r2c one with 256 hidden units
    (P = 1 541), so that a chunk's Jacobians, not the 64×64 kernel, set the memory."""
    from netket_spy import vmcgrad_passes

    apply, _ = MODELS["r2c"]
    k = jax.random.split(jax.random.key(8), 3)
    params = {
        "w": 0.3 * jax.random.normal(k[0], (5, 256)),
        "b": 0.1 * jax.random.normal(k[1], (256,)),
        "a": 0.2 * jax.random.normal(k[2], (5,)),
    }
    x, e = _data(64)
    lp = _logpsi(apply)

    def compiled(chunk, budget=None):
        def update(p, x, e):
            kw = dict(diag_shift=DIAG, route="dense", chunk_size=chunk, memory_budget=budget)
            return vmcgrad.minsr_update(lp, p, x, e, **kw)[0]

        with vmcgrad_passes() as passes:
            out = jax.jit(update).lower(params, x, e).compile()
        kernel, pullback = passes[-2].chunk_size, passes[-1].chunk_size
        # one vjp pass at the chunk, or at the largest that tiles the device's rows where the kernel's
        # does not (minsr.pullback_tiling: no more memory than the kernel's)
        tiles = lambda c: c is None or (64 // jax.device_count()) % c == 0
        assert pullback == kernel or (pullback < kernel and tiles(pullback)), (kernel, pullback)
        return out, kernel

    chosen = []
    for c in (4, 8, 16):
        # (at a budget below the Jacobian's bytes: on one device it is then not kept, and the blocks run)
        budget = vmcgrad.program_bytes(compiled(c, 1024)[0])
        program, chunk = compiled("auto", budget)
        # (the search sizes the update's own program; the caller's jit around it adds its arguments and
        # outputs, a few hundred bytes: 320 at one of these budgets)
        held, slack = vmcgrad.program_bytes(program), 4096
        assert program.memory_analysis().temp_size_in_bytes <= held <= budget + slack
        chosen.append(chunk)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1], chosen


@slow
def test_vmc_sr_stops_before_sampling_where_no_route_fits():
    """VMC_SR at a budget no route holds, not even matrix-free CG: the first step raises a MemoryError
    in the driver's words (memory_budget=, n_samples=) before anything is sampled, and the budget it
    names holds the update (route_at then answers)."""
    import optax

    with jax.set_mesh(None):
        import netket as nk

        import vmcgrad.netket as vnk

    hi = nk.hilbert.Spin(0.5, 6)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * jax.device_count())
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)

    def driver(budget):
        vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), n_samples=120, seed=3)
        kw = dict(diag_shift=1e-3, variational_state=vs, use_ntk=True, memory_budget=budget)
        return vnk.VMC_SR(H, optax.sgd(0.02), **kw), vs

    drv, vs = driver(2_000)
    words = r"^vmcgrad\.netket\.VMC_SR: no route .* memory_budget=2000 "
    with pytest.raises(MemoryError, match=words) as err:
        drv.run(1, out=None, show_progress=False)
    assert vs._samples is None  # nothing sampled
    enough = int(str(err.value).split("Fix: pass memory_budget=")[1].split()[0].rstrip(","))
    assert enough == 2 * err.value.need
    assert driver(enough)[0].route_at(120) in routes.ROUTES


@slow
def test_the_samples_a_budget_holds_are_found_in_one_compilation_per_count(monkeypatch):
    """Where no route fits at N, VMC_SR's error names the largest N of the halvings that a route fits
    (in multiples of the chains): 480 samples of the 6-site RBM at 5 000 bytes per device on 4 devices
    (16 000 on one, which holds every sample: the matrix-free route's program at one sample per chunk
    is 14 389 bytes at N = 120, 19 781 at 240) fit no route, and the suggestion, 120, really fits
    (route_at chooses a route there in a fresh driver) while 240, the halving before it, does not.
    The search compiles one program per count it tries (the matrix-free route's at one sample per
    chunk; the dense routes' matrices alone are over the budget at these counts, so they are not
    compiled; a count that fits none at the automatic Nyström rank, where that is not 0, plain CG's
    too), not a route's choice per count. Red before: the counts were
    checked by choosing a route at each (7 compilations for the 2 counts, the chunk search descending
    through larger chunks; 155 s for the CLI's exit 2 at 64 KiB, docs/cli.md)."""
    import optax

    with jax.set_mesh(None):
        import netket as nk

        import vmcgrad.netket as vnk

    hi = nk.hilbert.Spin(0.5, 6)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * jax.device_count())
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)
    budget = 16_000 if jax.device_count() == 1 else 5_000

    def driver(n):
        vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), n_samples=n, seed=3)
        kw = dict(diag_shift=1e-3, variational_state=vs, use_ntk=True, memory_budget=budget)
        return vnk.VMC_SR(H, optax.sgd(0.02), **kw)

    drv = driver(480)
    compiled = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered, "compile", lambda *a, **k: compiled.append(1) or compile_(*a, **k)
    )
    stub = routes.NoRouteFits("no route", need=1, budget=budget, n=480, needs={})
    err = drv._no_route(480, stub)
    assert err.max_samples == 120 and "at most n_samples=120" in str(err), str(err)
    # the counts 240 (fits none: at the automatic Nyström rank, then, where that rank is not 0,
    # plain CG too, minsr.update_fits) and 120 (fits)
    retried = nystrom.nystrom_rank(240, 1, 48, 8, budget) > 0
    assert len(compiled) == 2 + retried, (len(compiled), retried)
    monkeypatch.undo()
    assert driver(120).route_at(120) in routes.ROUTES  # the suggestion fits: a route is chosen there
    with pytest.raises(MemoryError, match="no route"):
        driver(240).route_at(240)  # and the halving before it does not


@pytest.mark.parametrize("chunk", [None, 8])
def test_update_runs_few_sequential_ops(chunk, monkeypatch):
    """On an accelerator a program costs about the ops it runs one after another, so MinSR's kernel
    runs few, large ones (issue 47): per chunk one batch of row Jacobians and one pullback pass, per
    pair of a chunk and a column block one block, and ΔJ centred in a few blocks, not a row a time.
    Counted on the compiled update (helpers.sequential_ops: vmcgrad.program_cost, loops by their trip
    counts) as an accelerator would run it (the Jacobians a chunk at once), N = 32 on
    one device, the dense route (its blocks where m = N / chunk > 1 chunks: the Jacobian over the
    budget; kept, test_update_derives_the_model_once_as_netket): no loop has a trip per row of a block (N rows
    for the kept Jacobian, the chunk's rows otherwise), and the ops stay within 30 m² + 50 m + 100 (m²
    pairs of a chunk and a column block, about 21 ops each here; m chunks, about 36 each; the solve).
    Red on the kernel before: at m = 1 its centring loop of 32 trips, one row a trip (with its own
    split of a sixteenth of the chunk and a pullback pass per batch, 419 ops at m = 1 and 3 687 at
    m = 4, against 56 and 519 here)."""
    from helpers import sequential_ops
    from jax.sharding import AxisType, Mesh

    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)  # an accelerator's program, compiled here
    apply, cplx = MODELS["r2c"]
    n = 32
    params, (x, e) = jax.device_put((_params(cplx), _data(n)), jax.devices()[0])
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    # the blocks at a chunk given: a budget below the Jacobian's bytes, which is then not kept
    kw = dict(diag_shift=DIAG, mode="complex", route="dense", chunk_size=chunk, memory_budget=1024)
    update = jax.jit(lambda p, x, e: vmcgrad.minsr_update(_logpsi(apply), p, x, e, **kw)[0])
    with jax.set_mesh(one):
        ops, trips = sequential_ops(update.lower(params, x, e).compile().as_text())
    rows, m = (n, 1) if chunk is None else (chunk, n // chunk)
    assert rows not in trips, (rows, trips)
    assert ops <= 30 * m * m + 50 * m + 100, (ops, m, trips)


def test_update_derives_the_model_once_as_netket(monkeypatch):
    """On an accelerator a program costs about its ops in sequence, and the size of its program about
    how often the model's derivative is written out in it. At a chunk given on one device, with the
    N×P Jacobian within the budget, the dense route derives each chunk's Jacobian once and keeps it,
    as NetKet's ``srt`` does (``_sr_srt_common(use_ntk=True)``, the kernel of ``nk.driver.VMC_SR``):
    no column blocks derived again, no mean-Jacobian estimate, no pullback pass. A NetKet GCNN (FFT
    convolutions, real parameters, 'complex' mode), N = 32 in 4 chunks of 8, compiled as an
    accelerator's program (the chunk's Jacobians at once), against NetKet's at the same chunk: at
    most NetKet's FFT ops (each copy of the model's derivative writes its own), its while loops and
    its ops in sequence (helpers.sequential_ops), and at most 1.5 times its StableHLO lines (here 11
    against 16 FFTs, 4 against 5 loops, 1 381 against 2 591 ops, 789 against 651 lines). Red on the
    blocked route, the model's derivative 3 times (watched with VMCGRAD_TEST_DEVICES=1: 40 FFTs, 11
    loops, 4 941 ops, 2 007 lines)."""
    import netket as nk
    from helpers import sequential_ops
    from jax.sharding import AxisType, Mesh
    from netket._src.ngd.sr_srt_common import _sr_srt_common

    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)  # an accelerator's program, compiled here
    n, chunk = 32, 8
    g = nk.graph.Chain(8)
    model = nk.models.GCNN(symmetries=g, layers=2, features=4, mode="fft")
    x = jnp.where(jax.random.bernoulli(jax.random.key(0), 0.5, (n, g.n_nodes)), 1.0, -1.0)
    params = model.init(jax.random.key(1), x[:1])["params"]
    e = jax.random.normal(jax.random.key(2), (n,)) + 0j
    params, x, e = jax.device_put((params, x, e), jax.devices()[0])
    logpsi = lambda p, x: model.apply({"params": p}, x)
    kw = dict(diag_shift=DIAG, mode="complex", route="dense", chunk_size=chunk)
    ours = jax.jit(lambda p, x, e: vmcgrad.minsr_update(logpsi, p, x, e, **kw)[0])
    netket = _sr_srt_common.__wrapped__
    nk_kw = dict(diag_shift=DIAG, solver_fn=nk.optimizer.solver.cholesky, mode="complex")
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        lowered = ours.lower(params, x, e)
        theirs = netket.lower(model.apply, e, params, {}, x, chunk_size=chunk, use_ntk=True, **nk_kw)
        texts = [low.compile().as_text() for low in (lowered, theirs)]
    lines = [len(low.as_text().splitlines()) for low in (lowered, theirs)]
    ffts, loops = ([t.count(f" {op}(") for t in texts] for op in ("fft", "while"))
    ops = [sequential_ops(t)[0] for t in texts]
    assert ffts[0] <= ffts[1] and loops[0] <= loops[1], (ffts, loops)
    assert ops[0] <= ops[1], ops
    assert lines[0] <= 1.5 * lines[1], lines


def test_the_update_compiles_its_program_once_where_it_fits_whole():
    """Compile time (issue 47): with ``chunk_size="auto"`` and a budget the update fits whole, the
    route search compiles the update's program once (the chosen route at its largest chunk: no
    one-sample chunk compiled first) and the update's own call reuses that executable (compiles
    nothing more); its result is the update in one chunk, to the summation order. N = 8: a power of
    two per device on 1 or 4 devices (else the dense kernel's rule searches fewer, larger chunks too,
    :func:`vmcgrad._sr.ntk.dense.choose_dense`), and NK = 16 below P = 29, where the dense route in
    one block dominates the others (:func:`vmcgrad._sr.ntk.routes.choose`: they are not compiled)."""
    n = 8
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(n)
    lp = _logpsi(apply)
    with compiled_names() as names:
        opts = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=2**40)
        got, _, _ = vmcgrad.minsr_update(lp, params, x, e, **opts)
        jax.block_until_ready(got)
    assert names.count("jit(_update_program)") == 1, names
    assert "jit(<lambda>)" not in names, names  # the model's FLOPs: from its lowered program
    # the same update as in one chunk, to the summation order: a relative change of N eps in the
    # kernel's entries, amplified at most by the solve's condition (‖T‖ + λ)/λ
    route = minsr.update_route(lp, params, x, e, **opts)
    want, _, _ = vmcgrad.minsr_update(lp, params, x, e, diag_shift=DIAG, route=route)
    t_norm = float(jnp.linalg.norm(vmcgrad.NTK(lp, params, x, mode="complex").to_dense(), 2))
    bound = n * np.finfo(np.float64).eps * (t_norm + DIAG) / DIAG * _tree_norm(want)
    assert _tree_max_diff(got, want) <= bound, (_tree_max_diff(got, want), bound)


def test_the_route_search_at_a_chunk_given_compiles_one_program_where_the_jacobian_is_kept():
    """Compile time (issue 47; benchmarks/results/cpu-non-regression-47: the race's first step at
    chunk 64 compiled the update once per route it priced): where one device holds every sample and
    the dense route keeps their Jacobian over the chunks given (ntk_dense.keeps_jacobian), with
    NK = 16 ≤ P = 29, that route dominates the others as one block does (routes.choose), and the
    route search compiles one program, the dense route's; red with the bound for one block only (3
    programs: the parameter route and CG too)."""
    n = 8
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(n)
    lp = _logpsi(apply)
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        params, x, e = jax.device_put((params, x, e), jax.devices()[0])
        opts = dict(diag_shift=DIAG, chunk_size=2, memory_budget=2**40)
        with compiled_names() as names:
            choice = minsr.update_choice(lp, params, x, e, **opts)
        assert choice.value == ("dense", 2) and [r for r, _ in choice.priced] == ["dense"], choice
        assert names.count("jit(_update_program)") == 1, names
        got, _, _ = vmcgrad.minsr_update(lp, params, x, e, **opts)
        want, _, _ = vmcgrad.minsr_update(lp, params, x, e, diag_shift=DIAG, route="parameter")
        t_norm = float(jnp.linalg.norm(vmcgrad.NTK(lp, params, x, mode="complex").to_dense(), 2))
        bound = 4 * n * np.finfo(np.float64).eps * (t_norm + DIAG) / DIAG * _tree_norm(want)
        assert _tree_max_diff(got, want) <= bound, (_tree_max_diff(got, want), bound)


def test_fit_compiles_the_largest_chunk_first_unless_the_route_is_tight():
    """routes.fit on a stub program whose every chunk is over the budget (bytes 1000 + c): with room
    for the route's matrix (floor at most TIGHT_FLOOR of the budget) the search starts at the largest
    chunk (one compilation where the update fits whole); with a tight floor the one-sample chunk is
    compiled first and the route is out after that one compilation. Either way ``need`` is the
    one-sample chunk's bytes."""
    apply, _ = MODELS["r2c"]
    x, _ = _data(16)
    budget = 500
    prob, _, _ = problem("t", _logpsi(apply), _params(False), x, chunk_size="auto", memory_budget=budget)
    lowered = []

    class Program:
        def lower(self, at, *args):
            lowered.append(at.chunk_size)
            memory = types.SimpleNamespace(
                temp_size_in_bytes=1000 + at.chunk_size, argument_size_in_bytes=0, output_size_in_bytes=0
            )
            return types.SimpleNamespace(
                compile=lambda: types.SimpleNamespace(memory_analysis=lambda: memory)
            )

    roomy = routes.fit(Program(), prob, (), "cg", floor=int(routes.TIGHT_FLOOR * budget))
    assert roomy[:3] == (False, None, 1001) and lowered[0] == prob.n_local and lowered[-1] == 1, lowered
    lowered.clear()
    tight = routes.fit(Program(), prob, (), "cg", floor=int(routes.TIGHT_FLOOR * budget) + 1)
    assert tight[:3] == (False, None, 1001) and tight.compiled == 1 and lowered == [1], lowered


def _fresh_state():
    """Every trace and every choice forgotten: jax.jit's caches and vmcgrad's own (_cache.registry)."""
    from vmcgrad._cache import registry

    jax.clear_caches()
    for cache in registry():
        cache.clear()


def test_pricing_two_platforms_in_one_process_prices_each_platforms_program():
    """The program MinSR's update runs depends on the platform its choices are made for: the chunk's
    Jacobians a sixteenth at a time on a CPU, the whole chunk at once on an accelerator
    (ntk_modes.jacobian_split), read when the program is traced. jax.jit keys a trace by its static
    arguments and avals, not by vmcgrad.cost_platform, so the platform must be part of the program's
    key (the Problem's field): in one process, the update lowered and its route priced for a TPU and
    then for the CPU (and the reverse) are each what a fresh process gives for that platform, and the
    two lowered programs differ (a batch of the chunk of 8 against one of 1). Red before the fix: the
    second platform's program was the first's, traced again from jax.jit's cache."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    fixed = dict(diag_shift=DIAG, route="parameter", chunk_size=8)
    auto = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=2**20)

    def lowered():
        token = LOWERING.set(True)
        try:
            return vmcgrad.minsr_update(lp, params, x, e, **fixed).as_text()
        finally:
            LOWERING.reset(token)

    def priced():
        choice = minsr.update_choice(lp, params, x, e, **auto)
        return choice.value, choice.seconds, dict(choice.priced)

    fresh = {}
    for platform in ("tpu", "cpu"):
        _fresh_state()
        with vmcgrad.cost_platform(platform):
            fresh[platform] = (lowered(), priced())
    assert fresh["tpu"][0] != fresh["cpu"][0]  # the chunk at once against a sixteenth of it
    for order in (("tpu", "cpu"), ("cpu", "tpu")):
        _fresh_state()
        for platform in order:
            with vmcgrad.cost_platform(platform):
                text, (value, seconds, each) = lowered(), priced()
            assert text == fresh[platform][0], (order, platform)
            assert value == fresh[platform][1][0], (order, platform)
            np.testing.assert_allclose(seconds, fresh[platform][1][1], rtol=1e-12)
            assert each.keys() == fresh[platform][1][2].keys()


def test_the_rule_runs_plain_cg_where_the_preconditioner_leaves_no_room(monkeypatch):
    """The matrix-free route's Nyström rank ("auto") is sized to half the budget whatever the rest of
    its program needs: at the least budget (of a grid) that plain CG fits (N = 18, 'complex' mode)
    the rank is at least 1 and that program fits no chunk, while plain CG (rank 0) fits, and no
    dense program does (below 15 000 bytes: test_the_rule_chooses_the_route_that_runs). The rule
    then runs plain CG (minsr._prepared, and update_fits for the halving search) instead of saying
    that no route fits: the update equals route="cg", nystrom_rank=0's, and choosing again compiles
    nothing (the failure at the automatic rank is cached too, routes.choose). Red before:
    NoRouteFits at a budget where a route fits; red without the failure's cache (compilations)."""
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(N)
    lp = _logpsi(apply)
    plain = dict(diag_shift=DIAG, chunk_size="auto", route="cg", nystrom_rank=0)
    fits = lambda b: minsr.update_fits(lp, params, x, e, memory_budget=b, **plain)
    budget = next(b for b in range(4_000, 15_000, 250) if fits(b))
    kw = dict(diag_shift=DIAG, chunk_size="auto", memory_budget=budget, tol=1e-12)
    assert nystrom.nystrom_rank(N, 2, 29, 8, budget) >= 1, budget
    assert not minsr.update_fits(lp, params, x, e, route="cg", **kw), budget  # at the automatic rank
    assert minsr.update_fits(lp, params, x, e, **kw)
    assert minsr.update_route(lp, params, x, e, **kw) == "cg"
    compiled, compile_ = [], jax.stages.Lowered.compile
    with monkeypatch.context() as m:
        m.setattr(jax.stages.Lowered, "compile", lambda *a, **k: compiled.append(1) or compile_(*a, **k))
        assert minsr.update_route(lp, params, x, e, **kw) == "cg"
    assert not compiled, len(compiled)
    ours = vmcgrad.minsr_update(lp, params, x, e, **kw)[0]
    plain = vmcgrad.minsr_update(lp, params, x, e, route="cg", nystrom_rank=0, **kw)[0]
    assert_tree_allclose(ours, plain, rtol=0, atol=0)
