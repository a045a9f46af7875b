"""The seed's recipe in the runner: pullbacks are written through ``f_vjp.with_refs`` (issue 18).

On a model whose parameters are used inside a ``lax.scan`` over layers, ``with_refs`` adds each
layer's gradient straight into the accumulator; ``acc[...] += f_vjp(ct)[0]`` first builds the stacked
per-layer gradient. The compiled temp bytes tell the two apart, so they are the test: vmcgrad against
a hand-written ``with_refs`` loop, and a companion showing that the check fires when the runner falls
back to ``+=``.
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import vmcgrad
from vmcgrad._runner import primitive as _chunked

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N, C, LAYERS, D = 512, 16, 6, 256


def scan_model(Ws, xs):
    """The seed discussion's ``mubatch_loss`` with a nonlinearity: parameters used inside a scan."""
    act, _ = jax.lax.scan(lambda a, W: (jnp.tanh(a @ W), None), xs, Ws)
    return jnp.sum(act, axis=-1)


def complex_scan_model(Ws, xs):
    act, _ = jax.lax.scan(lambda a, W: (jnp.tanh(a @ W), None), xs, Ws)
    return jnp.sum(act, axis=-1) + 1j * jnp.sum(act**2, axis=-1)


def inputs(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    Ws = (jax.random.normal(k1, (LAYERS, D, D)) / D**0.5).astype(dtype)
    xs = jax.random.normal(k2, (N, D)).astype(dtype)
    return Ws, xs


def handwritten_bytes(fun, params, xs, ct):
    """The seed's recipe by hand: one loop over chunks, ``f_vjp.with_refs(acc)(ct)``, one device."""

    @jax.jit
    def run(params, xs, ct):
        acc = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

        def body(k, _):
            x = jax.lax.dynamic_slice_in_dim(xs, k * C, C)
            c = jax.lax.dynamic_slice_in_dim(ct, k * C, C)
            _, f_vjp = jax.vjp(lambda p: fun(p, x), params)
            f_vjp.with_refs(acc)(c)

        jax.lax.fori_loop(0, xs.shape[0] // C, body, None)
        return jax.tree.map(jax.ref.freeze, acc)

    return vmcgrad.program_bytes(run.lower(params, xs, ct).compile())


def vmcgrad_bytes(estimator, fun, params, xs, ct):
    # samples on one device (no mesh, unsharded): the hand-written loop's set-up
    return vmcgrad.program_bytes(vmcgrad.lower(estimator, fun, params, xs, ct, chunk_size=C).compile())


def ratios():
    Ws, xs = inputs()
    ct = jnp.linspace(-1, 1, N, dtype=jnp.float32)
    local = jnp.linspace(-1, 1, N).astype(jnp.complex64) * (1 + 0.5j)
    centred = jnp.conj(local - local.mean()) / N
    ref = handwritten_bytes(scan_model, Ws, xs, ct)
    ref_c = handwritten_bytes(complex_scan_model, Ws, xs, centred)
    return {
        "batched_vjp": vmcgrad_bytes(vmcgrad.batched_vjp, scan_model, Ws, xs, ct) / ref,
        "expect_grad": vmcgrad_bytes(vmcgrad.expect_grad, complex_scan_model, Ws, xs, local) / ref_c,
    }


def test_pullbacks_on_a_scan_model_cost_what_the_seeds_with_refs_loop_costs():
    for name, ratio in ratios().items():
        assert ratio <= 1.05, f"{name}: {ratio:.3f}x the hand-written with_refs loop's temp bytes"


def test_the_bytes_check_fires_when_the_runner_falls_back_to_plus_equals(monkeypatch):
    """Companion: with the pullback form dropped (``acc[...] += part``), the same check fails."""
    monkeypatch.setattr(_chunked, "writable", lambda *args, **kwargs: False)
    jax.clear_caches()
    try:
        for name, ratio in ratios().items():
            assert ratio > 1.2, f"{name}: {ratio:.3f}x: the check would not see the fallback"
    finally:
        jax.clear_caches()


def bound_pullbacks(fn, *args):
    """The ``pullback`` parameter of every chunked equation with sums in ``fn``'s jaxpr (sub-jaxprs
    included; a pass of per-sample outputs only, such as a jvp's, has no sums to pull back)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is _chunked.chunked_p and eqn.params["params"].sum_layout:
                found.append(eqn.params["params"].pullback)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.complex128])
def test_every_untransformed_pullback_is_bound_in_pullback_form(dtype):
    """batched_vjp, expect_grad, the QGT's mean and product passes (the fused product of an operator
    built outside the trace; the two-loop product's pullback pass in the trace that built it): each
    binds its pullback form (and the results equal jax.vjp's)."""
    k1, k2 = jax.random.split(jax.random.key(1))
    w = (jax.random.normal(k1, (5, 3)) / 3).astype(dtype)
    x = jax.random.normal(k2, (37, 5)).astype(jnp.real(w).dtype)
    fun = lambda w, x: jnp.sum(jnp.tanh(x @ w), -1)
    ct = jnp.linspace(-1, 1, 37).astype(jnp.result_type(w))
    S = vmcgrad.QGT(fun, w, x, chunk_size=8)  # built outside the traces below: the fused product
    est = [
        lambda w: vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=8),
        lambda w: vmcgrad.expect_grad(fun, w, x, ct, chunk_size=8),
        lambda w: vmcgrad.QGT(fun, w, x, chunk_size=8) @ w,
        lambda v: S @ v,
    ]
    for e in est:
        forms = bound_pullbacks(e, w)
        assert forms and all(f is not None for f in forms), forms
    got = jax.jit(est[0])(w)
    (want,) = jax.vjp(lambda w: fun(w, x), w)[1](ct)
    tol = 1e-12 if jnp.finfo(w.dtype).bits == 64 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_transformed_estimators_bind_the_generic_body():
    """A transformed estimator falls back to the generic body (the rules bind without the form)."""
    w = jnp.ones((5, 3)) / 4
    x = jnp.linspace(-1, 1, 50).reshape(10, 5)
    fun = lambda w, x: jnp.sum(jnp.tanh(x @ w), -1)
    ct = jnp.linspace(-1, 1, 10)
    vjp = lambda w: vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4)
    forms = bound_pullbacks(lambda w, t: jax.jvp(vjp, (w,), (t,)), w, w)
    assert forms == [None]  # one combined primal-and-tangent pass, generic body
    got = jax.jvp(vjp, (w,), (w,))[1]
    want = jax.jvp(lambda w: jax.vjp(lambda w: fun(w, x), w)[1](ct)[0], (w,), (w,))[1]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def count_binds(fn, *args):
    return len(bound_pullbacks(fn, *args))


@pytest.mark.heavy
def test_jvp_of_an_estimator_binds_the_primitive_once():
    """One forward pass for primal and tangent (issue 18 item 2); reverse mode and checkpoint still
    split it into a primal part and a linear part (one bind each) and give jax.vjp's derivatives."""
    w = jnp.ones((5, 3)) / 4
    x = jnp.linspace(-1, 1, 50).reshape(10, 5)
    fun = lambda w, x: jnp.sum(jnp.tanh(x @ w), -1)
    ct = jnp.linspace(-1, 1, 10)
    vjp = lambda w: vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4)
    ref = lambda w: jax.vjp(lambda w: fun(w, x), w)[1](ct)[0]
    loss = lambda f: lambda w: jnp.sum(f(w) ** 2)
    assert count_binds(lambda w, t: jax.jvp(vjp, (w,), (t,)), w, w) == 1
    assert count_binds(jax.grad(loss(vjp)), w) == 2
    assert count_binds(jax.grad(jax.checkpoint(loss(vjp))), w) == 2
    for transform in (jax.grad, lambda f: jax.grad(jax.checkpoint(f)), jax.hessian):
        np.testing.assert_allclose(transform(loss(vjp))(w), transform(loss(ref))(w), rtol=1e-12, atol=1e-12)
    got = jax.jvp(vjp, (w,), (w,))
    want = jax.jvp(ref, (w,), (w,))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "fun",
    [
        lambda W, x: x @ W[:, 0],  # slicing a parameter: jax 0.10.2's slice transpose has no refs
        lambda W, x: x @ W[0],  # indexing one: a dot_general shape error inside with_refs
    ],
)
def test_pullbacks_jax_cannot_write_through_refs_take_the_generic_body(fun):
    """Where JAX's transposes cannot accumulate into refs, the estimator still runs (generic body,
    probed once at bind time) and equals jax.vjp; the failed probe keeps nothing alive."""
    import gc
    import weakref

    W = jnp.linspace(0.1, 0.9, 9).reshape(3, 3)
    x = jnp.linspace(-1, 1, 33).reshape(11, 3)
    ct = jnp.linspace(-1, 1, 11)

    def run():
        big = jnp.full((3,), 0.5)
        f = lambda W, x, big=big: fun(W, x) + big[0]
        forms = bound_pullbacks(lambda W: vmcgrad.batched_vjp(f, W, x, ct, chunk_size=4), W)
        got = vmcgrad.batched_vjp(f, W, x, ct, chunk_size=4)
        (want,) = jax.vjp(lambda W: f(W, x), W)[1](ct)
        return forms, got, want, weakref.ref(big)

    forms, got, want, ref = run()
    assert forms == [None]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    jax.clear_caches()
    gc.collect()
    assert ref() is None, "a failed probe kept the model's constants alive"


def test_a_pullback_chunk_function_is_traced_once_per_bind():
    """The pullback form, its generic body and the with_refs probe come from one trace of the chunk
    function: the user's function is traced once at the chunk's shape (other traces, at other
    shapes, are the input checks')."""
    shapes = []

    def fun(w, x):
        shapes.append(x.shape)
        return jnp.sum(jnp.tanh(x @ w), -1)

    w = jnp.ones((5, 3)) / 4
    x = jnp.linspace(-1, 1, 50).reshape(10, 5)
    ct = jnp.linspace(-1, 1, 10)
    forms = bound_pullbacks(lambda w: vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=4), w)
    assert forms and forms[0] is not None
    assert shapes.count((4, 5)) == 1, shapes
