"""Bad input raises a clear TypeError/ValueError before tracing: argument, given, expected, fix."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, make_case, traced_without_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._problem.validation import check_memory_budget, describe

FUN, PARAMS, SAMPLES = make_case("r2c", 8)
CT = jnp.ones(8, jnp.complex128)
T = jax.tree.map(jnp.ones_like, PARAMS)


@pytest.mark.parametrize(
    "chunk_size, error, text",
    [
        (0, ValueError, "got 0"),
        (-3, ValueError, "got -3"),
        (2.5, TypeError, "got 2.5 of type float"),
        ("64", TypeError, "got '64' of type str"),
        (True, TypeError, "got True of type bool"),
    ],
)
@pytest.mark.parametrize("api", ["vjp", "jvp"])
def test_chunk_size(api, chunk_size, error, text):
    call = vmcgrad.batched_vjp if api == "vjp" else vmcgrad.batched_jvp
    arg = CT if api == "vjp" else T
    with pytest.raises(error, match=r"`chunk_size` must be a positive int, None or .auto.") as info:
        call(FUN, PARAMS, SAMPLES, arg, chunk_size=chunk_size)
    assert text in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize(
    "ct, text",
    [
        (jnp.ones(7, jnp.complex128), "got shape (7,)"),
        (jnp.ones((8, 1), jnp.complex128), "got shape (8, 1)"),
        (jnp.ones(8, jnp.float64), "dtype float64"),
        (jnp.ones(8, jnp.complex64), "dtype complex64"),
        ({"a": jnp.ones(8)}, "got {'a'"),
    ],
)
def test_cotangent(ct, text):
    with pytest.raises(TypeError, match=r"`cotangent` must match the output of `fun`, shape \(8,\)") as info:
        vmcgrad.batched_vjp(FUN, PARAMS, SAMPLES, ct)
    assert text in str(info.value) and "complex128" in str(info.value)


def test_tangent_tree():
    with pytest.raises(TypeError, match="`tangent` must have the pytree structure of `params`"):
        vmcgrad.batched_jvp(FUN, PARAMS, SAMPLES, {"W": T["W"]})


@pytest.mark.parametrize(
    "leaf, text",
    [
        (jnp.ones((6, 4)), "shape (6, 5) and dtype float64 of the parameter; got shape (6, 4)"),
        (jnp.ones((6, 5), jnp.float32), "got shape (6, 5) and dtype float32"),
    ],
)
def test_tangent_leaf(leaf, text):
    with pytest.raises(TypeError, match=r"the leaf of `tangent` at \['W'\]") as info:
        vmcgrad.batched_jvp(FUN, PARAMS, SAMPLES, {**T, "W": leaf})
    assert text in str(info.value)


def test_samples_with_different_leading_sizes():
    fun, params, samples = make_case("pytree_samples", 8)
    samples = {**samples, "y": samples["y"][:5]}
    with pytest.raises(ValueError, match=r"must share their leading \(sample\) size; got .*8.*5"):
        vmcgrad.batched_vjp(fun, params, samples, jnp.ones(8))


@pytest.mark.parametrize("api", ["vjp", "jvp"])
def test_no_samples(api):
    call, arg = (vmcgrad.batched_vjp, CT[:0]) if api == "vjp" else (vmcgrad.batched_jvp, T)
    with pytest.raises(ValueError, match=r"`samples` is empty \(N = 0"):
        call(FUN, PARAMS, SAMPLES[:0], arg)


def test_scalar_sample_leaf():
    with pytest.raises(ValueError, match="needs a leading sample axis"):
        vmcgrad.batched_vjp(FUN, PARAMS, jnp.float64(1.0), CT)


@pytest.mark.parametrize(
    "fun, text",
    [
        (lambda p, x: FUN(p, x).sum(), "it returned shape () and dtype complex128"),
        (lambda p, x: FUN(p, x)[:, None], "it returned shape (8, 1)"),
        (lambda p, x: (FUN(p, x), FUN(p, x)), "it returned a tuple"),
    ],
)
@pytest.mark.parametrize("api", ["vjp", "jvp"])
def test_fun_output_shape(api, fun, text):
    call, arg = (vmcgrad.batched_vjp, CT) if api == "vjp" else (vmcgrad.batched_jvp, T)
    with pytest.raises(
        ValueError, match=r"must return one value per sample, an array of shape \(8,\)"
    ) as info:
        call(fun, PARAMS, SAMPLES, arg)
    assert text in str(info.value)


def test_integer_params():
    with pytest.raises(TypeError, match=r"leaf at \['n'\] has dtype int"):
        vmcgrad.batched_vjp(lambda p, x: x.sum(-1) * p["n"], {"n": jnp.arange(3)}, SAMPLES, jnp.ones(8))


def test_errors_are_raised_before_tracing():
    """The checks run in Python before jit: under the user's jit the same clear error appears."""

    @jax.jit
    def user(params, samples):
        return vmcgrad.batched_vjp(FUN, params, samples, jnp.ones(7, jnp.complex128), chunk_size=2)

    with pytest.raises(TypeError, match="`cotangent` must match the output of `fun`"), traced_without_mesh():
        user(PARAMS, SAMPLES)


