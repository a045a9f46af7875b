"""One problem, one runner: every feature holds for every estimator.

Parameter-sharded (FSDP-like) leaves, ``chunk_size="auto"`` with its out-of-memory halving, the
memory budget, the row-weight rule and the accumulation precision are each tested here for
``batched_vjp``, ``batched_jvp``, ``expect_grad`` and ``QGT`` (products, ``diagonal``, ``to_dense``,
``solve``), against the replicated / fixed-chunk / plain-JAX result.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, explicit_mesh, make_case
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._chunks.plan import Chunks, plan_chunks

N_DEV = jax.device_count()
N = 37 * N_DEV + 3  # not divisible by the devices: padded rows must get weight 0
multi = pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")


def wide_case(n=N):
    """R→C model whose parameter leaves divide over the devices (4·H hidden units)."""
    fun, params, samples = make_case("r2c", n)
    params = {"W": jnp.tile(params["W"], (1, 4)) / 2, "phase": jnp.tile(params["phase"], (4, 1)) / 2}
    ct = (jnp.linspace(-1.0, 1.0, n) + 1j * jnp.cos(jnp.arange(n))).astype(jnp.complex128)
    return fun, params, samples, ct


FSDP_SPECS = {"W": P(None, "S"), "phase": P("S")}


def shard_params(mesh, params):
    return {k: jax.device_put(v, NamedSharding(mesh, FSDP_SPECS[k])) for k, v in params.items()}


def netket_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))


def estimators(fun, params, samples, ct, chunk_size=5, **kw):
    """Every estimator's result on these inputs, by name."""
    tangent = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), params)
    S = vmcgrad.QGT(fun, params, samples, chunk_size=chunk_size, diag_shift=0.1, diag_scale=0.01, **kw)
    return {
        "batched_vjp": vmcgrad.batched_vjp(fun, params, samples, ct, chunk_size=chunk_size, **kw),
        "batched_jvp": vmcgrad.batched_jvp(fun, params, samples, tangent, chunk_size=chunk_size, **kw),
        "expect_grad": vmcgrad.expect_grad(fun, params, samples, ct, chunk_size=chunk_size, **kw),
        "QGT @": S @ tangent,
        "QGT.diagonal": S.diagonal(),
        "QGT.to_dense": S.to_dense(),
        "QGT.solve": S.solve(tangent, tol=1e-12)[0],
    }


# --- parameter-sharded leaves ------------------------------------------------------------------


def test_parameter_sharded_equals_replicated_for_every_estimator():
    fun, params, samples, ct = wide_case()
    mesh = netket_mesh()
    with jax.set_mesh(mesh):  # samples split over the context mesh, padded to the device count
        expected = estimators(fun, params, samples, ct)
        got = estimators(fun, shard_params(mesh, params), samples, ct)
    for name in expected:
        assert_tree_allclose(got[name], expected[name], rtol=1e-10, atol=1e-12)
    if N_DEV > 1:  # parameter-shaped results come back sharded like the parameters
        for name in ("batched_vjp", "expect_grad", "QGT @", "QGT.solve"):
            assert got[name]["W"].sharding.spec == P(None, "S"), name
            assert got[name]["phase"].sharding.spec == P("S"), name


@pytest.mark.quick_cover("name")
@multi
@pytest.mark.parametrize("name", ["batched_vjp", "batched_jvp", "expect_grad", "QGT @", "QGT.solve"])
def test_parameter_sharded_hlo_gathers_once_before_and_reduce_scatters_after_the_loop(name):
    """All-gathers of the two split leaves before the chunk loop, reduce-scatters after it (for the
    parameter-shaped results), nothing in the chunk loop. Explicit mesh: the layout is in the types,
    so the user's jit sees it."""
    fun, params, samples, ct = wide_case(37 * N_DEV)
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        p_sh = {k: jax.sharding.reshard(v, FSDP_SPECS[k]) for k, v in params.items()}
        x, c = (jax.sharding.reshard(a, P("S")) for a in (samples, ct))
        t = jax.tree.map(jnp.ones_like, p_sh)
        programs = {
            "batched_vjp": lambda p, x, c, t: vmcgrad.batched_vjp(fun, p, x, c, chunk_size=5),
            "batched_jvp": lambda p, x, c, t: vmcgrad.batched_jvp(fun, p, x, t, chunk_size=5),
            "expect_grad": lambda p, x, c, t: vmcgrad.expect_grad(fun, p, x, c, chunk_size=5),
            "QGT @": lambda p, x, c, t: vmcgrad.QGT(fun, p, x, chunk_size=5, diag_shift=0.1) @ t,
            "QGT.solve": lambda p, x, c, t: vmcgrad.QGT(fun, p, x, chunk_size=5, diag_shift=0.1).solve(
                t, maxiter=3
            )[0],
        }
        compiled = jax.jit(programs[name]).lower(p_sh, x, c, t).compile()
    report = vmcgrad.collective_report(compiled)
    if name == "QGT.solve":  # the CG loop holds one product per iteration: its collectives
        assert report.in_loops["all-gather"] == 2 and report.in_loops["reduce-scatter"] == 2, report
        return
    assert report.total_in_loops == 0, report
    assert report.outside["all-gather"] >= 2, report
    if name != "batched_jvp":  # per-sample output: no reduction at all
        assert report.outside["reduce-scatter"] >= 2, report
    assert "all-gather" not in report.in_loops


