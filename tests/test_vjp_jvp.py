"""batched_vjp / batched_jvp against the plain jax.vjp / jax.jvp on the whole batch."""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from helpers import CASES, assert_tree_allclose, make_case, random_like, setup, tols, traced_without_mesh

import vmcgrad

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N_DEV = jax.device_count()
N = 37 * N_DEV  # 37 samples per device: prime, so most chunk sizes leave a remainder
CHUNKS = [None, 1, 5, 37, 1000]


def reference_vjp(fun, params, samples, ct):
    return jax.vjp(lambda p: fun(p, samples), params)[1](ct)[0]


def reference_jvp(fun, params, samples, t):
    return jax.jvp(lambda p: fun(p, samples), (params,), (t,))[1]


def cotangent_for(fun, params, samples, seed=1):
    out = jax.eval_shape(fun, params, samples)
    return random_like(jax.random.key(seed), out.shape, out.dtype)


def tangent_for(params, seed=2):
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tdef, [random_like(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])


@pytest.mark.quick_cover("case", "chunk_size")
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("case", CASES)
def test_vjp_matches_jax_vjp(case, chunk_size):
    fun, params, samples = make_case(case, N)
    ct = cotangent_for(fun, params, samples)
    expected = reference_vjp(fun, params, samples, ct)
    with setup("netket") as place:
        got = vmcgrad.batched_vjp(fun, params, place(samples), place(ct), chunk_size=chunk_size)
    assert_tree_allclose(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("case", CASES)
def test_jvp_matches_jax_jvp(case, chunk_size):
    fun, params, samples = make_case(case, N)
    t = tangent_for(params)
    expected = reference_jvp(fun, params, samples, t)
    with setup("netket") as place:
        got = vmcgrad.batched_jvp(fun, params, place(samples), t, chunk_size=chunk_size)
    assert_tree_allclose(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.quick_cover("kind")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["netket", "explicit", "none"])
@pytest.mark.parametrize("case", ["r2r", "r2c", "c2c_nonholo", "mixed", "layered"])
def test_sharding_setups(kind, jit, case):
    fun, params, samples = make_case(case, N)
    ct, t = cotangent_for(fun, params, samples), tangent_for(params)
    expected_vjp = reference_vjp(fun, params, samples, ct)
    expected_jvp = reference_jvp(fun, params, samples, t)

    def both(params, samples, ct, t):
        g = vmcgrad.batched_vjp(fun, params, samples, ct, chunk_size=5)
        return g, vmcgrad.batched_jvp(fun, params, samples, t, chunk_size=5)

    with setup(kind) as place:
        samples, ct = place(samples), place(ct)
        unseen = traced_without_mesh() if jit and kind == "none" else contextlib.nullcontext()
        with unseen:  # jitted with no mesh on several devices: vmcgrad's notice is due
            g, o = (jax.jit(both) if jit else both)(params, samples, ct, t)
        assert_tree_allclose(g, expected_vjp, rtol=1e-11, atol=1e-12)
        assert_tree_allclose(o, expected_jvp, rtol=1e-11, atol=1e-12)
        if kind != "none" and N_DEV > 1:
            # the jvp output stays sharded like the samples: nothing sample-sized was gathered
            assert o.sharding.spec[0] == "S", o.sharding


@pytest.mark.parametrize("case", ["r2r", "r2c", "c2c_holo", "mixed"])
def test_float32(case):
    fun, params, samples = make_case(case, N, dtype=jnp.float32)
    ct, t = cotangent_for(fun, params, samples), tangent_for(params)
    rtol, atol = tols(jnp.float32)
    with setup("netket") as place:
        g = vmcgrad.batched_vjp(fun, params, place(samples), place(ct), chunk_size=5)
        o = vmcgrad.batched_jvp(fun, params, place(samples), t, chunk_size=5)
    assert all(leaf.dtype in (jnp.float32, jnp.complex64) for leaf in jax.tree.leaves(g))
    assert_tree_allclose(g, reference_vjp(fun, params, samples, ct), rtol=rtol, atol=atol)
    assert_tree_allclose(o, reference_jvp(fun, params, samples, t), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["r2c", "pytree_samples"])
@pytest.mark.parametrize("kind", ["netket", "explicit"])
@pytest.mark.parametrize("n", [1, 3, N_DEV * 5 + 1, N_DEV * 5])
def test_replicated_samples_under_a_mesh(kind, n, case):
    """Unsharded samples under a context mesh, N divisible by the devices or not (padded)."""
    fun, params, samples = make_case(case, n)
    ct, t = cotangent_for(fun, params, samples), tangent_for(params)
    with setup(kind):
        g = vmcgrad.batched_vjp(fun, params, samples, ct, chunk_size=2)
        o = vmcgrad.batched_jvp(fun, params, samples, t, chunk_size=2)
    assert_tree_allclose(g, reference_vjp(fun, params, samples, ct), rtol=1e-11, atol=1e-12)
    assert_tree_allclose(o, reference_jvp(fun, params, samples, t), rtol=1e-11, atol=1e-12)


def test_numpy_inputs_are_accepted():
    import numpy as np

    fun, params, samples = make_case("r2r", 10)
    ct = cotangent_for(fun, params, samples)
    got = vmcgrad.batched_vjp(fun, params, np.asarray(samples), np.asarray(ct), chunk_size=3)
    assert_tree_allclose(got, reference_vjp(fun, params, samples, ct), rtol=1e-11, atol=1e-12)
