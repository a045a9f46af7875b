"""vmcgrad.netket against NetKet's own unchunked results (float64), on 4 fake devices and on 1.

NetKet is imported with the context mesh cleared (its import sets a global mesh that must not leak
into other test files); every test here runs under NetKet's mesh (one Auto axis "S" over all
devices), set by an autouse fixture, as it would be after a plain ``import netket``.
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, compile_count
from jax.sharding import AxisType, Mesh

with jax.set_mesh(None):
    import netket as nk

    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
N_CHAINS = 4 * N_DEV
N_SAMPLES = 63 * N_CHAINS  # 252 samples per device on 4 devices, 1008 on 1
CHUNK = 37  # divides neither 252 nor 1008
RTOL, ATOL = 1e-10, 1e-12


def test_netket_sees_the_test_devices():
    assert os.environ["NETKET_EXPERIMENTAL_SHARDING_CPU"] == str(N_DEV)
    assert jax.device_count() == N_DEV
    vs = nk.vqs.MCState(*system("heisenberg_chain")[1:2], nk.models.RBM(), n_samples=N_SAMPLES, seed=0)
    assert vs.samples.sharding.mesh.shape == {"S": N_DEV}
    assert vs.samples.shape[0] == N_CHAINS


@pytest.fixture(autouse=True)
def netket_mesh():
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        yield


# --- systems and models -----------------------------------------------------------------------


def system(name):
    """Returns (hamiltonian, sampler) for a small system."""
    if name == "heisenberg_chain":
        g = nk.graph.Chain(8, pbc=True)
        hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
        return nk.operator.Heisenberg(hi, g), nk.sampler.MetropolisExchange(hi, graph=g, n_chains=N_CHAINS)
    if name == "heisenberg_square":
        g = nk.graph.Square(3, pbc=True)  # 9 sites: no total_sz constraint
        hi = nk.hilbert.Spin(0.5, g.n_nodes)
        return nk.operator.Heisenberg(hi, g), nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS)
    if name == "ising_chain":
        g = nk.graph.Chain(8, pbc=True)
        hi = nk.hilbert.Spin(0.5, g.n_nodes)
        return nk.operator.Ising(hi, g, h=1.0), nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS)
    if name == "ising_square":
        g = nk.graph.Square(3, pbc=True)
        hi = nk.hilbert.Spin(0.5, g.n_nodes)
        return nk.operator.Ising(hi, g, h=1.0), nk.sampler.MetropolisLocal(hi, n_chains=N_CHAINS)
    raise ValueError(name)


class StatefulRBM(nn.Module):
    """An RBM whose output is scaled by a non-trainable model-state variable."""

    @nn.compact
    def __call__(self, x):
        scale = self.variable("consts", "scale", lambda: jnp.asarray(0.7))
        h = nn.Dense(8, param_dtype=jnp.float64, kernel_init=nn.initializers.normal(0.1))(x)
        return scale.value * jnp.sum(jnp.log(jnp.cosh(h)), axis=-1)


def model(name):
    if name == "rbm_real":
        return nk.models.RBM(alpha=1, param_dtype=jnp.float64)
    if name == "rbm_modphase":
        return nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64)
    if name == "rbm_complex":
        return nk.models.RBM(alpha=1, param_dtype=jnp.complex128)
    if name == "mlp":
        return nk.models.MLP(hidden_dims=(12, 6), param_dtype=jnp.float64, hidden_activations=nn.tanh)
    if name == "stateful":
        return StatefulRBM()
    raise ValueError(name)


MODELS = ["rbm_real", "rbm_modphase", "rbm_complex", "mlp"]
SYSTEMS = ["heisenberg_chain", "ising_square"]


def make_state(model_name, system_name, cls=nk.vqs.MCState, seed=0, **kw):
    H, sampler = system(system_name)
    return H, cls(sampler, model(model_name), n_samples=N_SAMPLES, seed=seed, sampler_seed=seed + 1, **kw)


# --- expect_and_grad --------------------------------------------------------------------------


def assert_stats_equal(got, expected):
    for field in ("mean", "error_of_mean", "variance", "tau_corr", "R_hat"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, field)), np.asarray(getattr(expected, field)), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("system_name", SYSTEMS)
@pytest.mark.parametrize("model_name", MODELS)
def test_expect_and_grad_matches_netket(model_name, system_name):
    H, vs = make_state(model_name, system_name)
    expected_stats, expected_grad = vs.expect_and_grad(H)  # NetKet, unchunked, same vs.samples
    for chunk in (CHUNK, None):
        stats, grad = vnk.expect_and_grad(vs, H, chunk_size=chunk)
        assert_stats_equal(stats, expected_stats)
        assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("model_name", "system_name"), [("rbm_modphase", "heisenberg_square"), ("rbm_complex", "ising_chain")]
)
def test_expect_and_grad_other_lattices(model_name, system_name):
    H, vs = make_state(model_name, system_name)
    expected_stats, expected_grad = vs.expect_and_grad(H)
    stats, grad = vnk.expect_and_grad(vs, H, chunk_size=CHUNK)
    assert_stats_equal(stats, expected_stats)
    assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


def test_numba_operator_and_chunk_sizes():
    """A non-jax (numba) operator goes through NetKet's numba kernel; chunk sizes 1..beyond N."""
    H, vs = make_state("rbm_modphase", "ising_chain")
    H = H.to_local_operator()
    expected_stats, expected_grad = vs.expect_and_grad(H)
    for chunk in (1, 8, 64, 10**6):
        stats, grad = vnk.expect_and_grad(vs, H, chunk_size=chunk)
        assert_stats_equal(stats, expected_stats)
        assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


