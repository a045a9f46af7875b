"""NetKet's own QGT contract for ``vmcgrad.netket.QGTOnTheFly``, tested as NetKet tests its QGTs.

The layout follows NetKet's ``test/optimizer/test_qgt_itersolve.py`` and ``test_qgt_solvers.py``:
fixtures over models (RBM float64/float32/complex128, RBMModPhase) and chunk sizes, parametrised
QGT constructors and solvers, then ``solve``, ``@`` on pytrees and flat vectors, ``to_dense``, a
pytree ``diag_shift``, the holomorphic declaration and the errors NetKet raises. Unlike NetKet's
tests (which check ``S @ x ≈ y`` only), every number here is compared with NetKet's
``QGTJacobianDense`` — and NetKet's ``QGTOnTheFly`` where it has the mode — on the same samples,
to 1e-10 in float64. Chunk sizes: None, 37 (divides no per-device count here) and one larger than
the samples.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, compile_count, qgt_bytes
from jax.flatten_util import ravel_pytree
from jax.nn.initializers import normal

with jax.set_mesh(None):
    import netket as nk
    from netket.optimizer import qgt as nkqgt

    import vmcgrad
    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
N_CHAINS = 4 * N_DEV
N_SAMPLES = 63 * N_CHAINS  # 252 per device on 4 devices, 1008 on 1: 37 divides neither
# one chunk, and chunks that divide neither the samples per device nor N (NetKet's own tests also take
# 4096: a chunk over N plans one chunk exactly as None does, vmcgrad._chunks.plan.plan_chunks, which
# test_vjp_jvp.py's chunk 1000 covers)
CHUNKS = [None, 37]

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # HolomorphicUndeclaredWarning
    pytest.mark.usefixtures("netket_mesh"),
]


RBM = functools.partial(nk.models.RBM, hidden_bias_init=normal(), visible_bias_init=normal())
RBMModPhase = functools.partial(nk.models.RBMModPhase, hidden_bias_init=normal(), kernel_init=normal())
MODELS = {
    "RBM[float64]": functools.partial(RBM, param_dtype=np.float64),
    "RBM[float32]": functools.partial(RBM, param_dtype=np.float32),
    "RBM[complex128]": functools.partial(RBM, param_dtype=np.complex128),
    "RBMModPhase[float64]": functools.partial(RBMModPhase, param_dtype=np.float64),
}


@functools.cache
def _state(model_name):
    hi = nk.hilbert.Spin(0.5, 5)
    k1, k2 = jax.random.split(jax.random.key(123))
    vs = nk.vqs.MCState(
        nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS),
        MODELS[model_name](alpha=1),
        n_samples=N_SAMPLES,
        seed=k1,
    )
    vs.init_parameters(normal(stddev=0.1), seed=k2)
    vs.sample()
    return vs


@pytest.fixture(params=list(MODELS))
def vstate(request):
    return _state(request.param)


def is_complex(vs):
    return nk.jax.tree_leaf_iscomplex(vs.parameters)


def tols(vs):
    """(rtol, atol): float64 to 1e-10; float32 as NetKet's own float32 tolerances."""
    return (1e-10, 1e-12) if nk.jax.dtype_real(vs.model.param_dtype) == np.float64 else (2e-4, 1e-5)


def kwargs_for(vs, holomorphic, diag_scale=None):
    kw = {"diag_shift": 0.01, "diag_scale": diag_scale}
    if holomorphic is not None:
        kw["holomorphic"] = holomorphic
    return kw


# (holomorphic, diag_scale); holomorphic=True is only legal for complex parameters
QGT_CONFIGS = {
    "default": (None, None),
    "holomorphic": (True, None),
    "non-holomorphic": (False, None),
    "diag_scale=0.1": (None, 0.1),
}


def refs(vs, holomorphic, diag_scale):
    """(QGTJacobianDense, NetKet's QGTOnTheFly or None) in the same mode, unchunked."""
    kw = kwargs_for(vs, holomorphic, diag_scale)
    dense = nkqgt.QGTJacobianDense(vs, **kw)
    otf = None
    if diag_scale is None:  # NetKet's OnTheFly has no diag_scale
        kw.pop("diag_scale")
        otf = nkqgt.QGTOnTheFly(vs, **kw)
    return dense, otf


def ours(vs, holomorphic, diag_scale, chunk_size):
    return vnk.QGTOnTheFly(vs, chunk_size=chunk_size, **kwargs_for(vs, holomorphic, diag_scale))


def skip_illegal(vs, holomorphic):
    if holomorphic and not is_complex(vs):
        pytest.skip("holomorphic=True on real parameters: tested in test_holomorphic_real_parameters_throws")
    if holomorphic is False and not is_complex(vs):
        pytest.skip("same as default for real parameters")


def random_tree(vs, seed=0):
    rng = nk.jax.PRNGSeq(seed)
    return jax.tree.map(lambda x: jax.random.normal(rng.next(), x.shape, dtype=x.dtype), vs.parameters)


# --- @ and to_dense ----------------------------------------------------------------------------