# --- chunk_size="auto": one rule, OOM halving, memory_budget everywhere -------------------------


def oom_above(limit, fun):
    """``fun`` whose compiled program fails at run time like an out-of-memory error when run on a
    batch larger than ``limit`` (a host callback: one device, no mesh)."""

    def raise_if_big(size):
        if size > limit:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")

    def wrapped(p, x):
        jax.debug.callback(raise_if_big, x.shape[0])
        return fun(p, x)

    return wrapped


def one_estimator(name, fun, params, samples, ct, **kw):
    tangent = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), params)
    if name.startswith("QGT"):
        S = vmcgrad.QGT(fun, params, samples, diag_shift=0.1, **kw)
        return S @ tangent if name == "QGT @" else S.solve(tangent, tol=1e-12)[0]
    arg = tangent if name == "batched_jvp" else ct
    return getattr(vmcgrad, name)(fun, params, samples, arg, **kw)


@pytest.mark.quick_cover("name")
@pytest.mark.parametrize("name", ["batched_vjp", "batched_jvp", "expect_grad", "QGT @", "QGT.solve"])
def test_auto_chunk_halves_once_after_out_of_memory_in_every_estimator(name):
    """16 samples, a budget that fits them all: "auto" picks 16, the run fails, 8 is retried and works.

    The QGT's construction (its Ō pass) and its product each retry; ``diagonal``/``to_dense`` go
    through the same :func:`vmcgrad._problem.problem.call` (their per-row Jacobian hides the chunk from a
    callback, so they are not simulated here)."""
    base, params, samples = make_case("r2c", 16)
    fun = oom_above(8, base)
    ct = (jnp.linspace(-1.0, 1.0, 16) + 0.5j).astype(jnp.complex128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = one_estimator(name, fun, params, samples, ct, chunk_size="auto", memory_budget=2**40)
    expected = one_estimator(name, base, params, samples, ct, chunk_size=None)
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    retried = [
        t for t in texts if "out of memory at chunk_size=16" in t and "retrying once with chunk_size=8" in t
    ]
    assert len(retried) == (2 if name.startswith("QGT") else 1), texts


@pytest.mark.heavy
def test_memory_budget_is_accepted_by_every_entry_point():
    fun, params, samples = make_case("r2c", N)
    ct = jnp.ones(N, jnp.complex128)
    budget = np.int64(2**30)  # numpy integers and floats are byte counts too
    expected = estimators(fun, params, samples, ct, chunk_size=None)
    got = estimators(fun, params, samples, ct, chunk_size="auto", memory_budget=budget)
    for name in expected:
        assert_tree_allclose(got[name], expected[name], rtol=1e-10, atol=1e-12)
    got = vmcgrad.expect_grad(fun, params, samples, ct, chunk_size="auto", memory_budget=1e9)  # a float
    assert_tree_allclose(got, expected["expect_grad"], rtol=1e-10, atol=1e-12)
    for bad in (True, -1, 0, float("nan"), float("inf"), "1GB"):
        with pytest.raises(
            (TypeError, ValueError), match="`memory_budget` must be a positive number of bytes"
        ):
            vmcgrad.expect_grad(fun, params, samples, ct, chunk_size="auto", memory_budget=bad)


@pytest.mark.quick_cover("name")
@pytest.mark.parametrize("name", ["batched_vjp", "expect_grad", "QGT"])
def test_memory_error_suggests_a_fix_that_works(name):
    fun, params, samples = make_case("r2c", N)
    ct = jnp.ones(N, jnp.complex128)
    calls = {
        "batched_vjp": lambda b: vmcgrad.batched_vjp(
            fun, params, samples, ct, chunk_size="auto", memory_budget=b
        ),
        "expect_grad": lambda b: vmcgrad.expect_grad(
            fun, params, samples, ct, chunk_size="auto", memory_budget=b
        ),
        "QGT": lambda b: vmcgrad.QGT(fun, params, samples, chunk_size="auto", memory_budget=b) @ params,
    }
    with pytest.raises(MemoryError, match=f"vmcgrad.{name}") as err:
        calls[name](10)
    suggested = int(re.search(r"memory_budget=(\d+)", str(err.value)).group(1))
    calls[name](suggested)  # the fix the message names works


def test_auto_chunk_size_sizes_every_estimator():
    fun, params, samples = make_case("r2c", 512)
    for estimator in ("batched_vjp", "batched_jvp", "expect_grad", "QGT"):
        big = vmcgrad.auto_chunk_size(fun, params, samples, estimator=estimator, memory_budget=2**40)
        assert big == 512, estimator
        program = {
            "batched_vjp": vmcgrad.batched_vjp,
            "batched_jvp": vmcgrad.batched_jvp,
            "expect_grad": vmcgrad.expect_grad,
        }.get(estimator)
        if program is None:
            continue
        arg = params if estimator == "batched_jvp" else jnp.ones(512, jnp.complex128)
        b64 = vmcgrad.program_bytes(
            vmcgrad.lower(program, fun, params, samples, arg, chunk_size=64).compile()
        )
        b128 = vmcgrad.program_bytes(
            vmcgrad.lower(program, fun, params, samples, arg, chunk_size=128).compile()
        )
        if b64 < b128:  # the budget between them picks 64
            got = vmcgrad.auto_chunk_size(
                fun, params, samples, estimator=estimator, memory_budget=(b64 + b128) // 2
            )
            assert got == 64, estimator
    with pytest.raises(ValueError, match="`estimator` must be one of"):
        vmcgrad.auto_chunk_size(fun, params, samples, estimator="vjp")


# --- the one rule for which rows count -----------------------------------------------------------


def test_row_weights_zero_padded_and_already_covered_rows():
    """10 local rows in chunks of at most 4 (3 chunks of 4; the last shifted back to rows 6..9), on a
    device whose rows 8 and 9 are padding (N = first + 8)."""
    chunks = Chunks(plan_chunks(10, 4), first=20, n_total=28)
    rows = jnp.arange(10)
    seen = []
    for k in range(chunks.plan.count):
        x, w = chunks.take(jnp.int32(k), rows)
        seen.append((list(np.asarray(x)), list(np.asarray(w))))
    assert seen == [
        ([0, 1, 2, 3], [1, 1, 1, 1]),
        ([4, 5, 6, 7], [1, 1, 1, 1]),
        ([6, 7, 8, 9], [0, 0, 0, 0]),  # 6, 7 covered by chunk 1; 8, 9 are padding
    ]


@pytest.mark.parametrize("chunk_size", [1, 4, 7, None])
def test_every_real_row_counts_once_whatever_the_padding(chunk_size):
    """A function that counts rows: its vjp with a unit cotangent is exactly N."""
    x = jnp.ones((N, 2))
    count = vmcgrad.batched_vjp(
        lambda p, x: p * x[:, 0], jnp.float64(1.0), x, jnp.ones(N), chunk_size=chunk_size
    )
    assert float(count) == N
    mesh = netket_mesh()
    with jax.set_mesh(mesh):  # padded to the device count inside
        count = vmcgrad.batched_vjp(
            lambda p, x: p * x[:, 0], jnp.float64(1.0), x, jnp.ones(N), chunk_size=chunk_size
        )
    assert float(count) == N


# --- accumulation precision ---------------------------------------------------------------------


def _bf16_case(n, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (n, 8), jnp.float32)
    w = (jax.random.normal(k2, (8, 4), jnp.float32) / 4).astype(dtype)
    ct = jax.random.normal(k3, (n,), jnp.float32)
    fun = lambda w, x: jnp.sum(jnp.tanh(x.astype(w.dtype) @ w), -1)
    return fun, w, x, ct


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunk_size", [16, 64, 1024])
def test_low_precision_parameters_accumulate_in_float32(dtype, chunk_size):
    """Error against an exact (float64) reference within 2x of the plain jax.vjp at the same dtype."""
    n = 16384
    fun, w, x, ct = _bf16_case(n, dtype)
    exact = jax.vjp(lambda w: fun(w, x), w.astype(jnp.float64))[1](ct.astype(jnp.float64))[0]
    ct_low = ct.astype(dtype)
    plain = jax.vjp(lambda w: fun(w, x), w)[1](ct_low)[0]
    ours = vmcgrad.batched_vjp(fun, w, x, ct_low, chunk_size=chunk_size)
    assert ours.dtype == w.dtype  # cast back to the parameters' dtype
    err = lambda g: float(jnp.linalg.norm(g.astype(jnp.float64) - exact) / jnp.linalg.norm(exact))
    assert err(ours) <= 2 * err(plain) + 1e-12, (err(ours), err(plain))


def test_float32_large_n_is_at_least_as_accurate_as_plain_jax():
    n = 2**20
    fun, w, x, ct = _bf16_case(n, jnp.float32)
    exact = jax.vjp(lambda w: fun(w, x), w.astype(jnp.float64))[1](ct.astype(jnp.float64))[0]
    plain = jax.vjp(lambda w: fun(w, x), w)[1](ct)[0]
    ours = vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4096)
    err = lambda g: float(jnp.linalg.norm(g.astype(jnp.float64) - exact) / jnp.linalg.norm(exact))
    assert err(ours) <= err(plain) * 1.01 + 1e-9, (err(ours), err(plain))


