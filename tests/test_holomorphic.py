"""Holomorphic declarations: ``holomorphic=True`` on a non-holomorphic model never gives a wrong S.

Before: ``vmcgrad.QGT(holomorphic=True)`` on a model with a ``conj`` term applied a matrix 1.9e-2
away from the correct complex-mode S (its centring assumes :math:`O v` complex-linear), silently.
Now ``vmcgrad.QGT`` refuses it, and ``vmcgrad.netket.QGTOnTheFly`` (a drop-in for NetKet's) warns
and applies the 'complex' matrix, as NetKet's ``QGTOnTheFly(holomorphic=True)`` does. A holomorphic
model is proved so from its jaxpr (no numerical work); one written through ``slogdet`` (``abs`` and
``sign`` inside) passes the numerical Cauchy–Riemann check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, traced_without_mesh
from jax.flatten_util import ravel_pytree

import vmcgrad
from vmcgrad._checks import holomorphy as _qgt_modes

with jax.set_mesh(None):
    import flax.linen as nn
    import netket as nk
    from netket.optimizer import qgt as nkqgt

    import vmcgrad.netket as vnk

N = 16 * jax.device_count()
P = 6
KEY_W, KEY_X, KEY_V = jax.random.split(jax.random.key(7), 3)
W = (jax.random.normal(KEY_W, (P,)) + 1j * jax.random.normal(jax.random.fold_in(KEY_W, 1), (P,))) * 0.3
X = jnp.sign(jax.random.normal(KEY_X, (N, P)))
V = jax.random.normal(KEY_V, (P,)) + 1j * jax.random.normal(jax.random.fold_in(KEY_V, 1), (P,))


def holo(w, x):
    y = x @ w
    return jnp.log(jnp.cosh(y)) + 0.3 * y**2


def non_holo(w, x):
    y = x @ w
    return jnp.log(jnp.cosh(y)) + 0.3 * jnp.conj(y) * w[0]


def slogdet_holo(w, x):  # log det through slogdet: abs and sign inside, holomorphic overall
    m = jnp.eye(2) + (x[:, :4] * w[:4]).reshape(-1, 2, 2)
    sign, logabs = jnp.linalg.slogdet(m)
    return jnp.log(sign) + logabs + x @ w


def dense_s(fun, w, x, mode):
    """S from jax.jacrev: holomorphic (P x P complex) or complex mode (2P x 2P real)."""
    if mode == "holomorphic":
        o = jax.jacrev(lambda w: fun(w, x), holomorphic=True)(w)
        do = o - o.mean(0)
        return do.conj().T @ do / x.shape[0]
    re = jax.jacfwd(lambda a, b: fun(a + 1j * b, x), argnums=(0, 1))(w.real, w.imag)
    o = jnp.concatenate(re, axis=1)
    do = o - o.mean(0)
    return (do.conj().T @ do).real / x.shape[0]


def complex_mode_product(fun, w, x, v):
    s = dense_s(fun, w, x, "complex")
    r = s @ jnp.concatenate([v.real, v.imag])
    return r[:P] + 1j * r[P:]


@pytest.mark.parametrize("kw", [{"holomorphic": True}, {"mode": "holomorphic"}])
def test_core_refuses_non_holomorphic(kw):
    with pytest.raises(ValueError, match=r"holomorphic.*`conj`.*Cauchy-Riemann.*mode='complex'"):
        vmcgrad.QGT(non_holo, W, X, chunk_size=5, **kw)


def test_core_refuses_under_jit():
    with pytest.raises(ValueError, match="traced inputs"), traced_without_mesh():
        jax.jit(lambda w, x: vmcgrad.QGT(non_holo, w, x, holomorphic=True) @ V)(W, X)


def test_core_complex_mode_is_the_fix():
    S = vmcgrad.QGT(non_holo, W, X, chunk_size=5, mode="complex")
    np.testing.assert_allclose(S @ V, complex_mode_product(non_holo, W, X, V), rtol=1e-12, atol=1e-13)


def test_core_holomorphic_proved_without_numerics(monkeypatch):
    def no_numerics(*args):
        raise AssertionError("the numerical check ran on a model the jaxpr proves holomorphic")

    monkeypatch.setattr(_qgt_modes, "_cauchy_riemann_error", no_numerics)
    S = vmcgrad.QGT(holo, W, X, chunk_size=5, holomorphic=True)
    ref = dense_s(holo, W, X, "holomorphic")
    np.testing.assert_allclose(S.to_dense(), ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(S @ V, ref @ V, rtol=1e-12, atol=1e-13)
    x, _ = S.replace(diag_shift=1e-2).solve(ref @ V + 1e-2 * V, tol=1e-12)
    np.testing.assert_allclose(x, V, rtol=1e-8)
    # and inside jit too (the proof needs no values)
    with traced_without_mesh():
        jitted = jax.jit(lambda w, x: vmcgrad.QGT(holo, w, x, holomorphic=True) @ V)(W, X)
    np.testing.assert_allclose(jitted, ref @ V, rtol=1e-12, atol=1e-13)


def test_core_holomorphic_through_slogdet_passes_numerically():
    assert _qgt_modes.holomorphic_violation(slogdet_holo, W, X) is None
    S = vmcgrad.QGT(slogdet_holo, W, X, chunk_size=5, holomorphic=True)
    ref = dense_s(slogdet_holo, W, X, "holomorphic")
    np.testing.assert_allclose(S @ V, ref @ V, rtol=1e-10, atol=1e-12)


# --- the NetKet adapter against NetKet's QGTOnTheFly -------------------------------------------


class ConjModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1],), jnp.complex128)
        b = self.param("b", nn.initializers.normal(0.3), (3,), jnp.complex128)
        y = x @ w
        return jnp.log(jnp.cosh(y)) + 0.3 * jnp.conj(y) * b[0] + b[1] * y**2


def _vstate(model):
    hi = nk.hilbert.Spin(0.5, 6)
    vs = nk.vqs.MCState(
        nk.sampler.MetropolisLocal(hi, n_chains=4 * jax.device_count()), model, n_samples=N, seed=1
    )
    vs.sample()
    return vs


def _tree(vs, seed):
    leaves, treedef = jax.tree.flatten(vs.parameters)
    keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))
    return treedef.unflatten(
        [
            jax.random.normal(a, p.shape) + 1j * jax.random.normal(b, p.shape)
            for a, b, p in zip(keys[::2], keys[1::2], leaves)
        ]
    )


@pytest.mark.filterwarnings("ignore::UserWarning:netket")
def test_adapter_non_holomorphic_matches_netket_onthefly(netket_mesh):
    vs = _vstate(ConjModel())
    v = _tree(vs, 0)
    theirs = nkqgt.QGTOnTheFly(vs, holomorphic=True, diag_shift=1e-3)
    reference = nkqgt.QGTJacobianDense(vs, holomorphic=False, diag_shift=1e-3)
    with pytest.warns(UserWarning, match="not holomorphic.*mode='complex'") as record:
        ours = vnk.QGTOnTheFly(vs, holomorphic=True, diag_shift=1e-3, chunk_size=5)
    assert ours.mode == "complex"
    assert [w.filename for w in record if "not holomorphic" in str(w.message)] == [__file__]  # the caller's
    assert_tree_allclose(ours @ v, theirs @ v, rtol=1e-11, atol=1e-13)
    assert_tree_allclose(ours @ v, reference @ v, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(ours.to_dense(), reference.to_dense(), rtol=1e-11, atol=1e-13)
    b = reference @ v
    for solver in (
        nk.optimizer.solver.cholesky,
        jax.tree_util.Partial(jax.scipy.sparse.linalg.cg, tol=1e-13),
    ):
        x_ours, _ = ours.solve(solver, b)
        assert_tree_allclose(x_ours, v, rtol=1e-8, atol=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning:netket")
def test_adapter_holomorphic_model_unchanged(netket_mesh, recwarn):
    vs = _vstate(nk.models.RBM(alpha=1, param_dtype=complex))
    v = _tree(vs, 1)
    ours = vnk.QGTOnTheFly(vs, holomorphic=True, diag_shift=1e-3, chunk_size=5)
    assert not [w for w in recwarn if "vmcgrad" in str(w.message)]
    assert ours.mode == "holomorphic"
    reference = nkqgt.QGTJacobianDense(vs, holomorphic=True, diag_shift=1e-3)
    assert_tree_allclose(ours @ v, reference @ v, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(ours.to_dense(), reference.to_dense(), rtol=1e-11, atol=1e-13)
    assert ravel_pytree(ours @ v)[0].shape == ravel_pytree(v)[0].shape