def test_model_state_is_traced_not_compiled_in():
    H, vs = make_state("stateful", "heisenberg_chain")
    assert "consts" in vs.model_state
    vnk.expect_and_grad(vs, H, chunk_size=CHUNK)  # compile
    vs.model_state = jax.tree.map(lambda s: s * 1.3, vs.model_state)
    before = compile_count()
    stats, grad = vnk.expect_and_grad(vs, H, chunk_size=CHUNK)
    assert compile_count() == before
    expected_stats, expected_grad = vs.expect_and_grad(H)
    assert_stats_equal(stats, expected_stats)
    assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


def test_no_recompilation_across_steps():
    """netket#1229: new parameters and new samples every step, one compilation of the step."""
    H, vs = make_state("rbm_modphase", "heisenberg_chain")
    vnk.expect_and_grad(vs, H, chunk_size=CHUNK)
    for _ in range(3):
        vs.parameters = jax.tree.map(lambda p: p * 0.99, vs.parameters)
        vs.sample()  # compiled on the first step: not counted below
        before = compile_count()
        jax.block_until_ready(vnk.expect_and_grad(vs, H, chunk_size=CHUNK))
        assert compile_count() == before
    # a second state with an equal model and operator reuses the same program
    H2, vs2 = make_state("rbm_modphase", "heisenberg_chain", seed=5)
    vs2.samples  # noqa: B018
    before = compile_count()
    jax.block_until_ready(vnk.expect_and_grad(vs2, H2, chunk_size=CHUNK))
    assert compile_count() == before


def test_bad_input():
    H, vs = make_state("rbm_real", "heisenberg_chain")
    with pytest.raises(TypeError, match=r"`vstate` must be a netket\.vqs\.MCState"):
        vnk.expect_and_grad(object(), H)
    with pytest.raises(TypeError, match="`operator` must be a netket AbstractOperator"):
        vnk.expect_and_grad(vs, nk.operator.Squared(H))
    with pytest.raises(ValueError, match="`operator` must be hermitian"):
        vnk.expect_and_grad(vs, nk.operator.spin.sigmap(vs.hilbert, 0))
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        vnk.expect_and_grad(vs, H, chunk_size=0)
    with pytest.raises(TypeError, match="`chunk_size` must be a positive int"):
        vnk.expect_and_grad(vs, H, chunk_size=2.0)
    H, vs_mut = make_state("stateful", "heisenberg_chain", mutable=True)
    with pytest.raises(ValueError, match="non-mutable model"):
        vnk.expect_and_grad(vs_mut, H)


# --- the driver switch: vmcgrad.netket.MCState --------------------------------------------------


@pytest.mark.parametrize("model_name", ["rbm_modphase", "rbm_complex"])
def test_state_switch_matches_netket(model_name):
    H, ref = make_state(model_name, "heisenberg_chain")
    H, ours = make_state(model_name, "heisenberg_chain", cls=vnk.MCState, chunk_size=CHUNK)
    assert ours.chunk_size is None and ours.vmcgrad_chunk_size == CHUNK
    np.testing.assert_array_equal(np.asarray(ours.samples), np.asarray(ref.samples))
    expected_stats, expected_grad = ref.expect_and_grad(H)
    stats, grad = ours.expect_and_grad(H)
    assert_stats_equal(stats, expected_stats)
    assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)
    # expect (observables in loggers): NetKet's forward-chunked kernels, no divisibility needed
    assert_stats_equal(ours.expect(H), ref.expect(H))
    # the non-hermitian / Squared paths stay NetKet's
    s2, g2 = ours.expect_and_grad(nk.operator.Squared(H))
    s2_ref, g2_ref = ref.expect_and_grad(nk.operator.Squared(H))
    assert_stats_equal(s2, s2_ref)
    assert_tree_allclose(g2, g2_ref, rtol=RTOL, atol=ATOL)


def test_state_switch_bad_chunk_size():
    _, sampler = system("heisenberg_chain")
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        vnk.MCState(sampler, model("rbm_real"), chunk_size=-3)
