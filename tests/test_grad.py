"""expect_grad against independent dense references and NetKet: every dtype case, chunk, sharding."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_allclose,
    compile_count,
    make_case,
    random_like,
    setup,
    tols,
    traced_without_mesh,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N_DEV = jax.device_count()
N = 37 * N_DEV  # 37 samples per device: prime, so most chunk sizes leave a remainder
CHUNKS = [None, 1, 5, 37, 1000]  # one chunk, 1, a non-divisor, = per-device N, > N
multi = pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")


def c2r(p, x):
    """Complex parameters, real output (a non-holomorphic log-modulus)."""
    return jnp.sum(jnp.real(jnp.log(jnp.cosh(x @ p["W"]))), axis=-1)


def case(name, n=N, dtype=jnp.float64):
    if name == "c2r":
        _, params, samples = make_case("c2c_nonholo", n, dtype)
        return c2r, params, samples
    return make_case(name, n, dtype)


DTYPE_CASES = ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "c2r", "mixed"]
ALL_CASES = [*DTYPE_CASES, "layered", "pytree_samples"]


def local_values(n, dtype=jnp.complex128, seed=7):
    return random_like(jax.random.key(seed), (n,), dtype) + 3.0  # nonzero mean: the centring matters


# --- independent references -------------------------------------------------------------------


def reference_real_coordinates(fun, params, samples, lv):
    """∂E/∂x + i ∂E/∂y per complex leaf θ = x + iy, ∂E/∂x per real leaf, from explicit Jacobians.

    Every parameter is split into real coordinates r; O^r_i = ∂ logψ(σ_i)/∂r is a dense (N, ...)
    Jacobian (jax.jacfwd) and ∂E/∂r = 2 Re[(1/N) Σ_i conj(O^r_i) (L_i − L̄)]. No Wirtinger calculus
    and no knowledge of JAX's complex vjp convention enter.
    """
    leaves, tdef = jax.tree.flatten(params)
    coords = [(p.real, p.imag) if jnp.iscomplexobj(p) else (p,) for p in leaves]

    def f(coords):
        ps = [c[0] + 1j * c[1] if len(c) == 2 else c[0] for c in coords]
        return fun(jax.tree.unflatten(tdef, ps), samples).astype(jnp.complex128)

    jac = jax.jacfwd(f)(coords)
    dl = (lv - lv.mean()).astype(jnp.complex128)
    n = dl.shape[0]

    def de(j):  # ∂E/∂r
        return 2 * jnp.real(jnp.einsum("n...,n->...", jnp.conj(j), dl)) / n

    grads = [de(j[0]) + 1j * de(j[1]) if len(j) == 2 else de(j[0]) for j in jac]
    return jax.tree.unflatten(tdef, [g.astype(p.dtype) for g, p in zip(grads, leaves)])


def reference_formula(fun, params, samples, lv):
    """F = (1/N) Σ conj(O_i)(L_i − L̄) with O the explicit Jacobian; 2F / 2 Re F (force_to_grad).

    Defined where O is a single complex derivative: real parameters, or holomorphic complex ones.
    """
    complex_params = any(jnp.iscomplexobj(p) for p in jax.tree.leaves(params))
    g = lambda p: fun(p, samples)
    jac = jax.jacrev(g, holomorphic=True)(params) if complex_params else jax.jacfwd(g)(params)
    dl = lv - lv.mean()

    def grad(o, p):
        F = jnp.einsum("n...,n->...", jnp.conj(o), dl) / dl.shape[0]
        return (2 * F if jnp.iscomplexobj(p) else 2 * jnp.real(F)).astype(p.dtype)

    return jax.tree.map(grad, jac, params)


@pytest.fixture(scope="module")
def nk():
    """NetKet, imported so that its global mesh (set at import) does not leak into other tests."""
    with jax.set_mesh(None):
        import netket

    return netket


def reference_netket_vjp(nk, fun, params, samples, lv):
    """NetKet's unchunked force (forces_expect_hermitian): nk.jax.vjp(conjugate=True), force_to_grad."""
    from netket.vqs.mc.common import force_to_grad

    _, vjp_fun = nk.jax.vjp(lambda p: fun(p, samples), params, conjugate=True)
    (F,) = vjp_fun(jnp.conj(lv - lv.mean()) / lv.shape[0])
    return force_to_grad(F, params)


