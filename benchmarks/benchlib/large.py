r"""Large models at a memory budget: per-device compiled memory against N, the largest N that fits, and
the SR step time at equal memory — vmcgrad against NetKet's chunked path and NetKet's ``VMC_SR``.

Models (:func:`make_problem`), real parameters, complex :math:`\log\psi`, float64 or float32:

- ``gcnn``: ``nk.models.GCNN`` on ``nk.graph.Square(L)`` with all its automorphisms (288 for
  ``L=6``), ``features=(8, 8, 8, 8)`` (P = 55 616 at ``L=6``);
- ``vit``: :class:`benchlib._vit.ViT`, 2×2 patches (9 tokens at ``L=6``), embedding 64, 2
  blocks (P = 100 354).

Estimators, each one ``jax.jit`` over ``(params, samples, local_values, v)`` (the local values
:math:`L_i` are given: sampling and the local-energy kernel are excluded from every candidate):

- ``expect_grad``: :math:`g = 2\,\mathrm{Re}\,F`, :math:`F = \frac1N\sum_i O_i^*(L_i - \bar L)`;
- ``qgt_matvec``: :math:`(S + \epsilon) v`, the operator built in the same program;
- ``sr_step``: :math:`(S + \epsilon)^{-1} g` — ``cg_iters`` conjugate-gradient iterations
  (``tol=0``) for the on-the-fly implementations, NetKet's default dense solver
  (``cholesky_with_fallback``) for ``VMC_SR``.

Implementations (:data:`IMPLS`):

- ``vmcgrad``: ``vmcgrad.expect_grad`` / ``vmcgrad.QGT(...) @ v`` / ``QGT(...).solve(expect_grad(...))``
  at a fixed ``chunk_size``;
- ``vmcgrad auto``: the same at ``vmcgrad.auto_chunk_size(..., estimator=..., memory_budget=B)``
  (for ``sr_step`` the smaller of the ``expect_grad`` and ``QGT`` choices);
- ``netket chunked``: what ``nk.vqs.MCState(chunk_size=c).expect_and_grad`` runs after its local
  kernel (``nk.jax.vjp_chunked(..., conjugate=True)`` of :math:`(L-\bar L)^*/N`, then
  ``force_to_grad``; netket/vqs/mc/mc_state/expect_forces_chunked.py) and
  ``QGTOnTheFly(chunk_size=c)`` (``@ v``; ``.solve(cg)`` for the step);
- ``VMC_SR dense`` / ``VMC_SR ntk``: the jitted kernels ``nk.driver.VMC_SR`` calls
  (netket/_src/ngd/sr_srt_common.py ``_sr_srt_common`` with ``use_ntk=False``: the dense
  :math:`N\times P` Jacobian and the :math:`P\times P` matrix; netket/_src/ngd/srt_onthefly.py
  ``srt_onthefly``: ``use_ntk=True, on_the_fly=True``, the :math:`N\times N` kernel), with
  ``chunk_size_bwd = c``; ``sr_step`` only.

Memory is read from compiled programs, lowered on ``jax.ShapeDtypeStruct`` samples (nothing runs, so
N can exceed the machine): ``temp`` is ``memory_analysis().temp_size_in_bytes`` per device,
``total`` is :func:`vmcgrad.program_bytes` (temporaries + arguments + outputs), the figure a budget is
compared with. :func:`largest_n` finds the largest N (a multiple of the chunk) whose program fits a
budget by bracketing and bisection over compiled programs, both ends verified.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._harness import Candidate, Row, measure
from ._table import Column, table

IMPLS = ("vmcgrad", "vmcgrad auto", "netket chunked", "VMC_SR dense", "VMC_SR ntk")
ESTIMATORS = ("expect_grad", "qgt_matvec", "sr_step")
#: Estimators each implementation provides (VMC_SR is a whole step).
PROVIDES = {
    "vmcgrad": ESTIMATORS,
    "vmcgrad auto": ESTIMATORS,
    "netket chunked": ESTIMATORS,
    "VMC_SR dense": ("sr_step",),
    "VMC_SR ntk": ("sr_step",),
}
BUDGETS = (256 * 2**20, 2**30)
MiB = 2**20

#: Model sizes: "large" for the benchmark, "small" for notebook 05 and the smoke runs.
SIZES = {
    ("gcnn", "large"): {"L": 6, "features": (8, 8, 8, 8)},
    ("gcnn", "small"): {"L": 4, "features": (2, 2)},
    ("vit", "large"): {"L": 6, "patch": 2, "embed": 64, "depth": 2, "heads": 4},
    ("vit", "small"): {"L": 4, "patch": 2, "embed": 8, "depth": 1, "heads": 2},
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One model at one dtype: its ``apply``, parameters and sample layout."""

    name: str
    dtype: str
    size: str
    model: Any
    params: Any
    n_sites: int
    mode: str  # NetKet's Jacobian mode for VMC_SR ('complex' for real params and complex output)

    @property
    def n_params(self) -> int:
        return sum(math.prod(p.shape) for p in jax.tree.leaves(self.params))

    @property
    def out_dtype(self) -> Any:
        return jnp.complex128 if self.dtype == "float64" else jnp.complex64

    def logpsi(self, w: Any, x: jax.Array) -> jax.Array:
        return self.model.apply({"params": w}, x)


