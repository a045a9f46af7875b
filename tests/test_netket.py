"""vmcgrad.netket against NetKet's own unchunked results (float64), on 4 fake devices and on 1.

NetKet is imported with the context mesh cleared (its import sets a global mesh that must not leak
into other test files); every test here runs under NetKet's mesh (one Auto axis "S" over all
devices), set by an autouse fixture, as it would be after a plain ``import netket``.
"""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, compile_count

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = [pytest.mark.one_device_smoke, pytest.mark.usefixtures("netket_mesh")]

with jax.set_mesh(None):
    import netket as nk

    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
N_CHAINS = 4 * N_DEV
N_SAMPLES = 63 * N_CHAINS  # 252 samples per device on 4 devices, 1008 on 1
CHUNK = 37  # divides neither 252 nor 1008
RTOL, ATOL = 1e-10, 1e-12


def test_netket_sees_the_test_devices():
    """conftest sets NETKET_EXPERIMENTAL_SHARDING_CPU before NetKet is imported; NetKet read it."""
    assert os.environ["NETKET_EXPERIMENTAL_SHARDING_CPU"] == str(N_DEV)
    assert nk.config.netket_experimental_sharding_cpu == N_DEV
    assert jax.device_count() == N_DEV
    vs = nk.vqs.MCState(*system("heisenberg_chain")[1:2], nk.models.RBM(), n_samples=N_SAMPLES, seed=0)
    assert vs.samples.sharding.mesh.shape == {"S": N_DEV}
    assert vs.samples.shape[0] == N_CHAINS


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


# every model once and every system once: a Heisenberg and an Ising Hamiltonian, on a chain (L=8) and a
# 3x3 square lattice (the operator only sets the local energies; each model's own code runs in each)
CASES = [
    ("rbm_real", "heisenberg_chain"),
    ("rbm_modphase", "ising_chain"),
    ("rbm_complex", "ising_square"),
    ("mlp", "heisenberg_square"),
]


def make_state(model_name, system_name, cls=nk.vqs.MCState, seed=0, **kw):
    H, sampler = system(system_name)
    return H, cls(sampler, model(model_name), n_samples=N_SAMPLES, seed=seed, sampler_seed=seed + 1, **kw)


# --- expect_and_grad --------------------------------------------------------------------------


def assert_stats_equal(got, expected):
    for field in ("mean", "error_of_mean", "variance", "tau_corr", "R_hat"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, field)), np.asarray(getattr(expected, field)), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize(("model_name", "system_name"), CASES)
def test_expect_and_grad_matches_netket(model_name, system_name):
    H, vs = make_state(model_name, system_name)
    expected_stats, expected_grad = vs.expect_and_grad(H)  # NetKet, unchunked, same vs.samples
    stats, grad = vnk.expect_and_grad(vs, H, chunk_size=CHUNK)
    assert_stats_equal(stats, expected_stats)
    assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.heavy
def test_numba_operator_and_chunk_sizes():
    """A non-jax (numba) operator goes through NetKet's numba kernel; chunk sizes 1..beyond N (a chunk
    over N plans one chunk, as None does: vmcgrad._chunks.plan.plan_chunks)."""
    H, vs = make_state("rbm_modphase", "ising_chain")
    H = H.to_local_operator()
    expected_stats, expected_grad = vs.expect_and_grad(H)
    for chunk in (1, 8, 10**6):
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
    from vmcgrad.netket import _netket_chunked

    _netket_chunked._warned.clear()  # the warning is once per process
    n = ours.n_samples_per_rank
    divisor = max(d for d in range(1, CHUNK + 1) if n % d == 0)
    with pytest.warns(UserWarning, match=f"runs at chunk size {divisor}, the largest divisor"):
        assert ours.chunk_size == divisor and ours.vmcgrad_chunk_size == CHUNK  # NetKet's code: d
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


@pytest.mark.heavy
def test_chunk_size_auto():
    """chunk_size="auto" in the switch, the function and the QGT: NetKet's unchunked numbers."""
    H, ref = make_state("rbm_modphase", "heisenberg_chain")
    H, ours = make_state("rbm_modphase", "heisenberg_chain", cls=vnk.MCState, chunk_size="auto")
    expected_stats, expected_grad = ref.expect_and_grad(H)
    for stats, grad in (ours.expect_and_grad(H), vnk.expect_and_grad(ref, H, chunk_size="auto")):
        assert_stats_equal(stats, expected_stats)
        assert_tree_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)
    assert_stats_equal(ours.expect(H), ref.expect(H))
    dense = nk.optimizer.qgt.QGTJacobianDense(ref).to_dense()
    np.testing.assert_allclose(
        vnk.QGTOnTheFly(ours, chunk_size="auto").to_dense(), dense, rtol=1e-10, atol=1e-12
    )


