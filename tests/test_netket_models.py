"""NetKet's own models through the switch: expect_and_grad, expect_and_forces and QGTOnTheFly @ v.

Each model, on a small system, against NetKet's unchunked ``nk.vqs.MCState`` on the same samples
(float64, 1e-10; the QGT product against ``QGTJacobianDense``), on the suite's devices.
``LogStateVector`` (equinox runtime checks: a ``lax.cond`` on data) is among them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

with jax.set_mesh(None):
    import netket as nk

    import vmcgrad.netket as vnk

pytestmark = pytest.mark.usefixtures("netket_mesh")

N_DEV = jax.device_count()
N_CHAINS = 4 * N_DEV
N_SAMPLES = 24 * N_CHAINS
CHUNK = 5  # divides neither 96 nor 24
RTOL, ATOL = 1e-10, 1e-12


def spin_chain():
    g = nk.graph.Chain(4, pbc=True)
    hi = nk.hilbert.Spin(0.5, 4)
    return g, hi, nk.operator.Ising(hi, g, h=1.0), nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS)


def fermions():
    g = nk.graph.Chain(4, pbc=True)
    hi = nk.hilbert.SpinOrbitalFermions(4, n_fermions=2)
    cdag, c = nk.operator.fermion.create, nk.operator.fermion.destroy
    ham = sum(-(cdag(hi, i) @ c(hi, j) + cdag(hi, j) @ c(hi, i)) for i, j in g.edges())
    ham = ham + 0.5 * sum(cdag(hi, i) @ c(hi, i) @ cdag(hi, j) @ c(hi, j) for i, j in g.edges())
    sampler = nk.sampler.MetropolisFermionHop(hi, graph=g, n_chains=N_CHAINS)
    return hi, ham, sampler


def particles():
    import netket.experimental as nkx

    hi = nkx.hilbert.Particle(N=2, geometry=nkx.geometry.Cell(d=1, L=2.0, pbc=True))
    kinetic = nk.operator.KineticEnergy(hi, mass=1.0)
    potential = nk.operator.PotentialEnergy(hi, lambda x: jnp.sum(jnp.cos(np.pi * x)))
    return hi, kinetic + potential, nk.sampler.MetropolisGaussian(hi, sigma=0.1, n_chains=N_CHAINS)


def case(name):
    """Returns (hamiltonian, sampler, model)."""
    f64 = jnp.float64
    if name == "Slater2nd":
        hi, ham, sampler = fermions()
        return ham, sampler, nk.models.Slater2nd(hi, param_dtype=f64)
    if name == "DeepSetRelDistance":
        hi, ham, sampler = particles()
        model = nk.models.DeepSetRelDistance(
            hilbert=hi,
            cusp_exponent=None,
            layers_phi=2,
            layers_rho=2,
            features_phi=(4, 4),
            features_rho=(4, 1),
        )
        return ham, sampler, model
    g, hi, ham, sampler = spin_chain()
    if name == "ARNNDense":
        return (
            ham,
            nk.sampler.ARDirectSampler(hi),
            nk.models.ARNNDense(hi, layers=2, features=4, param_dtype=f64),
        )
    models = {
        "RBM": lambda: nk.models.RBM(alpha=1, param_dtype=f64),
        "RBMModPhase": lambda: nk.models.RBMModPhase(alpha=1, param_dtype=f64),
        "RBMSymm": lambda: nk.models.RBMSymm(g.translation_group(), alpha=1, param_dtype=f64),
        "GCNN": lambda: nk.models.GCNN(g, layers=1, features=2, param_dtype=f64),
        "Jastrow": lambda: nk.models.Jastrow(param_dtype=f64),
        "MLP": lambda: nk.models.MLP(hidden_dims=(6,), param_dtype=f64),
        "LogStateVector": lambda: nk.models.LogStateVector(hi, param_dtype=f64),
    }
    return ham, sampler, models[name]()


MODELS = [
    "RBM",
    "RBMModPhase",
    "RBMSymm",
    "GCNN",
    "Jastrow",
    "MLP",
    "LogStateVector",
    "ARNNDense",
    "Slater2nd",
    "DeepSetRelDistance",
]


def states(name):
    ham, sampler, model = case(name)

    def make(cls, **kw):
        return cls(sampler, model, n_samples=N_SAMPLES, seed=0, sampler_seed=1, **kw)

    ref, ours = make(nk.vqs.MCState), make(vnk.MCState, chunk_size=CHUNK)
    np.testing.assert_array_equal(np.asarray(ours.samples), np.asarray(ref.samples))
    return ham, ref, ours


def assert_stats_equal(got, expected):
    np.testing.assert_allclose(np.asarray(got.mean), np.asarray(expected.mean), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(got.variance), np.asarray(expected.variance), rtol=RTOL, atol=ATOL)


QUANTITIES = ("expect_and_grad", "expect_and_forces", "qgt_matmul")
#: Every model with two of the three quantities, in turn, so every quantity meets 6-7 of the 10 models
#: (the quantities share the switch's route, and a model's own code runs in each). Listed so that the
#: quick tier's covering subset (tests/conftest.py: each value of `quantity` once, in collection order)
#: takes each quantity on a different model (the first three); the rest tier runs the other pairs.
PAIRS = [(m, QUANTITIES[(i + k) % len(QUANTITIES)]) for k in range(2) for i, m in enumerate(MODELS)]


def test_pairs_cover_every_model_twice_and_every_quantity():
    assert [sum(m == name for m, _ in PAIRS) for name in MODELS] == [2] * len(MODELS)
    assert all(sum(q == name for _, q in PAIRS) >= 6 for name in QUANTITIES)
    assert [q for _, q in PAIRS[: len(QUANTITIES)]] == list(QUANTITIES)


@pytest.mark.quick_cover("quantity")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name, quantity", PAIRS, ids=[f"{m}-{q}" for m, q in PAIRS])
def test_switch_matches_netket(name, quantity):
    """The switched state's expect_and_grad, expect_and_forces, or QGTOnTheFly @ v (against
    QGTJacobianDense), equal to NetKet's unchunked state's on the same samples."""
    ham, ref, ours = states(name)
    if quantity == "qgt_matmul":
        v = jax.tree.map(
            lambda p: jnp.cos(jnp.arange(p.size).reshape(p.shape) + 0.5).astype(p.dtype), ref.parameters
        )
        expected = nk.optimizer.qgt.QGTJacobianDense(ref, diag_shift=0.01) @ v
        got = vnk.QGTOnTheFly(ours, diag_shift=0.01) @ v
        assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)
        return
    stats_ref, value_ref = getattr(ref, quantity)(ham)
    stats, value = getattr(ours, quantity)(ham)
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(value, value_ref, rtol=RTOL, atol=ATOL)