# --- every message abbreviates its input (describe) -------------------------------------------


@pytest.mark.parametrize(
    "x, text",
    [
        ([0.5] * 10**5, "a list of 100000 elements [0.5, 0.5, 0.5, ...]"),
        (tuple(range(4)), "a tuple of 4 elements (0, 1, 2, ...)"),
        ({f"k{i}": jnp.ones(3) for i in range(9)}, "{'k0': float64[3], 'k1': float64[3], 'k2': f"),
        (jnp.zeros(10**6), "shape (1000000,) and dtype float64 (jax.Array)"),
        (np.zeros((2, 3), np.float32), "shape (2, 3) and dtype float32 (numpy.ndarray)"),
        (np.float32(-0.5), "-0.5 (numpy.float32)"),
        ("x" * 10**4, "xxx... (str)"),
        (3, "3 (int)"),
    ],
)
def test_describe_is_short(x, text):
    out = describe(x)
    assert text in out and len(out) < 120, out


def test_long_list_cotangent_is_abbreviated():
    with pytest.raises(TypeError, match="`cotangent` must match the output of `fun`") as info:
        vmcgrad.batched_vjp(FUN, PARAMS, SAMPLES, [0.5 + 0j] * 8)
    message = str(info.value)
    assert "got a list of 8 elements [0.5j, 0.5j, 0.5j, ...]" in message.replace("(0.5+0j)", "0.5j")
    assert "Fix: pass one complex128 value per sample, e.g. jnp.asarray(v, complex128)" in message
    with pytest.raises(TypeError) as info:
        vmcgrad.batched_vjp(FUN, PARAMS, SAMPLES, [0.5] * 10**5)
    assert len(str(info.value)) < 400 and "a list of 100000 elements" in str(info.value)
    # the fix the message suggests works
    out = vmcgrad.batched_vjp(FUN, PARAMS, SAMPLES, jnp.asarray([0.5 + 0j] * 8, jnp.complex128))
    assert jax.tree.structure(out) == jax.tree.structure(PARAMS)


# --- fun: callable, floating output ------------------------------------------------------------

E_LOC = jnp.linspace(0.0, 1.0, 8)


def entry_points(fun, samples=SAMPLES):
    """Each public entry point called with ``fun`` (the 4th argument matched to the output dtype)."""
    return {
        "batched_vjp": lambda: vmcgrad.batched_vjp(fun, PARAMS, samples, CT),
        "batched_jvp": lambda: vmcgrad.batched_jvp(fun, PARAMS, samples, T),
        "expect_grad": lambda: vmcgrad.expect_grad(fun, PARAMS, samples, E_LOC),
        "QGT": lambda: vmcgrad.QGT(fun, PARAMS, samples),
        "auto_chunk_size": lambda: vmcgrad.auto_chunk_size(fun, PARAMS, samples),
    }