def test_state_switch_bad_chunk_size():
    _, sampler = system("heisenberg_chain")
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        vnk.MCState(sampler, model("rbm_real"), chunk_size=-3)


# --- QGTOnTheFly ------------------------------------------------------------------------------

QGT_CASES = [
    ("rbm_real", None, None),
    ("rbm_modphase", None, 0.1),
    ("rbm_complex", True, None),
    ("rbm_complex", False, 0.1),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("model_name", "holomorphic", "diag_scale"), QGT_CASES)
def test_qgt_to_dense_matches_jacobian_dense(model_name, holomorphic, diag_scale):
    """Same matrix as QGTJacobianDense in NetKet's mode ('real', 'complex' split re/im, 'holomorphic')."""
    _, vs = make_state(model_name, "heisenberg_chain")
    kw = dict(diag_shift=0.01, diag_scale=diag_scale, holomorphic=holomorphic)
    ref = nk.optimizer.qgt.QGTJacobianDense(vs, **kw)
    ours = vnk.QGTOnTheFly(vs, chunk_size=CHUNK, **kw)
    assert isinstance(ours, nk.optimizer.LinearOperator)
    dense = ours.to_dense()
    np.testing.assert_allclose(dense, ref.to_dense(), rtol=RTOL, atol=ATOL)
    v = jax.tree.map(
        lambda p: jnp.cos(jnp.arange(p.size).reshape(p.shape) + 0.5).astype(p.dtype), vs.parameters
    )
    assert_tree_allclose(ours @ v, ref @ v, rtol=1e-9, atol=ATOL)
    if diag_scale is not None:
        np.testing.assert_allclose(ours.diagonal(), jnp.diag(dense), rtol=RTOL, atol=ATOL)
    else:  # NetKet's `+` adds to the shift in force (with diag_scale, to the scale)
        np.testing.assert_allclose((ours + 0.5).to_dense(), (ref + 0.5).to_dense(), rtol=RTOL, atol=ATOL)


def solver(name):
    if name == "cg":
        return functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-14, maxiter=2000)
    if name == "gmres":
        return functools.partial(jax.scipy.sparse.linalg.gmres, tol=1e-14, restart=200, maxiter=20)
    return {"cholesky": nk.optimizer.solver.cholesky, "pinv_smooth": nk.optimizer.solver.pinv_smooth}[name]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("model_name", "holomorphic", "solver_name"),
    [
        ("rbm_modphase", None, "cholesky"),
        ("rbm_modphase", None, "cg"),
        ("rbm_modphase", None, "gmres"),
        ("rbm_complex", False, "pinv_smooth"),
        ("rbm_complex", False, "cg"),
    ],
)
def test_sr_update_matches_jacobian_dense(model_name, holomorphic, solver_name):
    """NetKet's SR preconditioner: QGTJacobianDense vs vmcgrad's QGTOnTheFly (partial application)."""
    H, vs = make_state(model_name, "heisenberg_chain")
    _, grad = vs.expect_and_grad(H)
    kw = dict(solver=solver(solver_name), diag_shift=0.01, holomorphic=holomorphic)
    ref = nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTJacobianDense, **kw)
    ours = nk.optimizer.SR(qgt=vnk.QGTOnTheFly(chunk_size=CHUNK), **kw)
    assert_tree_allclose(ours(vs, grad), ref(vs, grad), rtol=1e-8, atol=1e-10)
    assert isinstance(ours._lhs, vnk.QGTOnTheFlyT)


def test_qgt_takes_the_state_chunk_size():
    _, vs = make_state("rbm_real", "heisenberg_chain", cls=vnk.MCState, chunk_size=CHUNK)
    assert vnk.QGTOnTheFly(vs).qgt.chunk_size == CHUNK
    assert vnk.QGTOnTheFly(vs, chunk_size=5).qgt.chunk_size == 5
    with pytest.raises(TypeError, match=r"`vstate` must be a netket\.vqs\.MCState"):
        vnk.QGTOnTheFly(object())


# --- drivers ------------------------------------------------------------------------------------


def run_vmc(cls, n_iter, model_name="rbm_modphase", qgt=None, out=None, callback=None, **kw):
    H, vs = make_state(model_name, "heisenberg_chain", cls=cls, **kw)
    sr = nk.optimizer.SR(qgt=qgt, solver=nk.optimizer.solver.cholesky, diag_shift=0.01)
    driver = nk.driver.VMC(H, nk.optimizer.Sgd(0.05), variational_state=vs, preconditioner=sr)
    driver.run(n_iter, out=out, callback=callback or (lambda *a: True), show_progress=False)
    return vs, driver


