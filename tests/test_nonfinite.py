"""Rows that do not count add an exact zero, even where a derivative is infinite (issue 19).

The shifted last chunk re-reads rows with weight 0, and rows padded to the device count are copies;
``0 * inf`` is NaN, so one such row with an infinite derivative used to turn ``[inf, -inf, nan]``
(what ``jax.vjp`` gives) into ``[nan, nan, nan]``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vmcgrad

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N = 10
N_DEV = jax.device_count()


def fun(w, x):
    """log(x @ w): the derivative x / (x @ w) is [inf, -inf, nan] on a row with x @ w = 0."""
    return jnp.log(x @ w + 0j)


def case():
    w = jnp.array([1.0, 2.0, 0.5])
    x = jnp.abs(jax.random.normal(jax.random.key(0), (N, 3))) + 0.1
    x = x.at[7].set(jnp.array([1.0, -0.5, 0.0]))  # x @ w = 0
    ct = (jnp.linspace(-1, 1, N) + 0.05).astype(jnp.complex128)
    return w, x, ct


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-12)


def test_reference_is_not_all_nan():
    w, x, ct = case()
    (want,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
    assert np.isposinf(want[0]) and np.isneginf(want[1]) and np.isnan(want[2])


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 6, 7, 9, N, N + 3, None])
def test_infinite_derivative_on_a_reread_row_matches_jax_vjp(chunk):
    w, x, ct = case()
    (want,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
    same(vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=chunk), want)


@pytest.mark.skipif(N_DEV == 1, reason="padding to the device count needs several devices")
@pytest.mark.parametrize("chunk", [1, 2, 3, None])
def test_infinite_derivative_with_rows_padded_to_the_devices_matches_jax_vjp(chunk):
    w, x, ct = case()
    assert N % N_DEV != 0  # rows are padded with copies of the last one
    (want,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
    mesh = jax.make_mesh((N_DEV,), ("S",))
    with jax.set_mesh(mesh):
        got = vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=chunk)
    same(got, want)


@pytest.mark.parametrize("chunk", [3, 4])
def test_expect_grad_keeps_the_infinite_components(chunk):
    w, x, _ = case()
    local = jnp.linspace(0.5, 2.0, N).astype(jnp.complex128)
    centred = jnp.conj(local - local.mean()) / N
    (vjp,) = jax.vjp(lambda w: fun(w, x), w)[1](centred)
    same(vmcgrad.expect_grad(fun, w, x, local, chunk_size=chunk), 2 * vjp)


def test_the_check_sees_nan_from_a_reread_row(monkeypatch):
    """Companion: with the stand-ins switched off, chunk 4 (rows 6-9 re-read 6, 7) gives NaN."""
    from vmcgrad._runner import refs

    monkeypatch.setattr(refs, "_finite_stand_ins", lambda p, r, ps, chunks, k, w: chunks.take(k, *ps)[:-1])
    jax.clear_caches()
    try:
        w, x, ct = case()
        (want,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
        with pytest.raises(AssertionError):
            same(vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4), want)
    finally:
        jax.clear_caches()