def test_qgt_and_grad_low_precision_results_keep_the_parameter_dtype():
    fun, w, x, ct = _bf16_case(256, jnp.bfloat16)
    g = vmcgrad.expect_grad(fun, w, x, ct, chunk_size=16)
    S = vmcgrad.QGT(fun, w, x, chunk_size=16, diag_shift=0.1)
    assert g.dtype == jnp.bfloat16 and (S @ w).dtype == jnp.bfloat16
    ref = (
        2
        * jax.vjp(lambda w: fun(w, x), w.astype(jnp.float64))[1]((ct - ct.mean()).astype(jnp.float64) / 256)[
            0
        ]
    )
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(ref), rtol=3e-2, atol=3e-3)


# --- models that branch on data ----------------------------------------------------------------


def branching(p, x):
    """A data-dependent ``lax.cond`` with a constant branch (as equinox's runtime checks in NetKet's
    ``LogStateVector`` do): inside a typed ``shard_map`` the branches' types differ (constant vs
    device-varying) and JAX refuses the cond."""
    y = jax.lax.cond(jnp.any(x > 100.0), lambda: jnp.zeros(x.shape, x.dtype), lambda: x)
    return jnp.sum(jnp.tanh(y @ p["W"] + p["b"]), -1)


@pytest.mark.parametrize("mesh_kind", ["netket", "none"])
def test_models_that_branch_on_data_run_in_every_estimator(mesh_kind):
    _, params, samples = make_case("r2r", N)
    ct = jnp.cos(jnp.arange(N, dtype=jnp.float64))
    t = jax.tree.map(jnp.ones_like, params)
    plain = jax.vjp(lambda p: branching(p, samples), params)[1](ct)[0]
    plain_jvp = jax.jvp(lambda p: branching(p, samples), (params,), (t,))[1]
    jac = jax.jacrev(lambda p: branching(p, samples))(params)
    jac = jnp.concatenate([jac["W"].reshape(N, -1), jac["b"]], axis=1)  # ravel order of {"W", "b"}
    dO = jac - jac.mean(0)
    S_ref = dO.T @ dO / N
    mesh = netket_mesh() if mesh_kind == "netket" else None
    with jax.set_mesh(mesh):
        got = vmcgrad.batched_vjp(branching, params, samples, ct, chunk_size=5)
        got_jvp = vmcgrad.batched_jvp(branching, params, samples, t, chunk_size=5)
        S = vmcgrad.QGT(branching, params, samples, chunk_size=5)
        dense = S.to_dense()
    assert_tree_allclose(got, plain, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(got_jvp, plain_jvp, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(dense, S_ref, rtol=1e-10, atol=1e-12)


# --- the validation cache: once per input signature, never stale, bounded --------------------------


def _counting_checks(monkeypatch):
    from vmcgrad._problem import problem as _problem
    from vmcgrad._problem import validation as check

    calls = []
    real = check.check_problem

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "check_problem", counted)
    monkeypatch.setattr(_problem, "_CHECKED", type(_problem._CHECKED)())
    return calls


def test_problem_validates_once_per_input_signature(monkeypatch):
    """A second call with new values of the same shapes, dtypes and shardings reuses the checks
    (a driver's every step); any change in the signature checks again; results stay exact."""
    from vmcgrad._problem import problem as _problem

    calls = _counting_checks(monkeypatch)
    fun, params, samples = make_case("r2c", N)
    ct = jnp.linspace(-1.0, 1.0, N).astype(jnp.complex128)
    expected = vmcgrad.batched_vjp(fun, params, samples, ct, chunk_size=8)
    params2 = jax.tree.map(lambda p: 2 * p, params)
    got = vmcgrad.batched_vjp(fun, params2, samples + 1, ct, chunk_size=8)
    assert calls == ["vmcgrad.batched_vjp"]
    ref = jax.vjp(lambda p: fun(p, samples + 1), params2)[1](ct)[0]
    assert_tree_allclose(got, ref, rtol=1e-12, atol=1e-14)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    vmcgrad.batched_vjp(fun, params2, samples[:-1], ct[:-1], chunk_size=8)  # another N
    vmcgrad.batched_vjp(fun, params2, samples.astype(jnp.float32), ct, chunk_size=8)  # another dtype
    vmcgrad.batched_vjp(lambda p, x: fun(p, x), params2, samples, ct, chunk_size=8)  # another function
    vmcgrad.expect_grad(fun, params2, samples, ct, chunk_size=8)  # another entry point
    assert len(calls) == 5
    # the problem built from the cache is the one built without it
    hit = _problem.problem("vmcgrad.batched_vjp", fun, params, samples, chunk_size=8)[0]
    _problem._CHECKED.clear()
    assert _problem.problem("vmcgrad.batched_vjp", fun, params, samples, chunk_size=8)[0] == hit


@multi
def test_problem_validation_cache_keys_on_the_sharding(monkeypatch):
    calls = _counting_checks(monkeypatch)
    fun, params, samples = make_case("r2c", 8 * N_DEV)
    ct = jnp.ones(8 * N_DEV, jnp.complex128)
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        sharded = jax.device_put(samples, NamedSharding(mesh, P("S")))
        a = vmcgrad.batched_vjp(fun, params, sharded, ct, chunk_size=3)
        b = vmcgrad.batched_vjp(
            fun, params, jax.device_put(samples, NamedSharding(mesh, P())), ct, chunk_size=3
        )
    assert len(calls) == 2
    assert_tree_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_bad_input_after_a_cached_call_still_raises(monkeypatch):
    _counting_checks(monkeypatch)
    fun, params, samples = make_case("r2c", N)
    ct = jnp.ones(N, jnp.complex128)
    vmcgrad.batched_vjp(fun, params, samples, ct, chunk_size=8)
    bad = jax.tree.map(lambda p: jnp.round(p).astype(jnp.int32), params)
    with pytest.raises(TypeError, match="must be a real or complex floating array"):
        vmcgrad.batched_vjp(fun, bad, samples, ct, chunk_size=8)
    with pytest.raises(TypeError, match="must be a real or complex floating array"):
        vmcgrad.batched_vjp(fun, bad, samples, ct, chunk_size=8)


def test_problem_validation_cache_is_bounded_and_keeps_no_closure_alive(monkeypatch):
    import gc
    import weakref

    from vmcgrad._problem import problem as _problem

    _counting_checks(monkeypatch)
    _, params, samples = make_case("r2c", N)
    refs = []
    for i in range(_problem._CHECKED_MAX + 5):
        big = jnp.full((3,), float(i))
        refs.append(weakref.ref(big))
        vmcgrad.batched_vjp(
            lambda p, x, big=big: x @ p["W"][:, 0] + big[0], params, samples, jnp.ones(N), chunk_size=8
        )
        del big
    jax.clear_caches()  # jax.jit's caches hold the functions of compiled programs; this one must not
    gc.collect()
    assert len(_problem._CHECKED) == _problem._CHECKED_MAX
    assert all(r() is None for r in refs), "the cache kept a function's closure alive"
