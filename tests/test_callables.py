"""``fun`` keyed as ``jax.jit`` keys a function: callables by identity, array-like leaves traced.

Every estimator (``batched_vjp``, ``batched_jvp``, ``expect_grad``, ``QGT``, ``auto_chunk_size``) is
checked against plain JAX on the same function object: two instances that compare equal get their own
programs, mutated constants of a pytree ``fun`` are seen, a ``Partial`` or equinox ``Module`` with
Python-float leaves does not compile again per call, and a collected callable never aliases a new one.
"""

import gc
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, compile_count

import vmcgrad

with jax.set_mesh(None):  # NetKet's import sets a global mesh: kept out of this file (test_netket.py)
    import netket as nk

    import vmcgrad.netket as vnk

N, CHUNK = 11, 4
W = jnp.linspace(-0.5, 0.7, 3)
X = jnp.cos(jnp.arange(3.0 * N)).reshape(N, 3)
CT = jnp.sin(jnp.arange(N, dtype=jnp.float64)) + 0.3
V = jnp.array([0.3, -0.1, 0.2])


def f(c, w, x):
    return c * jnp.tanh(x @ w) + jnp.sin(c) * (x @ w) ** 2


def references(fun):
    """Every estimator's plain-JAX reference for ``fun(w, X)``."""
    _, pull = jax.vjp(lambda w: fun(w, X), W)
    jac = jax.jacrev(lambda w: fun(w, X))(W)
    o = jac - jac.mean(0)
    return {
        "batched_vjp": pull(CT)[0],
        "batched_jvp": jax.jvp(lambda w: fun(w, X), (W,), (V,))[1],
        "expect_grad": 2 * pull((CT - CT.mean()) / N)[0],
        "QGT @": o.T @ (o @ V) / N,
    }


def estimates(fun, **kw):
    """Every estimator's vmcgrad result for ``fun(w, X)``."""
    return {
        "batched_vjp": vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=CHUNK, **kw),
        "batched_jvp": vmcgrad.batched_jvp(fun, W, X, V, chunk_size=CHUNK, **kw),
        "expect_grad": vmcgrad.expect_grad(fun, W, X, CT, chunk_size=CHUNK, **kw),
        "QGT @": vmcgrad.QGT(fun, W, X, chunk_size=CHUNK, **kw) @ V,
    }


def assert_right(fun, **kw):
    got, want = estimates(fun, **kw), references(fun)
    for name in want:
        assert_tree_allclose(got[name], want[name], rtol=1e-12, atol=1e-13)


class EqModel:
    """A callable whose ``__eq__`` ignores the constant that changes the function (legal Python)."""

    def __init__(self, c):
        self.c = c

    def __call__(self, w, x):
        return f(self.c, w, x)

    def __eq__(self, other):
        return isinstance(other, EqModel)

    def __hash__(self):
        return 0


class Unhashable:
    """A callable with ``__eq__`` and no ``__hash__`` (Python sets ``__hash__ = None``)."""

    def __init__(self, c):
        self.c = c

    def __call__(self, w, x):
        return f(self.c, w, x)

    def __eq__(self, other):
        return isinstance(other, Unhashable) and other.c == self.c


class Module(eqx.Module):
    c: float
    scale: jax.Array

    def __call__(self, w, x):
        return self.scale * f(self.c, w, x)


def test_equal_comparing_callables_get_their_own_programs():
    """issue 19 item 1: before, EqModel(3.0) reused EqModel(1.0)'s program (rel. error 4.6)."""
    assert EqModel(1.0) == EqModel(3.0)
    for c in (1.0, 3.0, 1.0):
        assert_right(EqModel(c))


def test_equal_comparing_callables_auto_chunk():
    """``chunk_size="auto"`` caches its choice per problem: the key must not merge equal instances."""
    for c in (1.0, 3.0):
        got = vmcgrad.batched_vjp(EqModel(c), W, X, CT, chunk_size="auto")
        assert_tree_allclose(got, references(EqModel(c))["batched_vjp"], rtol=1e-12, atol=1e-13)


class EqScaled(EqModel):
    def __call__(self, s, w, x):
        return s * f(self.c, w, x)


def test_equal_comparing_function_of_a_partial():
    """The function of a ``Partial`` sits in its pytree structure (compared by ``__eq__``): before,
    ``Partial(EqScaled(3.0), s)`` reused ``Partial(EqScaled(1.0), s)``'s program."""
    for c in (1.0, 3.0):
        assert_right(jax.tree_util.Partial(EqScaled(c), jnp.asarray(1.5)))


def test_unhashable_callable():
    """Before: JAX's "Non-hashable static arguments" error naming vmcgrad's private Problem."""
    for c in (1.0, 2.0):
        assert_right(Unhashable(c))