def test_vmc_sr_trajectory_matches_netket():
    """10 VMC+SR steps, same seeds and sampler: the parameters follow NetKet's to 1e-8."""
    ref, _ = run_vmc(nk.vqs.MCState, 10, qgt=nk.optimizer.qgt.QGTJacobianDense)
    ours, _ = run_vmc(vnk.MCState, 10, qgt=vnk.QGTOnTheFly, chunk_size=CHUNK)
    assert_tree_allclose(ours.parameters, ref.parameters, rtol=1e-8, atol=1e-10)


def test_driver_loggers_and_callbacks_unchanged(tmp_path):
    seen = []

    def callback(step, log_data, driver):
        seen.append((step, float(log_data["Energy"].mean.real)))
        return True

    _, driver = run_vmc(
        vnk.MCState, 3, qgt=vnk.QGTOnTheFly, chunk_size=CHUNK, out=str(tmp_path / "run"), callback=callback
    )
    assert [s for s, _ in seen] == [0, 1, 2] and driver.step_count == 3
    data = json.loads((tmp_path / "run.log").read_text())
    np.testing.assert_allclose(np.asarray(data["Energy"]["Mean"]["real"]), [e for _, e in seen], rtol=1e-12)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`ExactSampler.reset\\(\\)`:UserWarning")  # NetKet's, about its own state
def test_heisenberg_chain_12_reaches_the_exact_energy():
    """VMC+SR with the switch and exact sampling: the exact energy of the final state within 1e-3.

    NetKet's Heisenberg applies the Marshall sign rule on a bipartite chain (its default), so a
    real RBM suffices; the seeds are fixed (about 3e-4 relative error after 35 steps).
    """
    import optax

    g = nk.graph.Chain(12, pbc=True)
    hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
    H = nk.operator.Heisenberg(hi, g)
    vs = vnk.MCState(
        nk.sampler.ExactSampler(hi),
        nk.models.RBM(alpha=1, param_dtype=jnp.float64),
        n_samples=1024,
        seed=1,
        sampler_seed=2,
        chunk_size=100,
    )
    sr = nk.optimizer.SR(qgt=vnk.QGTOnTheFly, solver=nk.optimizer.solver.cholesky, diag_shift=0.01)
    opt = nk.optimizer.Sgd(optax.linear_schedule(0.05, 0.01, 35))
    nk.driver.VMC(H, opt, variational_state=vs, preconditioner=sr).run(35, show_progress=False)
    psi = vs.to_array()
    energy = float(jnp.vdot(psi, H.to_sparse() @ psi).real)
    exact = -21.5495636696
    assert abs(energy - exact) / abs(exact) < 1e-3, energy


def test_state_serialization_keeps_the_chunk_size():
    from flax import serialization

    _, vs = make_state("rbm_real", "heisenberg_chain", cls=vnk.MCState, chunk_size=CHUNK)
    state = serialization.to_state_dict(vs)
    assert state["vmcgrad_chunk_size"] == CHUNK and state["chunk_size"] is None
    _, other = make_state("rbm_real", "heisenberg_chain", cls=vnk.MCState, chunk_size=5, seed=3)
    restored = serialization.from_state_dict(other, state)
    assert type(restored) is vnk.MCState and restored.vmcgrad_chunk_size == CHUNK
    assert restored._chunk_size is None  # NetKet's own chunk size stays unset
    assert_tree_allclose(restored.parameters, vs.parameters, rtol=0)


def test_state_copies_keep_both_chunk_sizes_without_resolving_auto():
    """Serialisation and _replace_model (NetKet's code that copies vstate.chunk_size) store NetKet's
    own chunk size and vmcgrad's, and read chunk_size="auto" without resolving it (no sampling)."""
    from flax import serialization

    _, vs = make_state("rbm_real", "heisenberg_chain", cls=vnk.MCState, chunk_size="auto")
    vs.reset()
    state = serialization.to_state_dict(vs)
    new = vs._replace_model(vs.model, variables=vs.variables)
    assert vs._samples is None, "reading the chunk size sampled the state"
    assert state["chunk_size"] is None and state["vmcgrad_chunk_size"] == "auto"
    assert type(new) is vnk.MCState and new.vmcgrad_chunk_size == "auto" and new._chunk_size is None
    assert vs.vmcgrad_chunk_size == "auto"  # restored after the copies
    _, both = make_state("rbm_real", "heisenberg_chain", cls=vnk.MCState, chunk_size=5, netket_chunk_size=8)
    new = both._replace_model(both.model, variables=both.variables)
    assert (new.vmcgrad_chunk_size, new._chunk_size, new.chunk_size) == (5, 8, 8)