def make_problem(
    name: str = "gcnn", dtype: str = "float64", *, size: str = "large", seed: int = 0
) -> Problem:
    """The model ``name`` ('gcnn' or 'vit') with ``dtype`` ('float64' or 'float32') parameters."""
    import netket as nk

    from ._vit import ViT

    if (name, size) not in SIZES:
        raise ValueError(
            f"make_problem: unknown model/size {(name, size)!r}; expected one of {sorted(SIZES)}"
        )
    if dtype not in ("float64", "float32"):
        raise ValueError(f"make_problem: dtype must be 'float64' or 'float32'; got {dtype!r}")
    kw = dict(SIZES[(name, size)])
    L = kw.pop("L")
    dt = jnp.dtype(dtype)
    if name == "gcnn":
        g = nk.graph.Square(L)
        model = nk.models.GCNN(
            symmetries=g, layers=len(kw["features"]), features=kw["features"], param_dtype=dt
        )
    else:
        model = ViT(L=L, param_dtype=dt, **kw)
    x0 = jnp.ones((2, L * L), dt)
    params = model.init(jax.random.key(seed), x0)["params"]
    mode = nk.jax.jacobian_default_mode(model.apply, {"params": params}["params"], {}, x0, warn=False)
    return Problem(name, dtype, size, model, params, L * L, str(mode))


# --- inputs ------------------------------------------------------------------------------------


def _sample_sharding() -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, None
    return NamedSharding(mesh, P("S")), NamedSharding(mesh, P())


def abstract_inputs(prob: Problem, n: int) -> tuple:
    """``(samples, local_values, v)`` as ``ShapeDtypeStruct``s for ``n`` samples (placed as NetKet does)."""
    s_shard, _ = _sample_sharding()
    x = jax.ShapeDtypeStruct((n, prob.n_sites), jnp.dtype(prob.dtype), sharding=s_shard)
    e = jax.ShapeDtypeStruct((n,), prob.out_dtype, sharding=s_shard)
    v = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), prob.params)
    return x, e, v


def concrete_inputs(prob: Problem, n: int, seed: int = 1) -> tuple:
    """Random ±1 samples, complex local values and a random parameter-shaped vector."""
    k_x, k_e, k_v = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(prob.dtype)
    x = jax.random.choice(k_x, jnp.array([-1.0, 1.0], dt), (n, prob.n_sites))
    e = jax.random.normal(k_e, (n, 2), dt) @ jnp.array([1.0, 1j], prob.out_dtype) - 2.0 * prob.n_sites
    leaves, tdef = jax.tree.flatten(prob.params)
    v = tdef.unflatten(
        [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(jax.random.split(k_v, len(leaves)), leaves)]
    )
    s_shard, r_shard = _sample_sharding()
    if s_shard is not None:
        x, e = jax.device_put((x, e), s_shard)
        v = jax.device_put(v, r_shard)
    return x, e, v