# --- numerics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_CASES)
def test_matches_dense_jacobian_reference(name):
    fun, params, samples = case(name)
    lv = local_values(N)
    expected = reference_real_coordinates(fun, params, samples, lv)
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["r2r", "r2c", "c2c_holo"])
def test_matches_the_formula_with_explicit_O(name):
    fun, params, samples = case(name)
    lv = local_values(N)
    expected = reference_formula(fun, params, samples, lv)
    assert_tree_allclose(
        reference_real_coordinates(fun, params, samples, lv), expected, rtol=1e-10, atol=1e-12
    )
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("name", ["r2c", "c2c_nonholo", "mixed"])
def test_chunk_sizes(name, chunk_size):
    fun, params, samples = case(name)
    lv = local_values(N)
    expected = reference_real_coordinates(fun, params, samples, lv)
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=chunk_size)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "mixed"])
def test_matches_netket_unchunked_force(nk, name):
    fun, params, samples = case(name)
    lv = local_values(N)
    with jax.set_mesh(None):
        expected = reference_netket_vjp(nk, fun, params, samples, lv)
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "model", ["RBMModPhase", "RBM_complex"], ids=["RBMModPhase(R->C)", "RBM(complex params)"]
)
def test_matches_netket_mcstate_expect_and_grad(nk, model):
    """The same samples and local energies as NetKet's MCState: its expect_and_grad, to 1e-10."""
    hi = nk.hilbert.Spin(0.5, 8)
    H = nk.operator.Ising(hi, nk.graph.Chain(8), h=0.7)
    if model == "RBMModPhase":
        net = nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64)
    else:
        net = nk.models.RBM(alpha=1, param_dtype=jnp.complex128)
    with setup("netket"):
        sampler = nk.sampler.MetropolisLocal(hi, n_chains=8 * N_DEV)
        vs = nk.vqs.MCState(sampler, net, n_samples=64 * N_DEV, seed=1, sampler_seed=2)
        vs.parameters = jax.tree.map(
            lambda p: p + 0.1 * random_like(jax.random.key(3), p.shape, p.dtype), vs.parameters
        )
        _, expected = vs.expect_and_grad(H)
        samples = vs.samples.reshape(-1, hi.size)
        lv = vs.local_estimators(H).reshape(-1)
        logpsi = jax.tree_util.Partial(
            lambda variables, w, x: vs._apply_fun({**variables, "params": w}, x), vs.model_state
        )
        got = vmcgrad.expect_grad(logpsi, vs.parameters, samples, lv, chunk_size=24)
        got_unchunked = vmcgrad.expect_grad(logpsi, vs.parameters, samples, lv)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-13)
    assert_tree_allclose(got_unchunked, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "mixed"])
def test_float32(name):
    fun, params, samples = case(name, dtype=jnp.float32)
    lv = local_values(N, jnp.complex64)
    expected = reference_real_coordinates(
        fun, *jax.tree.map(lambda a: a.astype(jnp.result_type(a.dtype, jnp.float64)), (params, samples)), lv
    )
    expected = jax.tree.map(lambda e, p: e.astype(p.dtype), expected, params)
    rtol, atol = tols(jnp.float32)
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "name, lv_dtype",
    [
        ("r2r", jnp.complex128),  # complex local values, real output: only Re L enters
        ("r2c", jnp.float64),  # real local values, complex output
        ("c2c_holo", jnp.float64),
        ("r2c", jnp.int32),  # integers are numbers too
        ("r2r", jnp.float32),  # lower precision than the output
    ],
)
def test_local_value_dtypes(name, lv_dtype):
    fun, params, samples = case(name)
    lv = local_values(N, jnp.complex128)
    if not jnp.issubdtype(lv_dtype, jnp.complexfloating):
        lv = jnp.round(lv.real * 5) if lv_dtype == jnp.int32 else lv.real
    lv = lv.astype(lv_dtype)
    expected = reference_real_coordinates(fun, params, samples, lv.astype(jnp.complex128))
    rtol, atol = tols(jnp.float32) if lv_dtype == jnp.float32 else (1e-10, 1e-12)
    with setup("netket") as place:
        got = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(got, expected, rtol=rtol, atol=atol)