@pytest.mark.parametrize("api", ["batched_vjp", "batched_jvp", "expect_grad", "QGT", "auto_chunk_size"])
@pytest.mark.parametrize("fun", [3, "fun", None], ids=["int", "str", "None"])
def test_fun_not_callable(api, fun):
    arg = "logpsi" if api in ("expect_grad", "QGT") else "fun"
    with pytest.raises(TypeError, match=f"vmcgrad.{api}: `{arg}` must be a function") as info:
        entry_points(fun)[api]()
    assert f"got {describe(fun)}, which is not callable" in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize("api", ["batched_vjp", "batched_jvp", "expect_grad", "QGT", "auto_chunk_size"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_], ids=["int32", "bool"])
def test_integer_valued_fun_refused(api, dtype):
    """It was told to pass an int cotangent, which then returned zeros."""
    fun = lambda p, x: (FUN(p, x).real > 0).astype(dtype)
    arg = "logpsi" if api in ("expect_grad", "QGT") else "fun"
    with pytest.raises(TypeError, match=rf"`{arg}\(params, samples\)` must return floating values") as info:
        entry_points(fun)[api]()
    assert f"it returned dtype {jnp.dtype(dtype)}" in str(info.value) and "Fix:" in str(info.value)
    if api == "batched_vjp":  # an integer cotangent does not get through either
        with pytest.raises(TypeError, match="must return floating values"):
            vmcgrad.batched_vjp(fun, PARAMS, SAMPLES, jnp.ones(8, dtype))


# --- memory_budget -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget", [2**30, np.int64(2**30), float(2**30), np.float64(2**30), np.float32(2**30), jnp.asarray(2**30)]
)
def test_memory_budget_any_positive_real(budget):
    assert check_memory_budget("f", budget) == 2**30 and type(check_memory_budget("f", budget)) is int
    fun, params, samples = make_case("r2r", 64)
    assert vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=budget) == vmcgrad.auto_chunk_size(
        fun, params, samples, memory_budget=2**30
    )


def test_memory_budget_fractional_and_1e9():
    assert check_memory_budget("f", 1e9) == 10**9 and check_memory_budget("f", 1.5) == 1.5
    assert check_memory_budget("f", None) is None
    fun, params, samples = make_case("r2r", 64)
    c = vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=1e9)
    assert c & (c - 1) == 0


@pytest.mark.parametrize(
    "budget, error, text",
    [
        (True, TypeError, "got True (bool)"),
        (False, TypeError, "got False (bool)"),
        (np.bool_(True), TypeError, "got True (numpy.bool)"),
        ("1e9", TypeError, "got '1e9' (str)"),
        ([2**30], TypeError, "got a list of 1 element"),
        (jnp.ones(2), TypeError, "got shape (2,)"),
        (1j, TypeError, "got 1j (complex)"),
        (float("nan"), ValueError, "got nan (float)"),
        (float("inf"), ValueError, "got inf (float)"),
        (0, ValueError, "got 0 (int)"),
        (-1.0, ValueError, "got -1.0 (float)"),
        (np.int64(-5), ValueError, "got -5 (numpy.int64)"),
    ],
)
def test_memory_budget_refused(budget, error, text):
    message = r"vmcgrad\.auto_chunk_size: `memory_budget` must be a positive number of bytes"
    with pytest.raises(error, match=message) as info:
        vmcgrad.auto_chunk_size(FUN, PARAMS, SAMPLES, memory_budget=budget)
    assert text in str(info.value) and "Fix: pass e.g. memory_budget=2**30" in str(info.value)


# --- samples sharded under the user's jit with no mesh visible -------------------------------

multi = pytest.mark.skipif(jax.device_count() == 1, reason="needs more than one device")
SHARDING_WARNING = "cannot tell whether they are split over devices"
APIS = ["batched_vjp", "batched_jvp", "expect_grad", "QGT"]


