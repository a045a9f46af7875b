"""Coupled rows: a ``fun`` whose row i depends on other samples is refused before tracing.

Every estimator calls ``fun`` on chunks of rows, so a batch statistic inside ``fun`` (``y - mean(y)``
without ``stop_gradient``) silently becomes a per-chunk one (relative error 0.9 at chunk 4 before
this check). The refusal comes from a jaxpr analysis of the tangent map
(:mod:`vmcgrad._checks.jaxpr`); it must not fire on the stop-gradient fix, per-sample models, NetKet's
models, attention over sites, scans over layers, vmap inside the model, or pytree samples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import vmcgrad
from vmcgrad._checks import row_coupling, row_rules, tangent

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
    # row i is sample i+1's: tile along the sample axis is not followed, the numerical check decides
    "tile_shift": lambda w, x: jnp.tile(jnp.tanh(x @ w), 2)[1 : x.shape[0] + 1],
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
    "tile_features": lambda w, x: jnp.tanh(jnp.tile(x, (1, 2)) @ jnp.tile(w, 2)),
    "tile_samples_first_copy": lambda w, x: jnp.tile(jnp.tanh(x @ w), 2)[: x.shape[0]],
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
    original = tangent.tangent_jaxpr

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(tangent, "tangent_jaxpr", counting)
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
    rows = tangent.abstract_batch_size(params, x)
    jaxpr = tangent.tangent_jaxpr(fun, params, x, rows)
    assert row_coupling.row_coupling(jaxpr, 2 * len(jax.tree.leaves(params))) is None
    # and the same model with a batch mean subtracted is caught
    coupled = lambda p, x: fun(p, x) - jnp.mean(fun(p, x))
    jaxpr = tangent.tangent_jaxpr(coupled, params, x, rows)
    assert row_coupling.row_coupling(jaxpr, 2 * len(jax.tree.leaves(params))) is not None


@pytest.mark.heavy
def test_rbm_end_to_end_matches_jax_vjp():
    hi, models = zoo()
    model = models["RBM"]
    x = hi.random_state(jax.random.key(0), N).astype(np.float64)
    params = model.init(jax.random.key(1), x)
    fun = lambda p, x: model.apply(p, x)
    (ref,) = jax.vjp(lambda p: fun(p, x), params)[1](CT)
    assert_tree_allclose(vmcgrad.batched_vjp(fun, params, x, CT, chunk_size=3), ref, rtol=1e-12, atol=1e-13)


# --- a primitive the analysis has no rule for: a numerical check, else a warning -------------------


def _made_up_primitive(name, impl):
    """A primitive vmcgrad's tables cannot know: ``impl`` on the last axis, with an abstract eval,
    a lowering and a batching rule (vmapped axis moved to the front)."""
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir

    p = Primitive(name)
    p.def_impl(impl)
    p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    batching.primitive_batchers[p] = lambda args, dims: (p.bind(jnp.moveaxis(args[0], dims[0], 0)), 0)
    return p


def _made_up_primitives():
    from jax.interpreters import ad

    rowwise = _made_up_primitive("test_made_up_rowwise", jnp.tanh)
    ad.defjvp(rowwise, lambda t, x: t * (1 - rowwise.bind(x) ** 2))
    # x - mean(x) over the last axis, which for fun's (N,) output is the sample axis
    coupled = _made_up_primitive("test_made_up_coupled", lambda x: x - jnp.mean(x, axis=-1, keepdims=True))
    ad.deflinear2(coupled, lambda ct, x: [coupled.bind(ct)])
    return rowwise, coupled


ROWWISE_P, COUPLED_P = _made_up_primitives()


def _rowwise_fun():  # a new function each time: the verdicts are remembered per function
    return lambda w, x: ROWWISE_P.bind(x @ w)


def _coupled_fun():
    return lambda w, x: jnp.sin(x @ w) + COUPLED_P.bind(x @ w)


def _state(fun):
    rows = tangent.abstract_batch_size(W, X)
    return row_coupling.row_state(tangent.tangent_jaxpr(fun, W, X, rows), 2)


def test_unknown_primitive_is_named_by_the_analysis():
    """The analysis names the primitive it has no rule for when it reaches the derivative, and not
    when it is under stop_gradient (no false report)."""
    assert _state(_coupled_fun()) == row_rules.Unknown(frozenset({"test_made_up_coupled"}))
    rows = tangent.abstract_batch_size(W, X)
    assert row_coupling.row_coupling(tangent.tangent_jaxpr(_coupled_fun(), W, X, rows), 2) is None
    quiet = lambda w, x: jnp.sin(x @ w) + jax.lax.stop_gradient(COUPLED_P.bind(x @ w))
    assert _state(quiet) == row_rules.Rows(0)


def test_numerical_check_refuses_the_coupling_primitive():
    """Concrete inputs: the numerical check measures the coupling and the call is refused, naming
    the primitive (today's code accepted it and returned a chunk-dependent gradient)."""
    with pytest.raises(ValueError, match="depend on each other") as err:
        vmcgrad.batched_vjp(_coupled_fun(), W, X, CT, chunk_size=4)
    assert "`test_made_up_coupled`" in str(err.value) and "numerical check" in str(err.value)


def test_numerical_check_passes_the_rowwise_primitive_and_is_remembered():
    """Concrete inputs: the row-wise primitive passes (no warning: they are errors in this suite),
    the gradient is exact, and a later traced call with the same function and shapes reuses the
    pass instead of warning."""
    fun = _rowwise_fun()
    (ref,) = jax.vjp(lambda w: fun(w, X), W)[1](CT)
    assert_tree_allclose(vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=3), ref, rtol=1e-12, atol=1e-13)
    traced = jax.jit(lambda w: vmcgrad.batched_vjp(fun, w, X, CT, chunk_size=3))(W)
    assert_tree_allclose(traced, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("make", [_rowwise_fun, _coupled_fun], ids=["rowwise", "coupled"])
def test_traced_unknown_primitive_warns_naming_it(make):
    """Traced inputs: no values to check, so vmcgrad warns (when it traces) that it assumed
    row-wise, naming the primitive and the filter that silences it; that filter, copied from the
    message, does."""
    import warnings

    from vmcgrad._warnings import UnknownPrimitiveWarning

    fun = make()

    def traced_call():  # a new jit each time: traced (and checked) again
        return jax.jit(lambda w: vmcgrad.batched_vjp(fun, w, X, CT, chunk_size=4))(W)  # params traced

    with pytest.warns(UnknownPrimitiveWarning) as seen:
        traced_call()
    (message,) = [str(w.message) for w in seen]
    assert seen[0].filename == __file__  # it points at the user's code, not at vmcgrad's
    name = "`test_made_up_coupled`" if make is _coupled_fun else "`test_made_up_rowwise`"
    assert message.startswith(f"vmcgrad: no row-coupling rule for the JAX primitive {name}")
    assert "vmcgrad.batched_vjp" in message and "assumed that row i" in message
    line = message[message.index("warnings.filterwarnings(") : message.rindex(")") + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval(line, {"warnings": warnings, "vmcgrad": vmcgrad})  # the silencing line, as printed
        traced_call()


@pytest.mark.parametrize("case", ["constants_under_jit", "closure_over_a_tracer"])
def test_concrete_looking_inputs_under_a_trace_warn(case):
    """Concrete params and samples inside the user's jit (as constants, or with ``fun`` closing over
    a traced value): the check's evaluation would be staged, not run, so vmcgrad warns instead."""
    from vmcgrad._warnings import UnknownPrimitiveWarning

    if case == "constants_under_jit":
        fun = _rowwise_fun()
        call = jax.jit(lambda: vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=4))
    else:
        call = jax.jit(
            lambda s: vmcgrad.batched_vjp(lambda w, x: s * ROWWISE_P.bind(x @ w), W, X, CT, chunk_size=4)
        )
    with pytest.warns(UnknownPrimitiveWarning, match="inputs are traced"):
        call() if case == "constants_under_jit" else call(2.0)


def test_a_failing_analysis_is_not_silent(monkeypatch):
    """A rule that does not fit this JAX's jaxpr (here: made to raise) leaves the verdict to the
    numerical check on concrete inputs, and to a warning on traced ones."""
    from vmcgrad._warnings import UnknownPrimitiveWarning

    def broken(eqn, ins):
        raise KeyError("dimension_numbers")

    monkeypatch.setitem(row_rules.RULES, "dot_general", broken)
    with pytest.raises(ValueError, match=r"analysis failed on .*KeyError"):
        vmcgrad.batched_vjp(lambda w, x: x @ w - jnp.mean(x @ w), W, X, CT, chunk_size=4)
    with pytest.warns(UnknownPrimitiveWarning, match="analysis failed on"):
        jax.jit(lambda w: vmcgrad.batched_vjp(lambda w, x: jnp.sin(x @ w), w, X, CT, chunk_size=4))(W)


@pytest.mark.filterwarnings("error::vmcgrad.VmcgradWarning")
def test_tile_of_other_axes_is_judged_without_a_numerical_check():
    """``jnp.tile`` over the features has a rule (the rows stay put): judged under ``jax.jit`` too,
    where no numerical check can run, with no warning; tiled along the samples it is left to the
    numerical check (here: concrete, and row-wise for the first copy)."""
    fun = DECOUPLED["tile_features"]
    (ref,) = jax.vjp(lambda w: fun(w, X), W)[1](CT)
    got = jax.jit(lambda w: vmcgrad.batched_vjp(fun, w, X, CT, chunk_size=4))(W)
    assert_tree_allclose(got, ref, rtol=1e-12, atol=1e-13)