# --- programs ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every program shares: the fixed chunk, the shift, the CG iterations."""

    chunk: int = 64
    diag_shift: float = 0.01
    cg_iters: int = 10


def auto_chunk(prob: Problem, estimator: str, x: Any, budget: int) -> int:
    """``vmcgrad.auto_chunk_size`` for ``estimator`` (sr_step: the smaller of expect_grad's and QGT's).

    Raises:
        MemoryError: when no chunk fits (from ``vmcgrad.auto_chunk_size``).
    """
    import vmcgrad

    if estimator == "sr_step":
        return min(auto_chunk(prob, "expect_grad", x, budget), auto_chunk(prob, "qgt_matvec", x, budget))
    est = {"expect_grad": "expect_grad", "qgt_matvec": "QGT"}[estimator]
    if not isinstance(x, jax.ShapeDtypeStruct):
        return vmcgrad.auto_chunk_size(prob.logpsi, prob.params, x, estimator=est, memory_budget=budget)
    # auto_chunk_size takes arrays; under a trace it sizes the tracer's shape (nothing is allocated)
    chosen = []

    def trace(x):
        chosen.append(
            vmcgrad.auto_chunk_size(prob.logpsi, prob.params, x, estimator=est, memory_budget=budget)
        )
        return x[:1]

    jax.eval_shape(trace, x)
    return chosen[0]


def program(prob: Problem, impl: str, estimator: str, chunk: int, st: Settings) -> Callable:
    """The jitted ``(params, samples, local_values, v) -> result`` of ``impl``'s ``estimator``."""
    if estimator not in PROVIDES[impl]:
        raise ValueError(f"program: {impl!r} has no {estimator!r}; it provides {PROVIDES[impl]}")
    if impl.startswith("vmcgrad"):
        return _vmcgrad_program(prob, estimator, chunk, st)
    if impl == "netket chunked":
        return _netket_chunked_program(prob, estimator, chunk, st)
    return _vmc_sr_program(prob, impl, chunk, st)


def _vmcgrad_program(prob: Problem, estimator: str, chunk: int, st: Settings) -> Callable:
    import vmcgrad

    f = prob.logpsi

    def grad(w, x, e):
        return vmcgrad.expect_grad(f, w, x, e, chunk_size=chunk)

    def qgt(w, x):
        return vmcgrad.QGT(f, w, x, chunk_size=chunk, diag_shift=st.diag_shift)

    if estimator == "expect_grad":
        return jax.jit(lambda w, x, e, v: grad(w, x, e))
    if estimator == "qgt_matvec":
        return jax.jit(lambda w, x, e, v: qgt(w, x) @ v)
    return jax.jit(lambda w, x, e, v: qgt(w, x).solve(grad(w, x, e), tol=0.0, maxiter=st.cg_iters)[0])


def _netket_chunked_program(prob: Problem, estimator: str, chunk: int, st: Settings) -> Callable:
    import netket as nk
    from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor
    from netket.vqs.mc.common import force_to_grad

    apply = prob.model.apply

    def grad(w, x, e):  # netket/vqs/mc/mc_state/expect_forces_chunked.py, after the local kernel
        n = e.shape[0]
        de = e - jnp.mean(e)
        vjp = nk.jax.vjp_chunked(
            lambda w, ms, s: apply({"params": w, **ms}, s),
            w,
            {},
            x,
            conjugate=True,
            chunk_size=chunk,
            chunk_argnums=2,
            nondiff_argnums=(1, 2),
        )
        (force,) = vjp(jnp.conjugate(de) / n)
        return force_to_grad(force, w)

    def qgt(w, x):
        return QGTOnTheFly_DefaultConstructor(apply, w, {}, x, chunk_size=chunk, diag_shift=st.diag_shift)

    solver = functools.partial(jax.scipy.sparse.linalg.cg, tol=0.0, maxiter=st.cg_iters)
    if estimator == "expect_grad":
        return jax.jit(lambda w, x, e, v: grad(w, x, e))
    if estimator == "qgt_matvec":
        return jax.jit(lambda w, x, e, v: qgt(w, x) @ v)
    return jax.jit(lambda w, x, e, v: qgt(w, x).solve(solver, grad(w, x, e))[0])