# --- sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["netket", "explicit", "none"])
@pytest.mark.parametrize("name", ["r2c", "mixed"])
def test_sharding_setups(kind, jit, name):
    fun, params, samples = case(name)
    lv = local_values(N)
    expected = reference_real_coordinates(fun, params, samples, lv)
    grad = lambda p, x, lv: vmcgrad.expect_grad(fun, p, x, lv, chunk_size=5)
    unseen = traced_without_mesh() if jit and kind == "none" else contextlib.nullcontext()
    with setup(kind) as place, unseen:  # jitted with no mesh on several devices: vmcgrad's notice is due
        got = (jax.jit(grad) if jit else grad)(params, place(samples), place(lv))
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["r2c", "c2c_nonholo", "mixed"])
def test_all_devices_equal_one_device(name):
    """Guards the 'n_devices times too large' class of bug: the sharded result equals one device's."""
    fun, params, samples = case(name)
    lv = local_values(N)
    one = Mesh(np.array(jax.devices()[:1]), ("S",))
    on_one = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(one, P("S"))), (samples, lv))
    single = vmcgrad.expect_grad(fun, params, *on_one, chunk_size=5)
    with setup("netket") as place:
        sharded = vmcgrad.expect_grad(fun, params, place(samples), place(lv), chunk_size=5)
    assert_tree_allclose(sharded, single, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("n", [1, 3, N_DEV * 5 + 1])
def test_sample_counts_not_divisible_by_devices(n):
    """Padded samples carry no weight, and L̄ is the mean of the N real local values only."""
    fun, params, samples = case("r2c", n)
    lv = local_values(n)
    with setup("netket"):
        got = vmcgrad.expect_grad(fun, params, samples, lv, chunk_size=2)
    assert_tree_allclose(got, reference_real_coordinates(fun, params, samples, lv), rtol=1e-10, atol=1e-12)


# --- structure ----------------------------------------------------------------------------------

_SCALAR_ALL_REDUCE = re.compile(r"=\s*\w+\[\]\s+all-reduce\(")


@multi
@pytest.mark.parametrize("kind", ["netket", "explicit"])
@pytest.mark.parametrize("name", ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "mixed", "layered"])
def test_one_reduction_after_the_loop(kind, name):
    """Exactly: one scalar all-reduce (L̄) before the loop, one psum of the gradient after it.

    XLA splits the gradient's psum into one all-reduce per parameter dtype (the 'mixed' case:
    float64 and complex128), so the gradient accounts for n_dtypes all-reduce ops; none is in a loop.
    """
    fun, params, samples = case(name)
    n_dtypes = len({leaf.dtype for leaf in jax.tree.leaves(params)})
    with setup(kind) as place:
        samples, lv = place(samples), place(local_values(N))
        f = jax.jit(lambda p, x, lv: vmcgrad.expect_grad(fun, p, x, lv, chunk_size=5))
        compiled = f.lower(params, samples, lv).compile()
    report = vmcgrad.collective_report(compiled)
    assert report.total_in_loops == 0, report
    assert report.outside == {"all-reduce": 1 + n_dtypes}, report
    assert len(_SCALAR_ALL_REDUCE.findall(compiled.as_text())) == 1  # the mean of the local values


def test_no_collectives_without_a_mesh():
    fun, params, samples = case("mixed")
    f = jax.jit(lambda p, x, lv: vmcgrad.expect_grad(fun, p, x, lv, chunk_size=5))
    with traced_without_mesh():
        report = vmcgrad.collective_report(f.lower(params, samples, local_values(N)).compile())
    assert report.total_in_loops == 0 and report.total_outside == 0, report