def _jitted(api):
    calls = {
        "batched_vjp": lambda x: vmcgrad.batched_vjp(FUN, PARAMS, x, CT_N(x)),
        "batched_jvp": lambda x: vmcgrad.batched_jvp(FUN, PARAMS, x, T),
        "expect_grad": lambda x: vmcgrad.expect_grad(FUN, PARAMS, x, jnp.ones(x.shape[0])),
        "QGT": lambda x: vmcgrad.QGT(FUN, PARAMS, x, chunk_size=2) @ T,
    }
    return calls[api]


def CT_N(x):
    return jnp.ones(x.shape[0], jnp.complex128)


def _sharded_samples(axis_type):
    mesh = jax.make_mesh((jax.device_count(),), ("S",), axis_types=(axis_type,))
    _, _, x = make_case("r2c", 4 * jax.device_count())
    return mesh, jax.device_put(x, NamedSharding(mesh, P("S")))


def _vmcgrad_warnings(record):
    return [w for w in record if SHARDING_WARNING in str(w.message)]


@multi
@pytest.mark.parametrize("api", APIS)
def test_auto_sharded_samples_traced_without_mesh_are_split_over_their_mesh(api):
    """Under the user's jit with no context mesh, the Auto mesh in the samples' type is the sample
    mesh: no warning, the same result as under ``jax.set_mesh``, and the samples split (a reduction
    after the loop, none in it)."""
    mesh, x = _sharded_samples(AxisType.Auto)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = jax.jit(_jitted(api))(x)
        report = vmcgrad.collective_report(jax.jit(_jitted(api)).lower(x).compile())
    assert not _vmcgrad_warnings(record)
    with jax.set_mesh(mesh):
        expected = jax.jit(_jitted(api))(x)
    assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-13)
    assert report.total_in_loops == 0, report
    if api != "batched_jvp":  # per-sample output: nothing to reduce
        assert report.outside["all-reduce"] >= 1, report


@multi
def test_no_warning_when_the_split_is_visible():
    """(Explicit-axis samples with no context mesh are not tried: on jax 0.10.2 vmcgrad's own
    replicate/reshard raises 'Using PartitionSpec when you are not under a mesh context', eagerly and
    under jit, before and after this change. Nor ``jax.device_put(x_auto, one_device)``: its type
    keeps the 4-device Auto mesh of ``x_auto`` on jax 0.10.2, so it is warned about.)"""
    _, x_auto = _sharded_samples(AxisType.Auto)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _jitted("batched_vjp")(x_auto)  # eager: the concrete sharding is read
        jax.jit(_jitted("batched_vjp"))(jax.device_put(np.asarray(x_auto), jax.devices()[0]))  # one device
    assert not [str(w.message) for w in record if "on a mesh" in str(w.message)]


@multi
def test_warns_once_per_call_site_when_no_sharding_is_visible():
    """jit(in_shardings=...) over a plain array: the type shows no mesh at all; warned (the text says
    why), once for one call site even when traced twice."""
    mesh, x = _sharded_samples(AxisType.Auto)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for _ in range(2):
            f = jax.jit(_jitted("batched_vjp"), in_shardings=NamedSharding(mesh, P("S")))
            f(np.asarray(x))
    (w,) = _vmcgrad_warnings(record)
    assert "no sharding visible in their type" in str(w.message)


# --- errors with vmcgrad's context (issue 19 item 6) ---------------------------------------------


def hard_coded_batch(w, x):
    """A fun written for all N=10 samples at once: fails on a chunk."""
    return jnp.tanh(jnp.reshape(x, (10, 3)) @ w)