def _vmc_sr_program(prob: Problem, impl: str, chunk: int, st: Settings) -> Callable:
    import netket as nk
    from netket._src.ngd.sr_srt_common import _sr_srt_common
    from netket._src.ngd.srt_onthefly import srt_onthefly

    # both are netket.utils.timing.timed wrappers (functools.wraps) around the jitted kernel
    dense, otf = _sr_srt_common.__wrapped__, srt_onthefly.__wrapped__
    kw = dict(
        diag_shift=st.diag_shift,
        solver_fn=nk.optimizer.solver.cholesky_with_fallback,  # VMC_SR's default
        mode=prob.mode,
        chunk_size=chunk,
    )
    if impl == "VMC_SR dense":
        return _NetKetKernel(dense, prob.model.apply, {**kw, "use_ntk": False})
    return _NetKetKernel(otf, prob.model.apply, kw)


class _NetKetKernel:
    """NetKet's jitted ``kernel(log_psi, local_values, params, model_state, samples, **kw)`` with the
    ``(params, samples, local_values, v)`` signature of the other programs, lowered directly: wrapped in
    another ``jax.jit`` it fails (its ``params_structure`` of ShapeDtypeStructs becomes a constant)."""

    def __init__(self, kernel: Callable, apply: Callable, kw: dict):
        self.kernel, self.apply, self.kw = kernel, apply, kw

    def __call__(self, w, x, e, v=None):
        return self.kernel(self.apply, e, w, {}, x, **self.kw)[0]

    def lower(self, w, x, e, v=None):
        return self.kernel.lower(self.apply, e, w, {}, x, **self.kw)


# --- memory ------------------------------------------------------------------------------------


def compile_at(
    prob: Problem, impl: str, estimator: str, n: int, st: Settings, *, budget: int | None = None
) -> dict:
    """Compiles (does not run) ``impl``'s ``estimator`` at ``n`` samples.

    For ``vmcgrad auto`` the chunk is chosen for ``budget`` bytes per device by :func:`auto_chunk`,
    then halved while the compiled program still exceeds the budget (the SR step holds both passes'
    buffers); when none fits the result has ``chunk=None`` and infinite bytes.

    Returns:
        ``{"chunk", "temp_bytes", "total_bytes"}`` (per device); cached per problem and arguments.
    """
    import vmcgrad

    key = (id(prob), impl, estimator, n, st, budget if impl == "vmcgrad auto" else None)
    if key in _compiled:
        return dict(_compiled[key])
    x, e, v = abstract_inputs(prob, n)
    chunk = st.chunk
    if impl == "vmcgrad auto":
        try:
            chunk = auto_chunk(prob, estimator, x, budget)
        except MemoryError:
            _compiled[key] = {"chunk": None, "temp_bytes": math.inf, "total_bytes": math.inf}
            return dict(_compiled[key])
    compiled = program(prob, impl, estimator, chunk, st).lower(prob.params, x, e, v).compile()
    while impl == "vmcgrad auto" and vmcgrad.program_bytes(compiled) > budget:
        # the step holds both passes' buffers and CG's vectors: halve until the whole step fits
        if chunk == 1:
            _compiled[key] = {"chunk": None, "temp_bytes": math.inf, "total_bytes": math.inf}
            return dict(_compiled[key])
        chunk //= 2
        compiled = program(prob, impl, estimator, chunk, st).lower(prob.params, x, e, v).compile()
    _compiled[key] = {
        "chunk": chunk,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "total_bytes": vmcgrad.program_bytes(compiled),
    }
    return dict(_compiled[key])


#: compile_at's results, per (problem, implementation, estimator, N, settings, auto budget).
_compiled: dict = {}


