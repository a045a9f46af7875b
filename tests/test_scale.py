"""Parameter-sharded (FSDP-like) models and the automatic chunk size."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_allclose, auto_mesh, compile_count, make_case
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._auto_chunk import run_with_oom_retry

N_DEV = jax.device_count()
N = 37 * N_DEV


def wide_case():
    """R→C model whose parameter leaves divide over the devices (4·H hidden units)."""
    fun, params, samples = make_case("r2c", N)
    params = {"W": jnp.tile(params["W"], (1, 4)) / 2, "phase": jnp.tile(params["phase"], (4, 1)) / 2}
    ct = (jnp.linspace(-1.0, 1.0, N) + 1j * jnp.cos(jnp.arange(N))).astype(jnp.complex128)
    return fun, params, samples, ct


def place_fsdp(mesh, params, samples, ct):
    s = NamedSharding(mesh, P("S"))
    sharded = {
        "W": jax.device_put(params["W"], NamedSharding(mesh, P(None, "S"))),
        "phase": jax.device_put(params["phase"], NamedSharding(mesh, P("S"))),
    }
    return sharded, jax.device_put(samples, s), jax.device_put(ct, s)


@pytest.mark.parametrize("api", ["batched_vjp", "expect_grad"])
def test_parameter_sharded_equals_replicated(api):
    fun, params, samples, ct = wide_case()
    mesh = auto_mesh()
    call = getattr(vmcgrad, api)
    with jax.set_mesh(mesh):
        p_sh, x, c = place_fsdp(mesh, params, samples, ct)
        expected = call(fun, params, x, c, chunk_size=5)
        got = call(fun, p_sh, x, c, chunk_size=5)
    assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-13)
    if api == "batched_vjp":
        ref = jax.vjp(lambda p: fun(p, samples), params)[1](ct)[0]
        assert_tree_allclose(got, ref, rtol=1e-11, atol=1e-12)
    # the gradient comes back sharded like the parameter (specs are moot on one device)
    assert N_DEV == 1 or (got["W"].sharding.spec == P(None, "S") and got["phase"].sharding.spec == P("S"))


@pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")
def test_parameter_sharded_hlo_gathers_once_and_reduce_scatters_after_the_loop():
    fun, params, samples, ct = wide_case()
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        p_sh, x, c = place_fsdp(mesh, params, samples, ct)
        compiled = vmcgrad.lower(vmcgrad.batched_vjp, fun, p_sh, x, c, chunk_size=5).compile()
    report = vmcgrad.collective_report(compiled)
    assert report.total_in_loops == 0, report
    assert report.outside == {"all-gather": 2, "reduce-scatter": 2}, report


def test_auto_chunk_is_the_largest_power_of_two_that_fits():
    fun, params, samples = make_case("r2c", 512 * N_DEV)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        ct = jax.device_put(jnp.ones(512 * N_DEV, jnp.complex128), NamedSharding(mesh, P("S")))
        params = jax.device_put(params, NamedSharding(mesh, P()))

        def need(c):
            lowered = vmcgrad.lower(vmcgrad.batched_vjp, fun, params, x, ct, chunk_size=c)
            return vmcgrad.program_bytes(lowered.compile())

        b64, b128 = need(64), need(128)
        assert b64 < b128  # temp memory grows with the chunk
        budget = (b64 + b128) // 2
        chosen = vmcgrad.auto_chunk_size(fun, params, x, memory_budget=budget)
        assert chosen == 64
        assert need(chosen) <= budget < need(2 * chosen)
        # cached: asking again compiles nothing
        before = compile_count()
        assert vmcgrad.auto_chunk_size(fun, params, x, memory_budget=budget) == 64
        assert compile_count() == before
        # everything fits a huge budget: one chunk of all local samples
        assert vmcgrad.auto_chunk_size(fun, params, x, memory_budget=2**40) == 512


@pytest.mark.parametrize("api", ["batched_vjp", "batched_jvp", "expect_grad"])
def test_chunk_size_auto_gives_the_same_result(api):
    fun, params, samples = make_case("r2c", N)
    ct = (jnp.linspace(-1.0, 1.0, N) + 0.5j).astype(jnp.complex128)
    arg = params if api == "batched_jvp" else ct
    call = getattr(vmcgrad, api)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        a = arg if api == "batched_jvp" else jax.device_put(arg, NamedSharding(mesh, P("S")))
        expected = call(fun, params, x, a, chunk_size=None)
        got = call(fun, params, x, a, chunk_size="auto")
        before = compile_count()
        again = call(fun, params, x, a, chunk_size="auto")
        assert compile_count() == before
        under_jit = jax.jit(lambda p, x, a: call(fun, p, x, a, chunk_size="auto"))(params, x, a)
    for out in (got, again, under_jit):
        assert_tree_allclose(out, expected, rtol=1e-11, atol=1e-12)


def test_out_of_memory_halves_and_retries_once_with_a_warning():
    calls, remembered = [], []

    def run(c):
        calls.append(c)
        if c > 8:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return jnp.float64(c)

    with pytest.warns(
        RuntimeWarning, match=r"out of memory at chunk_size=16 .* retrying once with chunk_size=8"
    ):
        out = run_with_oom_retry(run, 16, remembered.append, "vmcgrad.batched_vjp")
    assert float(out) == 8 and calls == [16, 8] and remembered == [8]
    # only once: a second failure propagates
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(jax.errors.JaxRuntimeError):
            run_with_oom_retry(run, 64, remembered.append, "vmcgrad.batched_vjp")

    # other runtime errors are not retried
    def broken(c):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        run_with_oom_retry(broken, 16, remembered.append, "vmcgrad.batched_vjp")


def test_auto_chunk_size_errors():
    fun, params, samples = make_case("r2c", N)
    with pytest.raises(ValueError, match="`memory_budget` must be a positive number of bytes; got -1"):
        vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=-1)
    with pytest.raises(MemoryError, match="found no chunk that fits the memory budget of 10 bytes"):
        vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=10)


def test_auto_chunk_default_budget():
    """Half the free memory where the backend reports it (GPU, TPU), else the documented 2 GiB."""
    from vmcgrad._auto_chunk import DEFAULT_MEMORY_BUDGET, default_memory_budget

    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        assert abs(default_memory_budget() - free // 2) <= 1
    else:
        assert default_memory_budget() == DEFAULT_MEMORY_BUDGET == 2 * 2**30


def test_qgt_chunk_size_auto():
    fun, params, samples = make_case("r2c", N)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        fixed = vmcgrad.QGT(fun, params, x, chunk_size=5, diag_shift=1e-3, diag_scale=1e-2)
        auto = vmcgrad.QGT(fun, params, x, chunk_size="auto", diag_shift=1e-3, diag_scale=1e-2)
        # the default budget (2 GiB on CPU) fits it all: the largest power of two <= 37 local samples
        assert auto.chunk_size == 32
        assert_tree_allclose(auto @ params, fixed @ params, rtol=1e-11, atol=1e-12)