def test_partial_with_python_float_is_traced_not_compiled_in():
    """Before: the whole Partial was static and hashed by identity, so every call compiled again."""
    assert_right(jax.tree_util.Partial(f, 0.5))  # compiles every estimator once
    before = compile_count()
    for c in (0.7, 1.3, 2.0):
        assert_right(jax.tree_util.Partial(f, c))
    assert compile_count() == before


def test_equinox_module_with_float_field_neither_recompiles_nor_goes_stale():
    m = Module(0.5, jnp.asarray(1.5))
    assert_right(m)
    before = compile_count()
    for c in (0.7, 1.3):
        m = eqx.tree_at(lambda m: m.c, m, c)
        assert_right(m)
    assert compile_count() == before


def test_mutated_constants_are_seen():
    """Before: a Partial with a float leaf was static by identity, so in-place changes went stale."""
    arr = np.array([1.0])
    fun = jax.tree_util.Partial(lambda c, a, w, x: f(c * a[0], w, x), 0.5, arr)
    assert_right(fun)
    arr[0] = 2.0  # the same Partial object, its NumPy leaf mutated
    assert_right(fun)
    fun = jax.tree_util.Partial(lambda w, x, c: f(c, w, x), c=0.5)
    assert_right(fun)
    before = compile_count()
    fun.keywords["c"] = 1.7  # the same Partial object, a keyword replaced
    assert_right(fun)
    assert compile_count() == before


def test_python_int_leaf_is_static_by_value():
    """Python ints stay static (a shape, a loop count), keyed by value: equal ones do not recompile."""

    def g(k, w, x):
        return jnp.tanh(x @ w) * jnp.ones((k,)).sum()  # k used as a shape

    assert_right(jax.tree_util.Partial(g, 3))
    before = compile_count()
    assert_right(jax.tree_util.Partial(g, 3))
    assert compile_count() == before
    assert_right(jax.tree_util.Partial(g, 5))


def test_bound_method_keyed_by_instance_and_function():
    """``obj.method`` is a new object at every access: keyed by its instance, it compiles once."""

    class Model:
        def __init__(self, c):
            self.c = c

        def apply(self, w, x):
            return f(self.c, w, x)

    model = Model(1.0)
    assert_right(model.apply)
    before = compile_count()
    assert_right(model.apply)
    assert compile_count() == before
    assert_right(Model(2.0).apply)


def closure(c):
    return lambda w, x: f(c, w, x)


def test_collected_callable_does_not_alias_a_new_one():
    """A fresh closure per step, the previous one dropped: ids are reused by CPython, programs not."""
    for c in (0.5, 1.5, 2.5, 3.5):
        fun = closure(c)
        got = vmcgrad.batched_vjp(fun, W, X, CT, chunk_size=CHUNK)
        assert_tree_allclose(got, references(fun)["batched_vjp"], rtol=1e-12, atol=1e-13)
        del fun, got
        gc.collect()


# --- the NetKet adapter over several VMC steps ----------------------------------------------------


class StatefulRBM(nn.Module):
    """An RBM scaled by a model-state variable: NetKet's ``log_psi`` is then a ``Partial``."""

    @nn.compact
    def __call__(self, x):
        scale = self.variable("consts", "scale", lambda: jnp.asarray(0.7))
        h = nn.Dense(4, param_dtype=jnp.float64, kernel_init=nn.initializers.normal(0.1))(x)
        return scale.value * jnp.sum(jnp.log(jnp.cosh(h)), axis=-1)


@pytest.mark.parametrize(("model", "chunk_size"), [("rbm", 5), ("rbm", "auto"), ("stateful", 5)])
def test_netket_vmc_steps_do_not_recompile(model, chunk_size, netket_mesh):
    """vmcgrad.netket.MCState under nk.driver.VMC with SR on vmcgrad's QGT: after the first step,
    no step compiles anything (the log ψ callable is one object per model, keyed by identity)."""
    g = nk.graph.Chain(6, pbc=True)
    hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
    H = nk.operator.Heisenberg(hi, g)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=2 * jax.device_count())
    net = nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64) if model == "rbm" else StatefulRBM()
    vs = vnk.MCState(sampler, net, n_samples=16 * jax.device_count(), seed=0, chunk_size=chunk_size)
    counts = []
    with warnings.catch_warnings():  # NetKet: fewer samples than parameters for SR (small on purpose)
        warnings.simplefilter("ignore", nk.errors.InsufficientSamplesForSRWarning)
        sr = nk.optimizer.SR(qgt=vnk.QGTOnTheFly, solver=nk.optimizer.solver.cholesky, diag_shift=0.01)
        driver = nk.driver.VMC(H, nk.optimizer.Sgd(0.05), variational_state=vs, preconditioner=sr)
        driver.run(5, callback=lambda *a: counts.append(compile_count()) or True, show_progress=False)
    assert counts[1:] == [counts[1]] * (len(counts) - 1), counts