def memory_table(
    prob: Problem,
    sizes: tuple[int, ...] = (2**12, 2**13, 2**14, 2**15, 2**16),
    *,
    st: Settings = Settings(),
    impls: tuple[str, ...] = IMPLS,
    estimators: tuple[str, ...] = ESTIMATORS,
    auto_estimators: tuple[str, ...] = ("sr_step",),
    auto_budget: int = BUDGETS[0],
    log: Any = print,
) -> list[dict]:
    """Compiled per-device memory of every (implementation, estimator) at every N in ``sizes``
    (``vmcgrad auto`` only for ``auto_estimators``: each of its points is a search over chunks)."""
    rows = []
    for n in sizes:
        for impl in impls:
            for est in estimators:
                if est not in PROVIDES[impl] or (impl == "vmcgrad auto" and est not in auto_estimators):
                    continue
                t0 = time.perf_counter()
                m = compile_at(prob, impl, est, n, st, budget=auto_budget)
                m["compile_s"] = time.perf_counter() - t0
                row = {"model": prob.name, "dtype": prob.dtype, "P": prob.n_params, "N": n, "impl": impl}
                row.update(estimator=est, **m, budget=auto_budget if impl == "vmcgrad auto" else None)
                rows.append(row)
                log(
                    f"[{prob.name} {prob.dtype} N={n}] {impl:<15} {est:<12} chunk={m['chunk']} "
                    f"temp={m['temp_bytes'] / MiB:.2f} MiB total={m['total_bytes'] / MiB:.2f} MiB "
                    f"({m['compile_s']:.1f} s)"
                )
    return rows