@pytest.mark.parametrize("api", ["batched_vjp", "batched_jvp", "expect_grad", "QGT"])
def test_fun_error_on_a_chunk_carries_vmcgrad_context(api):
    """Before: JAX's bare "cannot reshape array of shape (4, 3)"; nothing said fun sees chunks."""
    w, x, ct = jnp.ones(3) / 4, jnp.cos(jnp.arange(30.0)).reshape(10, 3), jnp.ones(10)
    calls = {
        "batched_vjp": lambda: vmcgrad.batched_vjp(hard_coded_batch, w, x, ct, chunk_size=4),
        "batched_jvp": lambda: vmcgrad.batched_jvp(hard_coded_batch, w, x, w, chunk_size=4),
        "expect_grad": lambda: vmcgrad.expect_grad(hard_coded_batch, w, x, ct, chunk_size=4),
        "QGT": lambda: vmcgrad.QGT(hard_coded_batch, w, x, chunk_size=4) @ w,
    }
    with pytest.raises(TypeError, match=r"cannot reshape array of shape \(4, 3\)") as info:
        calls[api]()
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert f"vmcgrad.{api}: the error above was raised by `fun`" in note
    assert "x of shape (4, 3)" in note and "chunks of 4 rows" in note
    assert "chunk_size=4" in note and "N=10" in note
    assert "Fix: write fun for any number of rows" in note


@multi
@pytest.mark.parametrize("api", ["batched_vjp", "expect_grad"])
def test_per_sample_argument_on_another_device_order(api):
    """Before: JAX's "Received incompatible devices for jitted computation"."""
    fun = lambda w, x: jnp.tanh(x @ w)
    w, x = jnp.ones(3) / 4, jnp.cos(jnp.arange(48.0)).reshape(16, 3)
    ct = jnp.linspace(-1.0, 1.0, 16)
    a = jax.sharding.Mesh(np.array(jax.devices()), ("S",))
    b = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("S",))
    xs, cts = jax.device_put(x, NamedSharding(a, P("S"))), jax.device_put(ct, NamedSharding(b, P("S")))
    call = getattr(vmcgrad, api)
    arg = "cotangent" if api == "batched_vjp" else "local_values"
    with pytest.raises(ValueError, match=rf"vmcgrad.{api}: `{arg}` must be on the devices of the samples'"):
        call(fun, w, xs, cts, chunk_size=3)
    got = call(fun, w, xs, jax.device_put(cts, xs.sharding), chunk_size=3)  # the advice, followed
    assert_tree_allclose(got, call(fun, w, x, ct, chunk_size=3), rtol=1e-13, atol=1e-14)


def test_netket_mcstate_auto_memory_budget_advice_is_followable():
    """Before: MCState's "auto" MemoryError advised ``memory_budget=``, which MCState did not take
    (a TypeError from nk.vqs.MCState). Now it takes it; following the advice gives NetKet's numbers."""
    import re

    with jax.set_mesh(None):  # NetKet's import sets a global mesh
        import netket as nk

        import vmcgrad.netket as vnk

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        g = nk.graph.Chain(6, pbc=True)
        hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
        H = nk.operator.Heisenberg(hi, g)
        sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=2 * jax.device_count())
        model = nk.models.RBM(alpha=1, param_dtype=jnp.float64)
        kw = {"n_samples": 32 * jax.device_count(), "seed": 0, "sampler_seed": 1}
        advice = r"vmcgrad.netket.MCState\(\.\.\., chunk_size='auto', memory_budget=(\d+)\)"
        with pytest.raises(MemoryError, match=advice) as info:
            vnk.MCState(sampler, model, chunk_size="auto", memory_budget=1000, **kw).expect_and_grad(H)
        budget = int(re.search(advice, str(info.value)).group(1))
        vs = vnk.MCState(sampler, model, chunk_size="auto", memory_budget=budget, **kw)
        assert vs.vmcgrad_memory_budget == budget
        stats, grad = vs.expect_and_grad(H)
        ref = nk.vqs.MCState(sampler, model, **kw)
        ref_stats, ref_grad = ref.expect_and_grad(H)
        np.testing.assert_allclose(stats.mean, ref_stats.mean, rtol=1e-10)
        assert_tree_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match=r"vmcgrad.netket.MCState: `memory_budget` must be a positive"):
            vnk.MCState(sampler, model, chunk_size="auto", memory_budget=-1, **kw)
