"""Coupled rows: a ``fun`` whose row i depends on other samples is refused before tracing.

Every estimator calls ``fun`` on chunks of rows, so a batch statistic inside ``fun`` (``y - mean(y)``
without ``stop_gradient``) silently becomes a per-chunk one (relative error 0.9 at chunk 4 before
this check). The refusal comes from a jaxpr analysis of the tangent map
(:mod:`vmcgrad._jaxpr_checks`); it must not fire on the stop-gradient fix, per-sample models, NetKet's
models, attention over sites, scans over layers, vmap inside the model, or pytree samples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import vmcgrad
from vmcgrad import _jaxpr_checks

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N = 4 * jax.device_count()  # 16 on 4 devices
W = jnp.linspace(-0.5, 0.5, 3)
X = jax.random.normal(jax.random.key(0), (N, 3))
CT = jnp.linspace(-1.0, 1.0, N)

COUPLED = {
    "mean": lambda w, x: x @ w - jnp.mean(x @ w),
    "max": lambda w, x: jnp.tanh(x @ w) - jnp.max(jnp.tanh(x @ w)),
    "logsumexp": lambda w, x: jnp.tanh(x @ w) - jax.nn.logsumexp(jnp.tanh(x @ w)),
    "cumsum": lambda w, x: jnp.cumsum(x @ w),
    "jitted_mean": jax.jit(lambda w, x: x @ w - jnp.mean(x @ w)),
    "batch_norm": lambda w, x: (x @ w - jnp.mean(x @ w)) / jnp.std(x @ w),
}
DECOUPLED = {
    "stop_gradient_mean": lambda w, x: x @ w - jax.lax.stop_gradient(jnp.mean(x @ w)),
    "stop_gradient_max": lambda w, x: jnp.tanh(x @ w) - jax.lax.stop_gradient(jnp.max(jnp.tanh(x @ w))),
    "jitted_stop_gradient": jax.jit(lambda w, x: x @ w - jax.lax.stop_gradient(jnp.mean(x @ w))),
    "per_sample_vmap": jax.vmap(lambda w, xi: jnp.tanh(xi @ w) + jnp.sum(xi[::-1] * w), in_axes=(None, 0)),
    "lax_map": lambda w, x: jax.lax.map(lambda xi: jnp.tanh(xi @ w), x),
    "softmax_over_sites": lambda w, x: jnp.sum(jax.nn.softmax(x * w, axis=-1) * x, -1),
    "scan_over_layers": lambda w, x: jax.lax.scan(lambda h, _: (jnp.tanh(h * w), None), x, None, length=3)[
        0
    ].sum(-1),
    "fori_over_layers": lambda w, x: jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h * w), x).sum(-1),
    "flatten_and_back": lambda w, x: (x.reshape(-1) * jnp.tile(w, x.shape[0])).reshape(x.shape[0], 3).sum(-1),
}

ESTIMATORS = {
    "batched_vjp": lambda f, c: vmcgrad.batched_vjp(f, W, X, CT, chunk_size=c),
    "batched_jvp": lambda f, c: vmcgrad.batched_jvp(f, W, X, W, chunk_size=c),
    "expect_grad": lambda f, c: vmcgrad.expect_grad(f, W, X, CT, chunk_size=c),
    "QGT": lambda f, c: vmcgrad.QGT(f, W, X, chunk_size=c) @ W,
}


@pytest.mark.quick_cover("estimator")
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("case", list(COUPLED))
def test_coupled_rows_refused(case, estimator):
    with pytest.raises(
        ValueError, match=r"rows of `(fun|logpsi)\(params, samples\)` depend on each other"
    ) as err:
        ESTIMATORS[estimator](COUPLED[case], 4)
    assert "stop_gradient" in str(err.value) and "jax.vmap" in str(err.value)


@pytest.mark.parametrize("case", list(DECOUPLED))
def test_decoupled_rows_accepted_and_exact(case):
    fun = DECOUPLED[case]
    (ref,) = jax.vjp(lambda w: fun(w, X), W)[1](CT)
    for chunk in (1, 3, None):
        assert_tree_allclose(
            vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=chunk), ref, rtol=1e-12, atol=1e-13
        )


def test_pytree_samples():
    s = {"a": X, "b": jnp.arange(2 * N).reshape(N, 2)}
    good = lambda w, s: jnp.tanh(s["a"] @ w) + s["b"][:, 0] * jnp.sum(w)
    (ref,) = jax.vjp(lambda w: good(w, s), W)[1](CT)
    assert_tree_allclose(vmcgrad.batched_vjp(good, W, s, CT, chunk_size=3), ref, rtol=1e-12, atol=1e-13)
    bad = lambda w, s: jnp.tanh(s["a"] @ w) - jnp.mean(s["b"][:, 0] * jnp.sum(w))
    with pytest.raises(ValueError, match="depend on each other"):
        vmcgrad.batched_vjp(bad, W, s, CT, chunk_size=3)


def test_analysed_once_per_signature(monkeypatch):
    calls = []
    original = _jaxpr_checks.tangent_jaxpr

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_jaxpr_checks, "tangent_jaxpr", counting)
    fun = lambda w, x: jnp.sin(x @ w)
    for _ in range(3):
        vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=4)
    assert len(calls) == 1
    vmcgrad.batched_vjp(fun, W, X[: N // 2], CT[: N // 2], chunk_size=4)  # a new signature
    assert len(calls) == 2


def test_not_run_on_traced_inputs_only_once():
    """Under the user's jit the check runs on the tracers' shapes, and refuses there too."""
    with pytest.raises(ValueError, match="depend on each other"):
        jax.jit(lambda w, x: vmcgrad.batched_vjp(COUPLED["mean"], w, x, CT, chunk_size=4))(W, X)


# --- no false alarm on NetKet's and flax models --------------------------------------------------


def _zoo():
    with jax.set_mesh(None):
        import flax.linen as nn
        import netket as nk

    class Attention(nn.Module):  # ViT-like: embedding, attention over sites, layer norm
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(2, 8)((x > 0).astype(jnp.int32))
            h = h + self.param("pos", nn.initializers.normal(), (x.shape[-1], 8))
            h = nn.LayerNorm()(h)
            h = h + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
            h = nn.Dense(8)(nn.gelu(nn.Dense(16)(h)))
            return jnp.sum(jax.nn.logsumexp(h, axis=-1), -1)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(h.shape[-1])(h)), None

    class ScanLayers(nn.Module):  # flax nn.scan over layers
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return scan()(x.astype(float), None)[0].sum(-1)

    class VmapInside(nn.Module):  # the batch handled by vmap inside the model
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (x.shape[-1], x.shape[-1]))
            return jax.vmap(lambda xi: jnp.tanh(w @ xi[::-1]).sum() + jnp.cos(xi[1] * w[0, 0]))(x)

    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.sum(jnp.tanh(nn.Conv(4, (3,), padding="CIRCULAR")(x[..., None])), axis=(-1, -2))

    L = 8
    hi, g = nk.hilbert.Spin(0.5, L), nk.graph.Chain(L)
    return hi, {
        "RBM": nk.models.RBM(alpha=1),
        "RBM[complex]": nk.models.RBM(alpha=1, param_dtype=complex),
        "RBMModPhase": nk.models.RBMModPhase(alpha=1),
        "RBMSymm": nk.models.RBMSymm(g.automorphisms(), alpha=2),
        "GCNN": nk.models.GCNN(symmetries=g, layers=2, features=4),
        "GCNN[fft]": nk.models.GCNN(symmetries=g, layers=2, features=4, mode="fft"),
        "GCNN[complex]": nk.models.GCNN(symmetries=g, layers=2, features=4, param_dtype=complex),
        "Jastrow": nk.models.Jastrow(),
        "MLP": nk.models.MLP(hidden_dims=(8, 8)),
        "LogStateVector": nk.models.LogStateVector(hi),
        "ARNNDense": nk.models.ARNNDense(hi, layers=2, features=4),
        "Attention": Attention(),
        "ScanLayers": ScanLayers(),
        "VmapInside": VmapInside(),
        "Conv": Conv(),
    }


@functools.cache
def zoo():
    return _zoo()


@pytest.mark.parametrize("name", list(_zoo()[1]))
def test_no_false_alarm_on_models(name):
    hi, models = zoo()
    model = models[name]
    x = hi.random_state(jax.random.key(0), 12)
    variables = model.init(jax.random.key(1), x)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    fun = jax.tree_util.Partial(lambda p, x, s=state: model.apply({"params": p, **s}, x))
    rows = _jaxpr_checks.abstract_batch_size(params, x)
    jaxpr = _jaxpr_checks.tangent_jaxpr(fun, params, x, rows)
    assert _jaxpr_checks.row_coupling(jaxpr, 2 * len(jax.tree.leaves(params))) is None
    # and the same model with a batch mean subtracted is caught
    coupled = lambda p, x: fun(p, x) - jnp.mean(fun(p, x))
    jaxpr = _jaxpr_checks.tangent_jaxpr(coupled, params, x, rows)
    assert _jaxpr_checks.row_coupling(jaxpr, 2 * len(jax.tree.leaves(params))) is not None


@pytest.mark.heavy
def test_rbm_end_to_end_matches_jax_vjp():
    hi, models = zoo()
    model = models["RBM"]
    x = hi.random_state(jax.random.key(0), N).astype(np.float64)
    params = model.init(jax.random.key(1), x)
    fun = lambda p, x: model.apply(p, x)
    (ref,) = jax.vjp(lambda p: fun(p, x), params)[1](CT)
    assert_tree_allclose(vmcgrad.batched_vjp(fun, params, x, CT, chunk_size=3), ref, rtol=1e-12, atol=1e-13)