@pytest.mark.quick_cover("config")
@pytest.mark.parametrize("config", list(QGT_CONFIGS))
@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"chunk={c}")
def test_qgt_matmul(vstate, config, chunk_size):
    holomorphic, diag_scale = QGT_CONFIGS[config]
    skip_illegal(vstate, holomorphic)
    rtol, atol = tols(vstate)
    S = ours(vstate, holomorphic, diag_scale, chunk_size)
    dense, otf = refs(vstate, holomorphic, diag_scale)
    y = random_tree(vstate)
    x = S @ y
    assert_tree_allclose(x, dense @ y, rtol=rtol, atol=atol)  # also same structure, shapes, dtypes
    if otf is not None:
        assert_tree_allclose(x, otf @ y, rtol=rtol, atol=atol)
    # a flat vector (ravel_pytree order) gives the ravelled product, and S(v) is S @ v
    y_flat, _ = ravel_pytree(y)
    np.testing.assert_allclose(S @ y_flat, ravel_pytree(x)[0], rtol=rtol, atol=atol)
    if otf is not None:
        np.testing.assert_allclose(S @ y_flat, otf @ y_flat, rtol=rtol, atol=atol)
    assert_tree_allclose(S(y), x, rtol=0)


@pytest.mark.parametrize("config", list(QGT_CONFIGS))
@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"chunk={c}")
def test_qgt_dense(vstate, config, chunk_size):
    holomorphic, diag_scale = QGT_CONFIGS[config]
    skip_illegal(vstate, holomorphic)
    rtol, atol = tols(vstate)
    S = ours(vstate, holomorphic, diag_scale, chunk_size)
    dense, otf = refs(vstate, holomorphic, diag_scale)
    str(S)
    Sd = S.to_dense()
    n = vstate.n_parameters
    assert Sd.shape == ((2 * n, 2 * n) if S.mode == "complex" else (n, n))
    np.testing.assert_allclose(Sd, dense.to_dense(), rtol=rtol, atol=atol)
    if otf is not None and S.mode != "complex":  # NetKet's OnTheFly refuses to_dense in 'complex'
        np.testing.assert_allclose(Sd, otf.to_dense(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(S.diagonal(), jnp.diag(Sd), rtol=rtol, atol=atol)
    np.testing.assert_allclose(np.asarray(S), Sd, rtol=0)  # LinearOperator.__array__


# --- solve with every solver in nk.optimizer.solver, and jax.scipy's iterative ones -------------

SOLVERS = {
    "cg": functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-13, maxiter=4000),
    "gmres": functools.partial(jax.scipy.sparse.linalg.gmres, tol=1e-13, restart=80, maxiter=40),
    "cholesky": nk.optimizer.solver.cholesky,
    "LU": nk.optimizer.solver.LU,
    "solve": nk.optimizer.solver.solve,
    "svd": nk.optimizer.solver.svd,
    "pinv": nk.optimizer.solver.pinv,
    "pinv_smooth": nk.optimizer.solver.pinv_smooth,
    "cholesky_with_fallback": nk.optimizer.solver.cholesky_with_fallback,
}


def test_every_netket_solver_is_covered():
    """A solver added to nk.optimizer.solver must be added here (distributed ones need jaxmg)."""
    public = {name for name in dir(nk.optimizer.solver) if not name.startswith("_")}
    untested = public - set(SOLVERS) - {"cholesky_distributed", "pinv_smooth_distributed", "nan_fallback"}
    assert not untested, untested


def solve_tols(vs, x_ref=None):
    """(rtol, atol) of solutions: 1e-8 in float64; in float32 NetKet's own solver tolerances
    (test_qgt_itersolve.py: 1e-2, 1e-4), as QGTJacobianDense solves float32 models in float64.

    In float32 the absolute tolerance is relative to the solution's scale (1e-4 · max|x_ref|):
    a pseudo-inverse or an ill-conditioned solve in float32 errs by about cond · eps · |x| on
    every component, so a component near zero of a vector of size 20 differs by 2e-4 from the
    float64 reference (seen in CI on one device: 1.5667e-3 vs 1.3482e-3 next to 23.95)."""
    if nk.jax.dtype_real(vs.model.param_dtype) == np.float64:
        return 1e-8, 1e-10
    leaves = [] if x_ref is None else jax.tree.leaves(x_ref)
    scale = max([1.0] + [float(jnp.max(jnp.abs(a))) for a in leaves])
    return 1e-2, 1e-4 * scale


def like(tree, target):
    """``tree`` cast leaf by leaf to ``target``'s dtypes. QGTJacobianDense's dense solvers return
    float64 for float32 parameters; vmcgrad's (as NetKet's QGTOnTheFly) keep the parameter dtype,
    which assert_tree_allclose checks."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), tree, target)


def check_solve(vs, solver_name, holomorphic, diag_scale, chunk_size):
    float32 = nk.jax.dtype_real(vs.model.param_dtype) == np.float32
    solver = SOLVERS[solver_name]
    if float32 and solver_name in ("cg", "gmres"):
        solver = functools.partial(solver, tol=1e-6)
    S = ours(vs, holomorphic, diag_scale, chunk_size)
    dense, _ = refs(vs, holomorphic, diag_scale)
    y = vs.parameters
    x, info = S.solve(solver, y)
    x_ref, info_ref = like(dense.solve(solver, y)[0], y), dense.solve(solver, y)[1]
    assert jax.tree.structure(info) == jax.tree.structure(info_ref)  # the solver's own info
    rtol, atol = solve_tols(vs, x_ref)
    assert_tree_allclose(x, x_ref, rtol=rtol, atol=atol)
    rtol, atol = solve_tols(vs, y)
    assert_tree_allclose(S @ x, y, rtol=rtol, atol=atol)


#: (model, solver): every model with the iterative solvers (the adapter's own route: products inside
#: jax.scipy's loops) and every dense solver (NetKet's, on ``to_dense()``: one route) on two models.
DENSE_SOLVERS = [name for name in SOLVERS if name not in ("cg", "gmres")]
SOLVE_PAIRS = [(m, s) for m in MODELS for s in ("cg", "gmres")] + [
    (list(MODELS)[(i + k) % len(MODELS)], s) for i, s in enumerate(DENSE_SOLVERS) for k in (0, 2)
]


def test_solve_pairs_cover_every_model_and_solver():
    pairs = set(SOLVE_PAIRS)
    assert all((m, s) in pairs for m in MODELS for s in ("cg", "gmres"))
    assert set(DENSE_SOLVERS) | {"cg", "gmres"} == set(SOLVERS)
    assert all(len({m for m, s in pairs if s == name}) == 2 for name in DENSE_SOLVERS)


@pytest.mark.parametrize(("model_name", "solver_name"), SOLVE_PAIRS, ids=[f"{m}-{s}" for m, s in SOLVE_PAIRS])
def test_qgt_solve(model_name, solver_name):
    """Every solver, every model (holomorphic where the parameters are complex), chunk 37."""
    vstate = _state(model_name)
    check_solve(vstate, solver_name, True if is_complex(vstate) else None, None, 37)


@pytest.mark.parametrize("solver_name", ["cg", "gmres", "cholesky", "pinv_smooth"])
@pytest.mark.parametrize(
    ("model_name", "holomorphic", "diag_scale"),
    [("RBMModPhase[float64]", None, 0.1), ("RBM[complex128]", False, None)],
    ids=["diag_scale", "non-holomorphic"],
)
def test_qgt_solve_diag_scale_and_complex_mode(solver_name, model_name, holomorphic, diag_scale):
    check_solve(_state(model_name), solver_name, holomorphic, diag_scale, 37)


#: every model with CG (the solver NetKet's drivers pass x0 to) and one of the others, in turn
X0_PAIRS = [(m, s) for i, m in enumerate(MODELS) for s in ("cg", ("gmres", "cholesky", "pinv_smooth")[i % 3])]


@pytest.mark.parametrize(("model_name", "solver_name"), X0_PAIRS, ids=[f"{m}-{s}" for m, s in X0_PAIRS])
def test_qgt_solve_with_x0_and_flat_vectors(model_name, solver_name):
    """x0 (NetKet's TDVP and SR pass the last solution) and flat right-hand sides."""
    vstate = _state(model_name)
    S = ours(vstate, None, None, 37)
    dense, _ = refs(vstate, None, None)
    y = vstate.parameters
    x0 = jax.tree.map(lambda p: 0.5 * p, y)
    x, _ = S.solve(SOLVERS[solver_name], y, x0=x0)
    x_ref = like(dense.solve(SOLVERS[solver_name], y, x0=x0)[0], y)
    rtol, atol = solve_tols(vstate, x_ref)
    assert_tree_allclose(x, x_ref, rtol=rtol, atol=atol)
    y_flat, _ = ravel_pytree(y)
    x_flat, _ = S.solve(SOLVERS[solver_name], y_flat, x0=ravel_pytree(x0)[0])
    assert x_flat.shape == y_flat.shape and x_flat.dtype == y_flat.dtype
    np.testing.assert_allclose(x_flat, ravel_pytree(x_ref)[0], rtol=rtol, atol=atol)


# --- diag_shift: scalar, pytree, `+`, replace ---------------------------------------------------


def test_qgt_pytree_diag_shift(vstate):
    """NetKet's test: a pytree of equal shifts is the scalar shift; then unequal shifts against
    QGTJacobianDense with the same shifts as a flat vector in its (representation) basis (at chunk 37:
    the shift is added after the pass over the chunks, whatever the chunk)."""
    S = ours(vstate, None, None, 37)
    v = vstate.parameters
    expected = S @ v
    tree = jax.tree.map(lambda x: S.diag_shift * jnp.ones(x.shape, dtype=x.dtype), v)
    S_tree = S.replace(diag_shift=tree)
    assert_tree_allclose(S_tree @ v, expected, rtol=1e-13)
    np.testing.assert_allclose(S_tree.to_dense(), S.to_dense(), rtol=1e-13)

    rtol, atol = tols(vstate)
    shift = jax.tree.map(lambda p: 0.01 + 0.1 * jnp.abs(p).astype(nk.jax.dtype_real(p.dtype)), v)
    S_tree = S.replace(diag_shift=shift)
    dense, _ = refs(vstate, None, None)
    both = jax.tree.map(lambda d, p: d * (1 + 1j) if jnp.iscomplexobj(p) else d, shift, v)
    rep = ravel_pytree(both)[0] if S.mode != "complex" else None
    if S.mode == "complex":  # the representation: all real parts, then the imaginary parts
        rep = jnp.concatenate([ravel_pytree(jax.tree.map(jnp.real, both))[0], ravel_pytree(shift)[0]])
    dense_tree = dense.replace(diag_shift=jnp.real(rep).astype(dense.O.real.dtype))
    np.testing.assert_allclose(S_tree.to_dense(), dense_tree.to_dense(), rtol=rtol, atol=atol)
    y = random_tree(vstate, 1)
    assert_tree_allclose(S_tree @ y, dense_tree @ y, rtol=rtol, atol=atol)
    np.testing.assert_allclose(S_tree.diagonal(), jnp.diag(dense_tree.to_dense()), rtol=rtol, atol=atol)
    x, _ = S_tree.solve(SOLVERS["cg"], y)
    x_ref = like(dense_tree.solve(nk.optimizer.solver.cholesky, y)[0], y)
    assert_tree_allclose(x, x_ref, rtol=solve_tols(vstate)[0], atol=solve_tols(vstate)[1])
    # `+` adds to every entry of a per-parameter shift, as to a scalar one
    plus = S_tree + 0.5
    eye = jnp.eye(len(rep), dtype=rep.real.dtype)
    np.testing.assert_allclose(plus.to_dense(), S_tree.to_dense() + 0.5 * eye, rtol=rtol, atol=atol)


def test_plus_and_replace_match_netket(vstate):
    """NetKet's `+` adds to the shift in force; replace(diag_shift=) sets it."""
    S = ours(vstate, None, None, 37)
    dense, _ = refs(vstate, None, None)
    rtol, atol = tols(vstate)
    np.testing.assert_allclose((S + 0.5).to_dense(), (dense + 0.5).to_dense(), rtol=rtol, atol=atol)
    S2, d2 = S.replace(diag_shift=0.2), dense.replace(diag_shift=0.2)
    assert_tree_allclose(S2 @ vstate.parameters, d2 @ vstate.parameters, rtol=rtol, atol=atol)


# --- construction ------------------------------------------------------------------------------


def test_partial_construction():
    """QGTOnTheFly(chunk_size=..., diag_shift=...) is a partial; called on a state it builds."""
    vs = _state("RBMModPhase[float64]")
    part = vnk.QGTOnTheFly(chunk_size=37, diag_shift=0.02)
    assert isinstance(part, functools.partial) and part.keywords == {"chunk_size": 37, "diag_shift": 0.02}
    S = part(vs)
    assert isinstance(S, vnk.QGTOnTheFlyT) and isinstance(S, nk.optimizer.LinearOperator)
    assert S.diag_shift == 0.02 and S.qgt.chunk_size == 37
    S2 = vs.quantum_geometric_tensor(part)  # NetKet's own entry point
    np.testing.assert_allclose(S2.to_dense(), S.to_dense(), rtol=0)
    dense = nkqgt.QGTJacobianDense(vs, diag_shift=0.02)
    np.testing.assert_allclose(S.to_dense(), dense.to_dense(), rtol=1e-10, atol=1e-12)
    S3 = vnk.QGTOnTheFly(diag_scale=0.1)(vs, diag_shift=0.02)  # SR's call: qgt(vstate, diag_shift=...)
    dense3 = nkqgt.QGTJacobianDense(vs, diag_shift=0.02, diag_scale=0.1)
    np.testing.assert_allclose(S3.to_dense(), dense3.to_dense(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("QGTType", [nkqgt.QGTOnTheFly, nkqgt.QGTJacobianDense, vnk.QGTOnTheFly])
def test_holomorphic_real_parameters_throws(QGTType):
    """NetKet's error type for holomorphic=True on real parameters, directly and via the state."""
    vs = _state("RBM[float64]")
    with pytest.raises(nk.errors.IllegalHolomorphicDeclarationForRealParametersError):
        QGTType(vs, holomorphic=True)
    with pytest.raises(nk.errors.IllegalHolomorphicDeclarationForRealParametersError):
        vs.quantum_geometric_tensor(QGTType(holomorphic=True))


def test_holomorphic_undeclared_warns_as_netket():
    vs = _state("RBM[complex128]")
    for QGTType in (nkqgt.QGTOnTheFly, vnk.QGTOnTheFly):
        with pytest.warns(nk.errors.HolomorphicUndeclaredWarning, match="Defaulting to `holomorphic=False`"):
            QGTType(vs)


# --- inside jax.jit ----------------------------------------------------------------------------


@pytest.mark.parametrize("solver_name", ["cg", "gmres", "cholesky", "pinv_smooth"])
def test_inside_jit(solver_name):
    """The operator is a pytree: passed into jit, used there, rebuilt for new samples without
    recompiling (netket#1229)."""
    vs = _state("RBMModPhase[float64]")
    solver = SOLVERS[solver_name]
    S = vnk.QGTOnTheFly(vs, chunk_size=37, diag_shift=0.01)
    dense = nkqgt.QGTJacobianDense(vs, diag_shift=0.01)

    @jax.jit
    def step(S, y):
        x, _ = S.solve(solver, y)
        return x, S @ x, (S + 0.1) @ y

    y = vs.parameters
    x, sx, plus = step(S, y)
    x_ref, _ = dense.solve(solver, y)
    assert_tree_allclose(x, x_ref, rtol=1e-8, atol=1e-10)
    assert_tree_allclose(sx, y, rtol=1e-8, atol=1e-10)
    assert_tree_allclose(plus, (dense + 0.1) @ y, rtol=1e-10, atol=1e-12)
    # new samples and parameters, the same shapes: the same program
    vs2 = nk.vqs.MCState(vs.sampler, vs.model, n_samples=vs.n_samples, seed=7, sampler_seed=8)
    S2 = vnk.QGTOnTheFly(vs2, chunk_size=37, diag_shift=0.03)
    jax.block_until_ready(S2.qgt)
    before = compile_count()
    x2, _, _ = jax.block_until_ready(step(S2, vs2.parameters))
    assert compile_count() == before
    x2_ref, _ = nkqgt.QGTJacobianDense(vs2, diag_shift=0.03).solve(solver, vs2.parameters)
    assert_tree_allclose(x2, x2_ref, rtol=1e-8, atol=1e-10)


def test_solvers_need_no_private_jax():
    """Iterative solvers run through linear_call, not the private state discharge (which vmcgrad no
    longer has): solve complex (the case that needs the declared transpose)."""
    import vmcgrad._jax_private as private

    assert not hasattr(private, "discharge_state")
    vs = _state("RBM[complex128]")
    S = vnk.QGTOnTheFly(vs, chunk_size=37, diag_shift=0.01, holomorphic=False)
    dense = nkqgt.QGTJacobianDense(vs, diag_shift=0.01, holomorphic=False)
    for name in ("cg", "gmres"):
        x, _ = S.solve(SOLVERS[name], vs.parameters)
        x_ref, _ = dense.solve(SOLVERS[name], vs.parameters)
        assert_tree_allclose(x, x_ref, rtol=1e-8, atol=1e-10)
    assert not hasattr(vnk.QGTOnTheFlyT, "_in_solve")


def test_declared_transpose_is_the_adjoint():
    """jax.linear_transpose of v -> S @ v (what custom_linear_solve uses): S^T = conj(S) as S is
    Hermitian; checked against the dense matrix, complex holomorphic mode and real mode."""
    for name, holo in (("RBM[complex128]", True), ("RBMModPhase[float64]", None)):
        vs = _state(name)
        S = vnk.QGTOnTheFly(vs, chunk_size=37, diag_shift=0.01, holomorphic=holo)
        Sd = S.to_dense()
        ct = jnp.cos(jnp.arange(Sd.shape[0]) + 0.3).astype(Sd.dtype)
        (t,) = jax.linear_transpose(S.__matmul__, ct)(ct)
        np.testing.assert_allclose(t, Sd.T @ ct, rtol=1e-10, atol=1e-12)


# --- errors, as NetKet raises them ---------------------------------------------------------------

ONTHEFLY = {"netket": nkqgt.QGTOnTheFly, "vmcgrad": functools.partial(vnk.QGTOnTheFly, chunk_size=37)}


@pytest.mark.parametrize("impl", list(ONTHEFLY))
def test_qgt_throws_on_complex_vector_for_real_qgt(impl):
    """NetKet issue #789: RealQGTComplexDomainError, for pytrees and flat vectors."""
    vs = _state("RBMModPhase[float64]")
    S = ONTHEFLY[impl](vs)
    g_cmplx = jax.tree.map(lambda x: x + x * 0.1j, vs.parameters)
    with pytest.raises(nk.errors.RealQGTComplexDomainError, match="Cannot multiply the"):
        S @ g_cmplx
    with pytest.raises(nk.errors.RealQGTComplexDomainError, match="Cannot multiply the"):
        S.solve(SOLVERS["cholesky"], g_cmplx)
    if impl == "vmcgrad":  # NetKet's OnTheFly casts a flat complex vector silently
        with pytest.raises(nk.errors.RealQGTComplexDomainError):
            S @ ravel_pytree(g_cmplx)[0]


@pytest.mark.parametrize("impl", list(ONTHEFLY))
def test_qgt_throws_on_wrong_vectors(impl):
    vs = _state("RBM[float64]")
    S = ONTHEFLY[impl](vs)
    with pytest.raises(ValueError, match="PyTree mismatch"):  # NetKet's check_valid_vector_type
        S @ {"other": jnp.ones(3)}
    with pytest.raises(ValueError):
        S @ jnp.ones(vs.n_parameters + 1)
    with pytest.raises(ValueError):
        S @ jnp.ones((vs.n_parameters, 2))


class _EmptyComplexLeaf(nn.Module):
    """A real model with a complex parameter of size zero: 'complex' mode with D = P."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", normal(0.3), (x.shape[-1],), jnp.float64)
        c = self.param("c", nn.initializers.zeros, (0,), jnp.complex128)
        return jnp.log(jnp.cosh(x @ w)) + jnp.sum(c)


def test_a_real_vector_of_both_lengths_is_the_representation():
    """The one vector that two kinds fit with different answers (vmcgrad._sr.qgt.views.Views.guess): a
    real vector of length D = P in 'complex' mode, whose flat reading is complex. It is the
    representation, as in QGTJacobianDense: a real product, and a solve that jax.scipy's cg runs
    (a complex product of its real vectors ends it). vmcgrad.QGT: test_qgt.py, the same name."""
    vs = nk.vqs.MCState(
        nk.sampler.MetropolisLocal(nk.hilbert.Spin(0.5, 4), n_chains=N_CHAINS),
        _EmptyComplexLeaf(),
        n_samples=16 * N_CHAINS,
        seed=1,
    )
    S = vnk.QGTOnTheFly(vs, holomorphic=False, chunk_size=37, diag_shift=0.1)
    dense = nkqgt.QGTJacobianDense(vs, holomorphic=False, diag_shift=0.1)
    assert S.mode == "complex" and S.qgt.dim == vs.n_parameters  # D = P
    v = jnp.linspace(-1.0, 1.0, vs.n_parameters)
    product = S @ v
    assert product.dtype == jnp.float64
    np.testing.assert_allclose(product, dense @ v, rtol=1e-10, atol=1e-12)
    y = random_tree(vs, 2)
    x, _ = S.solve(SOLVERS["cg"], y)
    assert_tree_allclose(x, dense.solve(SOLVERS["cholesky"], y)[0], rtol=1e-8, atol=1e-10)


def test_vmcgrad_errors_name_the_argument():
    vs = _state("RBM[float64]")
    S = vnk.QGTOnTheFly(vs, chunk_size=37)
    bad_shape = jax.tree.map(lambda p: jnp.ones((*p.shape, 1)), vs.parameters)
    with pytest.raises(ValueError, match="leaf shapes differ from the parameters"):
        S @ bad_shape
    with pytest.raises(ValueError, match=rf"shape \({vs.n_parameters},\).*got an array of shape \(3,\)"):
        S @ jnp.ones(3)
    with pytest.raises(TypeError, match=r"`vstate` must be a netket\.vqs\.MCState"):
        vnk.QGTOnTheFly(object())
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        vnk.QGTOnTheFly(vs, chunk_size=0)
    with pytest.raises(TypeError, match="`holomorphic` must be True, False or None"):
        vnk.QGTOnTheFly(vs, holomorphic="yes")


BAD_SHIFTS = {
    "negative": (-1e-3, ValueError, "must be a finite number >= 0"),
    "nan": (float("nan"), ValueError, "must be a finite number >= 0"),
    "inf": (float("inf"), ValueError, "must be a finite number >= 0"),
    "complex": (1e-3 + 1e-3j, TypeError, "must be a real scalar"),
    "bool": (True, TypeError, "must be a real scalar"),
    "string": ("0.01", TypeError, "must be a real scalar"),
    "wrong tree": ({"a": 1.0}, TypeError, "pytree like the parameters"),
}


@pytest.mark.parametrize("case", list(BAD_SHIFTS))
def test_bad_diag_shift_refused_before_tracing(case):
    """Issue 12: refused at construction, in replace() and in `+`, naming the argument."""
    value, err, match = BAD_SHIFTS[case]
    vs = _state("RBM[float64]")
    with pytest.raises(err, match=f"`diag_shift`.*{match}|{match}.*`diag_shift`"):
        vnk.QGTOnTheFly(vs, diag_shift=value)
    with pytest.raises(err, match=match):
        vnk.QGTOnTheFly(diag_shift=value)(vs)
    S = vnk.QGTOnTheFly(vs, diag_shift=0.01)
    with pytest.raises(err, match=match):
        S.replace(diag_shift=value)
    if case in ("negative", "nan", "inf"):
        with pytest.raises(ValueError, match=match):
            S + (value - 0.01)


def test_scalar_shift_checks_are_the_cores():
    """vmcgrad.netket checks a scalar diag_shift or diag_scale with the core's one check: the message
    of vmcgrad.QGT, naming vmcgrad.netket.QGTOnTheFly."""
    vs = _state("RBM[float64]")
    x = vs.samples.reshape(-1, vs.samples.shape[-1])
    logpsi = lambda p, x: vs.model.apply({"params": p}, x)
    for case in ("negative", "nan", "complex", "bool", "string"):
        value = BAD_SHIFTS[case][0]
        for name in ("diag_shift", "diag_scale"):
            with pytest.raises((TypeError, ValueError)) as ours:
                vnk.QGTOnTheFly(vs, **{name: value})
            with pytest.raises((TypeError, ValueError)) as core:
                vmcgrad.QGT(logpsi, vs.parameters, x, **{name: value})
            assert type(ours.value) is type(core.value), (case, name)
            assert str(ours.value) == str(core.value).replace("vmcgrad.QGT", "vmcgrad.netket.QGTOnTheFly")


def test_bad_pytree_diag_shift_and_diag_scale():
    vs = _state("RBM[float64]")
    S = vnk.QGTOnTheFly(vs)
    neg = jax.tree.map(lambda p: -jnp.ones(p.shape), vs.parameters)
    with pytest.raises(ValueError, match=r"`diag_shift\[.*\]` must be finite and >= 0 in every entry"):
        S.replace(diag_shift=neg)
    imaginary = jax.tree.map(lambda p: 1j * jnp.ones(p.shape), vs.parameters)
    with pytest.raises(ValueError, match=r"`diag_shift\[.*\]` must be real; .* non-zero imaginary part"):
        S.replace(diag_shift=imaginary)
    wrong = jax.tree.map(lambda p: jnp.ones((*p.shape, 2)), vs.parameters)
    with pytest.raises(TypeError, match="must be a real array of the parameter's shape"):
        vnk.QGTOnTheFly(vs, diag_shift=wrong)
    for bad, err in ((-0.1, ValueError), (float("nan"), ValueError), ("x", TypeError), (True, TypeError)):
        with pytest.raises(err, match="`diag_scale`"):
            vnk.QGTOnTheFly(vs, diag_scale=bad)
    expected = np.asarray(nkqgt.QGTJacobianDense(vs).to_dense())
    np.testing.assert_allclose(  # None means 0, as NetKet; entries near 0 are sums that cancel,
        # so their rounding is relative to the matrix's scale, not to the entry
        vnk.QGTOnTheFly(vs, diag_shift=None).to_dense(),
        expected,
        rtol=1e-10,
        atol=1e-10 * np.abs(expected).max(),
    )


@pytest.mark.filterwarnings("ignore::netket.errors.HolomorphicUndeclaredWarning")  # NetKet's, mode=None
@pytest.mark.parametrize("mode", ["real", "complex", "holomorphic", "auto"])
def test_mode_matches_netkets_jacobian_dense(vstate, mode):
    """``mode=`` as NetKet's ``QGTJacobianDense(mode=...)`` ('real' on a complex output takes
    Re log psi, as NetKet's does; 'auto' is the default choice). Where NetKet computes something
    that is not the QGT (mode='holomorphic' on real parameters, 'real' on complex ones) vmcgrad
    refuses before tracing; 'complex' on a real-valued model (NetKet refuses) is 'real'."""
    rtol, atol = tols(vstate)
    real_params = not is_complex(vstate)
    if (mode == "holomorphic") == real_params and mode in ("real", "holomorphic"):
        with pytest.raises(ValueError, match=f"mode='{mode}'"):
            vnk.QGTOnTheFly(vstate, mode=mode, chunk_size=37, diag_shift=0.01)
        return
    real_output = not jnp.iscomplexobj(vstate.log_value(vstate.samples.reshape(-1, 5)[:2]))
    ref_mode = {"auto": None, "complex": "real" if real_output else "complex"}.get(mode, mode)
    ref = nkqgt.QGTJacobianDense(vstate, mode=ref_mode, diag_shift=0.01)
    S = vnk.QGTOnTheFly(vstate, mode=mode, chunk_size=37, diag_shift=0.01)
    np.testing.assert_allclose(S.to_dense(), ref.to_dense(), rtol=rtol, atol=atol)
    v = random_tree(vstate)
    assert_tree_allclose(S @ v, ref @ v, rtol=rtol, atol=atol)


def test_mode_and_holomorphic_are_exclusive():
    with pytest.raises(ValueError, match="pass `mode` or `holomorphic`, not both"):
        vnk.QGTOnTheFly(_state("RBM[complex128]"), mode="complex", holomorphic=True)


# --- the product's design and the memory budget (vmcgrad.QGT's `design` and `memory_budget`) ------

DESIGN_CASES = {  # model, holomorphic: the modes NetKet's QGTOnTheFly has
    "real": ("RBM[float64]", None),
    "real params, complex output": ("RBMModPhase[float64]", None),
    "holomorphic": ("RBM[complex128]", True),
}


@pytest.mark.quick_cover("design")
@pytest.mark.parametrize("design", ["fused", "jvp_vjp"])
@pytest.mark.parametrize("case", list(DESIGN_CASES))
def test_design_reaches_the_operator(case, design):
    """``design=`` is the wrapped operator's (static) design, at a fixed chunk and at ``"auto"`` (an
    explicit design is kept there), and ``S @ v`` equals NetKet's unchunked ``QGTOnTheFly``'s dense
    matrix times ``v`` to 1e-12 (float64) in either design."""
    model_name, holomorphic = DESIGN_CASES[case]
    vs = _state(model_name)
    kw = {"diag_shift": 0.01} if holomorphic is None else {"diag_shift": 0.01, "holomorphic": holomorphic}
    S = vnk.QGTOnTheFly(vs, chunk_size=37, design=design, **kw)
    assert S.qgt.design == design
    assert vnk.QGTOnTheFly(vs, chunk_size="auto", design=design, **kw).qgt.design == design
    v = random_tree(vs)
    expected = nkqgt.QGTOnTheFly(vs, **kw).to_dense() @ ravel_pytree(v)[0]
    np.testing.assert_allclose(ravel_pytree(S @ v)[0], expected, rtol=1e-12, atol=1e-12)


def _budget_state(memory_budget=None):
    """An RBM of 16 spins, 256 samples per device, chunk_size="auto": big enough for the designs' bytes
    per row to differ (the jvp-then-vjp program of all 256 rows is smaller than the fused one)."""
    hi = nk.hilbert.Spin(0.5, 16)
    vs = vnk.MCState(
        nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS),
        RBM(alpha=1, param_dtype=np.float64),
        n_samples=256 * N_DEV,
        seed=7,
        chunk_size="auto",
        memory_budget=memory_budget,
    )
    vs.sample()
    return vs


def test_the_qgt_phase_of_vmcgrad_vmc_is_what_sr_runs_and_fits_the_budget():
    """``vmcgrad vmc --driver sr`` runs ``nk.optimizer.SR`` on ``vmcgrad.netket.QGTOnTheFly(chunk_size=
    "auto", memory_budget=B)``: the operator's build (O-bar's pass, at its own automatic chunk) and
    NetKet's solver on it, one compiled program (``QGTOnTheFlyT._solve``: NetKet's CG, its vectors,
    the products). A GCNN (complex output, whose O-bar pass holds more per row than the product), B
    the product's bytes at chunk 8 (its automatic chunk then 8): the QGT phase the run logs
    (``cli._phases.bytes_of_phases``, the largest of those programs, compiled) is within B, and so is
    the solve as SR calls it (``jax.scipy.sparse.linalg.cg``, ``x0`` the previous solution), which
    solves as the dense QGT does. Red before: the phase measured one program that built the operator
    at the product's chunk and applied it, which the driver never runs, over B by its O-bar pass
    (120 816 bytes against 98 136; a 2-D GCNN at 16 MiB logged 24.4 MB, issue 48)."""
    from vmcgrad.cli import _phases
    from vmcgrad.netket._qgt import _solve

    hi = nk.hilbert.Spin(0.5, 8)
    model = nk.models.GCNN(symmetries=nk.graph.Chain(8), layers=2, features=4, param_dtype=np.float64)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS)
    vs = vnk.MCState(sampler, model, n_samples=64 * N_DEV, seed=7, chunk_size="auto")
    vs.sample()
    probe = vnk.QGTOnTheFly(vs, chunk_size=8, design="jvp_vjp").qgt
    budget = qgt_bytes(probe, "jvp_vjp", 8)
    S = vnk.QGTOnTheFly(vs, design="jvp_vjp", memory_budget=budget, diag_shift=0.01)
    assert S.qgt.chunk_size == 8 and S.qgt.kept_solve is None  # the product's chunk; nothing kept
    chunks = {"gradient": 8, "qgt": 8, "qgt_solve": None}  # as vmcgrad vmc's _chunk_sizes gives them
    phases = _phases.bytes_of_phases(vs, vs.n_samples, chunks, "jvp_vjp", budget, 0.01, None)
    assert phases["qgt"] <= budget, (phases, budget)
    g = vs.parameters
    cg = functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-12)
    held = vmcgrad.program_bytes(_solve.lower(S, jax.tree_util.Partial(cg), g, x0=g).compile())
    assert held <= budget, (held, budget)
    x, _ = S.solve(cg, g, x0=g)  # (its residual within 1e-12 of g's norm; S + 0.01 is well conditioned)
    dense = nkqgt.QGTOnTheFly(vs, diag_shift=0.01).to_dense()
    ref = jnp.linalg.solve(dense, ravel_pytree(g)[0])
    np.testing.assert_allclose(ravel_pytree(x)[0], ref, rtol=1e-8, atol=1e-10)


@pytest.mark.slow  # about 25 s: a budget search per state
def test_memory_budget_changes_the_pick():
    """A tight ``memory_budget`` (the jvp-then-vjp program of all rows fits, the fused one does not)
    changes the (design, chunk) pair from the loose budget's, to the pair ``vmcgrad.QGT(...,
    chunk_size="auto", memory_budget=...)`` picks on the same inputs; priced for a TPU (costly ops)
    the jvp-then-vjp design at all rows, one chunk. Without
    the argument the state's ``memory_budget`` is used; an explicit one overrides it."""
    from vmcgrad.netket import _nk_private as nkp
    from vmcgrad.netket._expect_grad import log_psi

    vs = _budget_state()
    flat = vs.samples.reshape(-1, vs.samples.shape[-1])
    logpsi = log_psi(nkp.apply_fun(vs), vs.model_state)

    def core_pick(budget):
        S = vmcgrad.QGT(logpsi, vs.parameters, flat, chunk_size="auto", memory_budget=budget)
        return S.design, S.chunk_size

    def pick(S):
        return S.qgt.design, S.qgt.chunk_size

    probe = vnk.QGTOnTheFly(vs, chunk_size=64).qgt
    n = probe.problem.n_local
    budget = qgt_bytes(probe, "jvp_vjp", n)
    assert qgt_bytes(probe, "fused", n) > budget, "jvp then vjp should hold less at all rows"
    assert pick(vnk.QGTOnTheFly(vs, memory_budget=2**34)) == ("fused", n)
    tight = pick(vnk.QGTOnTheFly(vs, memory_budget=budget))
    assert tight == core_pick(budget) != ("fused", n)
    on_state = _budget_state(memory_budget=budget)  # the state's budget is the default
    assert pick(vnk.QGTOnTheFly(on_state)) == tight
    assert pick(vnk.QGTOnTheFly(on_state, memory_budget=2**34)) == ("fused", n)

    with vmcgrad.cost_platform("tpu"):  # priced for an accelerator: its ops are costly
        costly = pick(vnk.QGTOnTheFly(vs, memory_budget=budget))
        assert costly == core_pick(budget) == ("jvp_vjp", n)
    S = vnk.QGTOnTheFly(vs, memory_budget=budget, diag_shift=0.01)
    np.testing.assert_allclose(  # the picked design's product, against NetKet's
        ravel_pytree(S @ vs.parameters)[0],
        nkqgt.QGTOnTheFly(vs, diag_shift=0.01).to_dense() @ ravel_pytree(vs.parameters)[0],
        rtol=1e-12,
        atol=1e-12,
    )