def largest_n(
    fits: Callable[[int], bool], *, granule: int, hint: int, n_max: int, rel: float = 1 / 64
) -> tuple[int, int | None, int]:
    """The largest multiple ``n`` of ``granule`` (at most ``n_max``) with ``fits(n)``, for monotone ``fits``.

    From ``hint`` the search steps up (or down) by a growing factor until it brackets the limit,
    then bisects until the bracket is within ``rel`` of its lower end (or one granule).

    Returns:
        ``(lo, hi, probes)``: ``lo`` verified to fit (0 when not even ``granule`` does), ``hi`` verified
        not to fit (None when ``n_max`` fits), and the number of ``fits`` calls.

    Examples:
        >>> fits = lambda n: 1000 + 3 * n <= 10_000
        >>> lo, hi, _ = largest_n(fits, granule=8, hint=64, n_max=2**20)
        >>> lo, fits(lo), fits(hi), hi - lo <= 0.02 * lo + 8
        (2984, True, False, True)
    """
    k_max = n_max // granule
    probes = 0

    def ok(k: int) -> bool:
        nonlocal probes
        probes += 1
        return fits(k * granule)

    k = min(max(1, round(hint / granule)), k_max)
    factor = 1.05
    if ok(k):
        lo, hi = k, None
        while hi is None:
            if lo == k_max:
                return lo * granule, None, probes
            nxt = min(k_max, max(lo + 1, math.ceil(lo * factor)))
            lo, hi = (nxt, None) if ok(nxt) else (lo, nxt)
            factor *= factor
    else:
        lo, hi = None, k
        while lo is None:
            if hi == 1:
                return 0, granule, probes
            nxt = max(1, min(hi - 1, math.floor(hi / factor)))
            lo, hi = (nxt, hi) if ok(nxt) else (None, nxt)
            factor *= factor
    while hi - lo > max(1, math.floor(lo * rel)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * granule, hi * granule, probes


def n_limits(
    prob: Problem,
    *,
    st: Settings = Settings(),
    impls: tuple[str, ...] = IMPLS,
    estimators: tuple[str, ...] = ("sr_step",),
    budgets: tuple[int, ...] = BUDGETS,
    n_max: int = 2**24,
    fit_sizes: tuple[int, int] = (2**12, 2**14),
    rel: float = 1 / 32,
    log: Any = print,
) -> list[dict]:
    """The largest N per device whose compiled ``total_bytes`` fits each budget, per implementation.

    The hint for :func:`largest_n` is the affine fit of the bytes at ``fit_sizes`` (total N; all these
    programs are affine or quadratic in N); the limit itself is found by compiling, not extrapolated.
    """
    rows = []
    n_dev = jax.device_count()
    for impl in impls:
        for est in estimators:
            if est not in PROVIDES[impl]:
                continue
            for budget in budgets:

                def total(n, impl=impl, est=est, budget=budget):
                    return compile_at(prob, impl, est, n, st, budget=budget)["total_bytes"]

                n1, n2 = fit_sizes
                b1, b2 = total(n1), total(n2)
                if math.isfinite(b1) and math.isfinite(b2) and b2 > b1:
                    hint = int(n1 + (budget - b1) * (n2 - n1) / (b2 - b1))
                else:
                    hint = n2
                granule = st.chunk * n_dev
                lo, hi, probes = largest_n(
                    lambda n, total=total, budget=budget: total(n) <= budget,
                    granule=granule,
                    hint=max(granule, hint),
                    n_max=n_max,
                    rel=rel,
                )
                row = {"model": prob.name, "dtype": prob.dtype, "P": prob.n_params, "impl": impl}
                row.update(estimator=est, budget=budget, n_max_per_device=lo // n_dev)
                row.update(n_fails_per_device=None if hi is None else hi // n_dev, compiles=probes + 2)
                rows.append(row)
                log(
                    f"[{prob.name} {prob.dtype}] {impl:<15} {est:<12} budget {budget / MiB:.0f} MiB: "
                    f"largest N/device {lo // n_dev} (fails at {None if hi is None else hi // n_dev}; "
                    f"{probes + 2} compiles)"
                )
    return rows


# --- time at equal memory ----------------------------------------------------------------------


def step_times(
    prob: Problem,
    n: int,
    *,
    st: Settings = Settings(),
    repeats: int = 3,
    run_limit: int = 4 * 2**30,
    against: tuple[str, ...] = ("netket chunked", "VMC_SR ntk", "VMC_SR dense"),
    checks: tuple[str, ...] = ESTIMATORS,
    log: Any = print,
) -> tuple[list[Row], list[dict]]:
    """Times one SR step (local values given: sampling excluded) of every implementation, interleaved.

    NetKet's candidates (``against``) run at the fixed chunk; for each of them, ``vmcgrad @ <impl>``
    runs at the chunk ``vmcgrad.auto_chunk_size`` picks for that candidate's own ``total_bytes``
    (equal memory), and ``vmcgrad`` at the fixed chunk. Programs over ``run_limit`` bytes are
    compiled but not run. Before timing, vmcgrad's ``checks`` (gradient, ``S @ v``, CG step) are
    checked against NetKet's chunked ones (relative 1e-8 in float64, 1e-3 in float32; the CG step
    with ``diag_shift=1``).

    Returns:
        ``(rows, ratios)``: harness rows (setting ``model, dtype, N``) and one dict per NetKet
        candidate with vmcgrad's time and memory ratios against it at equal memory.
    """
    import vmcgrad

    x, e, v = concrete_inputs(prob, n)
    args = (prob.params, x, e, v)
    rtol = 1e-8 if prob.dtype == "float64" else 1e-3
    if checks:
        from ._harness import check_agree

        # the check's CG runs with diag_shift 1 (well conditioned): at 0.01, 10 iterations of tol=0 CG
        # amplify rounding differences of 1e-16 to 1e-4 (the same inputs, both correct)
        st_check = dataclasses.replace(st, diag_shift=1.0)
        for est in checks:
            res = {i: program(prob, i, est, st.chunk, st_check)(*args) for i in ("netket chunked", "vmcgrad")}
            errs = check_agree(res, rtol=rtol)
            log(f"[{prob.name} {prob.dtype} N={n}] {est}: vmcgrad vs netket chunked, max rel. error {errs}")
    cands, info = [], {}
    for impl in against:
        f = program(prob, impl, "sr_step", st.chunk, st)
        c = f.lower(*args).compile()
        total = vmcgrad.program_bytes(c)
        info[impl] = {"total_bytes": total, "temp_bytes": c.memory_analysis().temp_size_in_bytes}
        if total > run_limit:
            log(f"[{prob.name} {prob.dtype} N={n}] {impl}: {total / MiB:.0f} MiB > run limit, not timed")
            continue
        cands.append(Candidate(impl, _runner(f, c, args), c))
        chunk = compile_at(prob, "vmcgrad auto", "sr_step", n, st, budget=total)["chunk"]
        if chunk is None:
            info[impl]["vmcgrad_chunk"] = None
            continue
        info[impl]["vmcgrad_chunk"] = chunk
        name = f"vmcgrad @ {impl}"
        fv = program(prob, "vmcgrad", "sr_step", chunk, st)
        cv = fv.lower(*args).compile()
        info[impl]["vmcgrad_total_bytes"] = vmcgrad.program_bytes(cv)
        cands.append(Candidate(name, _runner(fv, cv, args), cv))
    ff = program(prob, "vmcgrad", "sr_step", st.chunk, st)
    cf = ff.lower(*args).compile()
    cands.append(Candidate("vmcgrad", _runner(ff, cf, args), cf))
    setting = {"model": prob.name, "dtype": prob.dtype, "N": n}
    rows = measure("large_sr_step", setting, cands, repeats=repeats)
    by = {r.name: r for r in rows}
    ratios = []
    for impl, i in info.items():
        mine = by.get(f"vmcgrad @ {impl}")
        theirs = by.get(impl)
        if mine is None or theirs is None:
            continue
        ratios.append(
            {
                **setting,
                "vs": impl,
                "vmcgrad_chunk": i["vmcgrad_chunk"],
                "time_ratio": mine.median / theirs.median,
                "memory_ratio": i["vmcgrad_total_bytes"] / i["total_bytes"],
                "netket_ms": theirs.median * 1e3,
                "vmcgrad_ms": mine.median * 1e3,
            }
        )
        log(
            f"[{prob.name} {prob.dtype} N={n}] vmcgrad (chunk {i['vmcgrad_chunk']}) / {impl} "
            "at equal memory: "
            f"time {ratios[-1]['time_ratio']:.2f}x, memory {ratios[-1]['memory_ratio']:.2f}x"
        )
    return rows, ratios


def _runner(f: Any, compiled: Any, args: tuple) -> Callable:
    """A no-argument call of the compiled program (NetKet's kernels: through their own jit)."""
    if isinstance(f, _NetKetKernel):
        return functools.partial(f, *args)
    return functools.partial(compiled, *args)


# --- reports -----------------------------------------------------------------------------------


def format_limits(rows: list[dict]) -> str:
    """Table: largest N per device at each budget, per model, dtype, estimator and implementation."""
    budgets = sorted({r["budget"] for r in rows})
    groups: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: (r["model"], r["dtype"], r["estimator"], IMPLS.index(r["impl"]))):
        key = (r["model"], r["dtype"], r["P"], r["estimator"], r["impl"])
        groups.setdefault(key, dict(zip(("model", "dtype", "P", "estimator", "impl"), key)))[r["budget"]] = r
    columns = [Column(h, h, align="<") for h in ("model", "dtype", "P", "estimator", "impl")]
    columns += [Column(f"N/device <= {b / MiB:.0f} MiB", lambda g, b=b: _n_cell(g.get(b))) for b in budgets]
    return table(groups.values(), columns)


def _n_cell(r: dict | None) -> str | None:
    if r is None:
        return None
    if r["n_max_per_device"] == 0:
        return "none"
    if r["n_fails_per_device"] is None:
        return f">= {r['n_max_per_device']}"
    return str(r["n_max_per_device"])


def format_memory(rows: list[dict]) -> str:
    """Table: temp / total MiB per implementation and estimator, one column per N."""
    sizes = sorted({r["N"] for r in rows})
    groups: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: str((r["model"], r["dtype"], r["estimator"], r["impl"]))):
        key = (r["model"], r["dtype"], r["estimator"], r["impl"])
        groups.setdefault(key, dict(zip(("model", "dtype", "estimator", "impl"), key)))[r["N"]] = r

    def cell(r: dict | None) -> str | None:
        if r is None or not math.isfinite(r["total_bytes"]):
            return None
        return f"{r['temp_bytes'] / MiB:.1f}/{r['total_bytes'] / MiB:.1f}"

    columns = [Column(h, h, align="<") for h in ("model", "dtype", "estimator", "impl")]
    columns += [Column(f"N={n}", lambda g, n=n: cell(g.get(n))) for n in sizes]
    return (
        table(groups.values(), columns) + "\n(temp/total MiB per device; total = temp + arguments + outputs)"
    )


def run_suite(
    *,
    models: tuple[str, ...] = ("gcnn", "vit"),
    dtypes: tuple[str, ...] = ("float64", "float32"),
    size: str = "large",
    sizes: tuple[int, ...] = (2**12, 2**14, 2**16),
    budgets: tuple[int, ...] = BUDGETS,
    limit_estimators: tuple[str, ...] = ("sr_step",),
    time_n: int = 512,
    repeats: int = 3,
    st: Settings = Settings(),
    n_max: int = 2**24,
    impls: tuple[str, ...] = IMPLS,
    log: Any = print,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Memory table, N limits and step times for every model and dtype; returns them as one dict.

    ``on_result(result)`` is called after every stage (to save partial results).
    """
    result: dict = {"memory": [], "limits": [], "times": [], "ratios": [], "settings": dataclasses.asdict(st)}
    for name in models:
        for dtype in dtypes:
            prob = make_problem(name, dtype, size=size)
            log(f"== {name} {dtype}: P = {prob.n_params}, mode {prob.mode}")
            auto_budget = budgets[0] if budgets else BUDGETS[0]
            result["memory"] += memory_table(
                prob, sizes, st=st, impls=impls, auto_budget=auto_budget, log=log
            )
            if on_result is not None:
                on_result(result)
            if budgets:
                fit = (sizes[0], sizes[1]) if len(sizes) > 1 else (sizes[0], 4 * sizes[0])
                result["limits"] += n_limits(
                    prob,
                    st=st,
                    impls=impls,
                    estimators=limit_estimators,
                    budgets=budgets,
                    n_max=n_max,
                    fit_sizes=fit,
                    log=log,
                )
                if on_result is not None:
                    on_result(result)
            if time_n:
                against = tuple(i for i in ("netket chunked", "VMC_SR ntk", "VMC_SR dense") if i in impls)
                rows, ratios = step_times(prob, time_n, st=st, repeats=repeats, against=against, log=log)
                result["times"] += [r.as_dict() for r in rows]
                result["ratios"] += ratios
                if on_result is not None:
                    on_result(result)
    return result


def format_ratios(ratios: list[dict]) -> str:
    """Table of vmcgrad's SR-step time and memory at NetKet's memory, per NetKet candidate."""
    return table(
        ratios,
        [
            Column("model", "model", align="<"),
            Column("dtype", "dtype", align="<"),
            Column("N", "N"),
            Column("vs", "vs", align="<"),
            Column("vg chunk", "vmcgrad_chunk"),
            Column("nk ms", "netket_ms", ".1f"),
            Column("vg ms", "vmcgrad_ms", ".1f"),
            Column("t ratio", "time_ratio", ".2f"),
            Column("m ratio", "memory_ratio", ".2f"),
        ],
    )


def report(result: dict) -> str:
    """The three tables of a :func:`run_suite` result: memory against N, N limits, step-time ratios."""
    parts = ["Compiled memory per device (nothing run):", format_memory(result["memory"])]
    if result["limits"]:
        parts += [
            "",
            "Largest N per device whose compiled program (temp + arguments + outputs) fits the budget:",
            format_limits(result["limits"]),
        ]
    if result["ratios"]:
        parts += [
            "",
            "SR step (local values given, sampling excluded) at equal memory, medians interleaved:",
            format_ratios(result["ratios"]),
        ]
    return "\n".join(parts)