def test_no_recompilation_on_second_call():
    fun, params, samples = case("r2c")
    params2 = jax.block_until_ready(jax.tree.map(lambda a: a + 1, params))
    with setup("netket") as place:
        samples, lv, lv2 = place(samples), place(local_values(N)), place(local_values(N, seed=8))
        jax.block_until_ready(vmcgrad.expect_grad(fun, params, samples, lv, chunk_size=5))
        before = compile_count()
        g2 = vmcgrad.expect_grad(fun, params2, samples, lv2, chunk_size=5)
        assert compile_count() == before
        user = jax.jit(lambda p, x, lv: vmcgrad.expect_grad(fun, p, x, lv, chunk_size=5))
        jax.block_until_ready(user(params, samples, lv))
        before = compile_count()
        jax.block_until_ready(user(params2, samples, lv2))
        assert compile_count() == before
    expected = reference_real_coordinates(fun, params2, *jax.device_get((samples, lv2)))
    assert_tree_allclose(g2, expected, rtol=1e-10, atol=1e-12)


def test_partial_logpsi_state_is_traced_not_compiled_in():
    def scaled(state, p, x):
        return state["scale"] * (jnp.tanh(x @ p["W"]).sum(-1) + 1j * jnp.sin(x @ p["W"]).sum(-1))

    _, params, samples = case("r2r")
    params = {"W": params["W"]}
    lv = local_values(N)
    states = [{"scale": jnp.float64(0.5)}, {"scale": jnp.float64(2.0)}]
    with setup("netket") as place:
        x, v = place(samples), place(lv)
        got = [vmcgrad.expect_grad(jax.tree_util.Partial(scaled, states[0]), params, x, v, chunk_size=5)]
        before = compile_count()
        got.append(vmcgrad.expect_grad(jax.tree_util.Partial(scaled, states[1]), params, x, v, chunk_size=5))
        assert compile_count() == before
    for g, s in zip(got, states):
        expected = reference_real_coordinates(jax.tree_util.Partial(scaled, s), params, samples, lv)
        assert_tree_allclose(g, expected, rtol=1e-10, atol=1e-12)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lv, error, text",
    [
        (jnp.ones(N - 1), ValueError, f"shape ({N},); got shape ({N - 1},)"),
        (jnp.ones((N, 1)), ValueError, f"shape ({N},); got shape ({N}, 1)"),
        (jnp.ones(N, bool), TypeError, "real or complex numeric array; got shape"),
        ({"e": jnp.ones(N)}, TypeError, "real or complex numeric array; got {'e'"),
    ],
)
def test_bad_local_values(lv, error, text):
    fun, params, samples = case("r2c")
    with pytest.raises(error, match=r"vmcgrad\.expect_grad: `local_values` must") as info:
        vmcgrad.expect_grad(fun, params, samples, lv)
    assert text in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_chunk_size(chunk_size, error):
    fun, params, samples = case("r2c")
    expected = r"vmcgrad\.expect_grad: `chunk_size` must be a positive int, None or .auto."
    with pytest.raises(error, match=expected):
        vmcgrad.expect_grad(fun, params, samples, local_values(N), chunk_size=chunk_size)


def test_bad_params_samples_and_output():
    fun, params, samples = case("r2c")
    lv = local_values(N)
    with pytest.raises(TypeError, match=r"expect_grad: every leaf of `params` must be a real or complex"):
        vmcgrad.expect_grad(fun, {**params, "W": params["W"].astype(jnp.int32)}, samples, lv)
    with pytest.raises(ValueError, match=r"expect_grad: `samples` is empty"):
        vmcgrad.expect_grad(fun, params, samples[:0], lv[:0])
    with pytest.raises(ValueError, match=r"expect_grad: `logpsi\(params, samples\)` must return one value"):
        vmcgrad.expect_grad(lambda p, x: fun(p, x).sum(), params, samples, lv)
