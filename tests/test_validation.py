"""Bad input raises a clear TypeError/ValueError before tracing: argument, given, expected, fix."""

import jax
import jax.numpy as jnp
import pytest
from helpers import make_case

import vmcgrad

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

    with pytest.raises(TypeError, match="`cotangent` must match the output of `fun`"):
        user(PARAMS, SAMPLES)