BAD_DESIGN_OR_BUDGET = {
    "unknown design": (
        {"design": "jvp"},
        ValueError,
        r"`design` must be one of \('fused', 'jvp_vjp', 'two_loop'\)",
    ),
    "design not a string": ({"design": 1}, ValueError, "`design` must be one of"),
    "zero budget": ({"memory_budget": 0}, ValueError, "`memory_budget` must be a positive number"),
    "nan budget": ({"memory_budget": float("nan")}, ValueError, "`memory_budget` must be a positive"),
    "string budget": ({"memory_budget": "1GB"}, TypeError, "`memory_budget` must be a positive number"),
    "bool budget": ({"memory_budget": True}, TypeError, "`memory_budget` must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD_DESIGN_OR_BUDGET))
def test_bad_design_or_memory_budget_refused_before_tracing(case, monkeypatch):
    """vmcgrad's errors, naming the adapter, before the core operator is built (nothing traced)."""
    kw, err, match = BAD_DESIGN_OR_BUDGET[case]
    vs = _state("RBM[float64]")

    def not_reached(*args, **kwargs):
        raise AssertionError("vmcgrad.QGT was called: the argument was not checked first")

    monkeypatch.setattr(vmcgrad, "QGT", not_reached)
    with pytest.raises(err, match=rf"^vmcgrad\.netket\.QGTOnTheFly: {match}"):
        vnk.QGTOnTheFly(vs, chunk_size="auto", **kw)
    with pytest.raises(err, match=match):
        vnk.QGTOnTheFly(**kw)(vs)  # the partial SR calls
