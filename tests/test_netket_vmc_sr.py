"""``vmcgrad.netket.VMC_SR``: NetKet's ``VMC_SR`` driver with vmcgrad's sample-space update.

Equal to ``nk.driver.VMC_SR`` over three steps (same seeds, same samples, parameters to 1e-10 in float64)
with the NTK dense and on the fly, SPRING momentum, real and complex modes, at a chunk size that
divides nothing (N = 30 per device; the other modes are compared with NetKet's update functions in
test_ntk.py); route-tested: vmcgrad's chunked primitive is bound and NetKet's ``srt`` /
``srt_onthefly`` are never called. The default tier runs the real, dense-NTK, SPRING driver (route
and equality in one test: every program here is small, the cost is compilation); the ``slow`` tier adds
the complex on-the-fly driver, ``chunk_size_bwd="auto"`` and the matrix-free CG driver.
"""

import warnings

import jax
import numpy as np
import optax
import pytest
from helpers import DriftingDevice, assert_tree_allclose
from netket_spy import vmcgrad_passes

with jax.set_mesh(None):
    import netket as nk
    from netket._src.driver import vmc_sr as nk_vmc_sr

    import vmcgrad
    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
N_SAMPLES = 30 * N_DEV
CHUNK = 7  # divides neither the 30 samples per device nor N

# NetKet's divisor notice and holomorphic checks are expected; the README command's 1-device pass
# runs this module's first instances (tests/conftest.py).
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.one_device_smoke,
    pytest.mark.usefixtures("netket_mesh"),
]


def _states(dtype):
    hi = nk.hilbert.Spin(0.5, 6)
    model = nk.models.RBM(alpha=1, param_dtype=dtype)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * N_DEV)
    kw = dict(n_samples=N_SAMPLES, seed=3, sampler_seed=4)
    ref = nk.vqs.MCState(sampler, model, **kw)
    ours = vnk.MCState(sampler, model, chunk_size=CHUNK, **kw)
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)
    return H, ref, ours


def _drivers(dtype, **kw):
    H, ref, ours = _states(dtype)
    args = dict(diag_shift=1e-3, use_ntk=True, linear_solver=nk.optimizer.solver.solve, **kw)
    a = nk.driver.VMC_SR(H, optax.sgd(0.02), variational_state=ref, **args)
    b = vnk.VMC_SR(H, optax.sgd(0.02), variational_state=ours, **args)
    return a, b


def _refuse_netket_kernels(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("NetKet's sample-space SR kernel was called")

    for name in ("srt", "srt_onthefly", "sr"):
        monkeypatch.setattr(nk_vmc_sr, name, refuse)


@pytest.mark.parametrize(
    "dtype,kw",
    [
        (np.float64, dict(on_the_fly=False, momentum=0.8, proj_reg=1.0)),
        pytest.param(np.complex128, dict(on_the_fly=True), marks=pytest.mark.slow),
    ],
    ids=["real-dense-spring", "complex-onthefly"],
)
def test_equals_netket_vmc_sr_over_steps(monkeypatch, dtype, kw):
    """vmcgrad's driver first, with NetKet's kernels refused and vmcgrad's passes recorded (the route),
    then NetKet's own driver on the same seeds."""
    ref, ours = _drivers(dtype, **kw)
    _refuse_netket_kernels(monkeypatch)
    with vmcgrad_passes() as passes:
        ours.run(3, out=None, show_progress=False)
    assert passes, "vmcgrad's chunked primitive was not bound"
    assert all(p.n == N_SAMPLES for p in passes)
    monkeypatch.undo()
    ref.run(3, out=None, show_progress=False)
    assert_tree_allclose(ours.state.parameters, ref.state.parameters, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ours._loss_stats.mean, ref._loss_stats.mean, rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [CHUNK, "auto"])
def test_routed_through_vmcgrad_not_netket(monkeypatch, chunk):
    _refuse_netket_kernels(monkeypatch)
    H, _, ours = _states(np.float64)
    drv = vnk.VMC_SR(
        H, optax.sgd(0.02), diag_shift=1e-3, variational_state=ours, use_ntk=True, chunk_size_bwd=chunk
    )
    with vmcgrad_passes() as passes:
        drv.run(1, out=None, show_progress=False)
    assert passes, "vmcgrad's chunked primitive was not bound"
    assert all(p.n == N_SAMPLES for p in passes)
    if chunk == "auto":
        assert all(isinstance(p.chunk_size, int) for p in passes)


def test_auto_chunk_draws_no_samples_until_the_first_step():
    """``chunk_size="auto"`` is resolved without drawing samples: NetKet's ``VMC_SR`` reads the state's
    ``chunk_size`` when it is built, and a draw there advanced the chains, so that vmcgrad's first step
    ran on other samples than NetKet's at the same seed (its first energy differed). The stand-in it
    is resolved on (each chain's configuration) gives the chunk the drawn samples give, and one step
    equals NetKet's driver on the same seeds."""
    from vmcgrad.netket import _nk_private as nkp

    H, ref, _ = _states(np.float64)
    kw = dict(n_samples=N_SAMPLES, seed=3, sampler_seed=4)
    ours = vnk.MCState(ref.sampler, ref.model, memory_budget=2**20, **kw)
    args = dict(diag_shift=1e-3, use_ntk=True, linear_solver=nk.optimizer.solver.solve, on_the_fly=False)
    a = nk.driver.VMC_SR(H, optax.sgd(0.02), variational_state=ref, **args)
    b = vnk.VMC_SR(H, optax.sgd(0.02), variational_state=ours, **args)
    chosen = ours.chunk_size
    assert nkp.drawn_samples(ours) is None, "building the driver drew samples"
    b.run(1, out=None, show_progress=False)
    a.run(1, out=None, show_progress=False)
    np.testing.assert_array_equal(ours.samples, ref.samples)
    assert ours.chunk_size == chosen  # on the drawn samples, as on the stand-in
    np.testing.assert_allclose(b._loss_stats.mean, a._loss_stats.mean, rtol=1e-12)
    assert_tree_allclose(ours.parameters, ref.parameters, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_matrix_free_cg_equals_dense():
    H, ref_state, ours = _states(np.float64)
    del ref_state
    H2, _, ours2 = _states(np.float64)
    a = vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=1e-2, variational_state=ours, use_ntk=True)
    b = vnk.VMC_SR(
        H2, optax.sgd(0.02), diag_shift=1e-2, variational_state=ours2, use_ntk=True, linear_solver="cg"
    )
    a.run(2, out=None, show_progress=False)
    b.run(2, out=None, show_progress=False)
    # CG to a relative residual 1e-10 on a kernel of condition <= (||T|| + 1e-2)/1e-2
    assert_tree_allclose(b.state.parameters, a.state.parameters, rtol=0, atol=1e-7)


def test_bad_arguments():
    H, _, ours = _states(np.float64)
    with pytest.raises(ValueError, match="linear_solver"):
        vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=1e-3, variational_state=ours, linear_solver="lu")
    with pytest.raises(TypeError, match="chunk_size"):
        vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=1e-3, variational_state=ours, chunk_size_bwd=2.5)


def _fullsum_setup(model):
    """NetKet's own test_vmc_ngd.py::test_fullsum_vmc_vs_vmcsr problem: the 2x2 Ising model, h = 1."""
    lattice = nk.graph.Square(2, max_neighbor_order=2)
    hi = nk.hilbert.Spin(s=1 / 2, N=lattice.n_nodes, inverted_ordering=False)
    H = nk.operator.Ising(hilbert=hi, graph=lattice, h=1.0)
    return H, nk.vqs.FullSumState(hilbert=hi, model=model, seed=0)


FULLSUM_MODELS = {
    "RBM(complex128)": lambda: nk.models.RBM(
        param_dtype=np.complex128,
        kernel_init=jax.nn.initializers.normal(stddev=0.02),
        hidden_bias_init=jax.nn.initializers.normal(stddev=0.02),
        use_visible_bias=False,
    ),
    "RBMModPhase": lambda: nk.models.RBMModPhase(),
}


@pytest.mark.parametrize("momentum", [None, 0.9], ids=["", "momentum"])
@pytest.mark.parametrize("name", list(FULLSUM_MODELS))
def test_fullsum_state_equals_vmc_with_sr_and_netket_vmc_sr(name, momentum):
    """NetKet's test_fullsum_vmc_vs_vmcsr with vmcgrad's driver: on a FullSumState it runs the exact
    parameter-space update, equal to ``nk.driver.VMC`` + ``nk.optimizer.SR`` (Cholesky) and to NetKet's
    ``VMC_SR`` over 5 steps, to 1e-10 (float64; the same dense solve)."""
    solver = nk.optimizer.solver.cholesky
    runs = []
    for kind in ("vmc+sr", "netket", "vmcgrad"):
        H, vstate = _fullsum_setup(FULLSUM_MODELS[name]())
        opt = nk.optimizer.Sgd(learning_rate=0.035)
        if kind == "vmc+sr":
            sr = nk.optimizer.SR(diag_shift=0.1, solver=solver)
            drv = nk.driver.VMC(H, opt, variational_state=vstate, preconditioner=sr)
        else:
            cls = nk.driver.VMC_SR if kind == "netket" else vnk.VMC_SR
            kw = {} if momentum is None else {"momentum": momentum}
            drv = cls(H, opt, variational_state=vstate, diag_shift=0.1, linear_solver=solver, **kw)
        log = nk.logging.RuntimeLog()
        drv.run(n_iter=5, out=log, show_progress=False)
        runs.append((vstate.parameters, np.asarray(log.data["Energy"]["Mean"])))
    (p_vmc, e_vmc), (p_nk, e_nk), (p_ours, e_ours) = runs
    assert len(e_ours) == 5
    assert_tree_allclose(p_ours, p_nk, rtol=0, atol=1e-10)
    np.testing.assert_allclose(e_ours, e_nk, rtol=0, atol=1e-10)
    if momentum is None:  # VMC + SR has no momentum
        assert_tree_allclose(p_ours, p_vmc, rtol=1e-7, atol=1e-10)
        np.testing.assert_allclose(e_ours, e_vmc, rtol=0, atol=1e-10)
    assert not np.allclose(e_ours[0], e_ours[-1])  # it did move


def test_fullsum_state_with_use_ntk_is_refused_in_vmcgrads_words():
    H, vstate = _fullsum_setup(nk.models.RBMModPhase())
    with pytest.raises(ValueError, match=r"vmcgrad.netket.VMC_SR: use_ntk=True needs a sampled state"):
        vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=0.1, variational_state=vstate, use_ntk=True)


@pytest.mark.slow
def test_a_budget_alone_chooses_every_chunk_within_it():
    """``vmcgrad.netket.MCState(memory_budget=B)`` with no chunk size runs ``chunk_size="auto"`` within B,
    and ``VMC_SR`` on it takes the same budget for its kernel's blocks: each program it runs (the
    gradient pass, the sample-space update on the route the rule takes within B) compiles to at most B
    bytes per device, and at this tight B some pass is chunked below the samples per device."""
    import vmcgrad
    from vmcgrad.netket._expect_grad import log_psi

    H, _, _ = _states(np.float64)
    hi = H.hilbert
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * N_DEV)
    # (per device: with 4 devices the update's kernel over all 120 samples is chunked at 640 KiB; on
    # one, 30 samples' programs all fit 64 KiB whole, and 32 KiB chunks a pass)
    budget = 640 * 2**10 if N_DEV > 1 else 32 * 2**10
    vs = vnk.MCState(sampler, nk.models.RBM(alpha=2), n_samples=N_SAMPLES, seed=3, memory_budget=budget)
    assert vs.vmcgrad_chunk_size == "auto" and vs.vmcgrad_memory_budget == budget
    drv = vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=1e-3, variational_state=vs, use_ntk=True)
    assert drv.chunk_size_bwd == "auto" and drv._memory_budget == budget
    with vmcgrad_passes() as passes:
        drv.run(1, out=None, show_progress=False)
    chunks = {p.chunk_size for p in passes}
    assert chunks and all(isinstance(c, int) for c in chunks) and min(chunks) < N_SAMPLES // N_DEV, chunks
    logpsi = log_psi(vs._apply_fun, vs.model_state)
    x = jax.lax.collapse(vs.samples, 0, vs.samples.ndim - 1)
    e = vs.local_estimators(H).reshape(-1)
    grad = vmcgrad.lower(
        vmcgrad.expect_grad, logpsi, vs.parameters, x, e, chunk_size="auto", memory_budget=budget
    )
    assert vmcgrad.program_bytes(grad.compile()) <= budget

    def update(w, x, e):
        return vmcgrad.minsr_update(
            logpsi, w, x, e, diag_shift=1e-3, chunk_size="auto", memory_budget=budget, mode=str(drv.mode)
        )[0]

    assert vmcgrad.program_bytes(jax.jit(update).lower(vs.parameters, x, e).compile()) <= budget


def test_netkets_own_step_is_said_once():
    """``use_ntk=False`` runs NetKet's own P×P step: one VmcgradWarning per process (the package's
    one once-only mechanism, ``_netket_chunked.warn_once``), however many steps run."""
    from vmcgrad.netket import _netket_chunked

    H, _, ours = _states(np.float64)
    drv = vnk.VMC_SR(H, optax.sgd(0.02), diag_shift=1e-2, variational_state=ours, use_ntk=False)
    _netket_chunked._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drv.run(3, out=None, show_progress=False)
    said = [w for w in caught if "runs NetKet's own parameter-space SR step" in str(w.message)]
    assert len(said) == 1 and issubclass(said[0].category, vmcgrad.VmcgradWarning), said


def _compilations(run):
    """``{program name: backend compilations}`` while ``run()`` runs (JAX's compile events)."""
    found: dict = {}

    def listen(event, duration, fun_name="?", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            found[fun_name] = found.get(fun_name, 0) + 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return found


def test_the_first_step_compiles_the_update_once():
    """The automatic choice compiles its candidates of the update (``jit(_update_program)``), and the
    first step runs the chosen one: no compilation of the update, none of the driver's
    ``jit(_update)`` around it (which compiled the same program again: 33 s and 35 s on the TPU v5e
    host, benchmarks/results/device-tpu-v5e-2026-12-07d). SPRING's second step (its momentum buffer
    now an argument) compiles that program once more, as the jitted driver update did; both runs
    take the same steps (parameters to 1e-10 after three)."""
    from vmcgrad.netket import _vmc_sr

    def driver():
        H, _, _ = _states(np.float64)
        sampler = nk.sampler.MetropolisLocal(H.hilbert, n_chains=2 * N_DEV)
        kw = dict(n_samples=N_SAMPLES, seed=3, sampler_seed=4, memory_budget=2**20)
        vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), chunk_size="auto", **kw)
        kw = dict(diag_shift=1e-3, momentum=0.8, use_ntk=True)
        return vnk.VMC_SR(H, optax.sgd(0.02), variational_state=vs, **kw)

    ours = driver()
    search = _compilations(lambda: ours.route_at(ours.state.n_samples))
    # the candidates (routes, their chunks), each counted in the choice's record
    assert search.get("jit(_update_program)", 0) == ours.route_choice_at(ours.state.n_samples).compiled >= 1
    first = _compilations(lambda: ours.run(1, out=None, show_progress=False))
    assert "jit(_update_program)" not in first and "jit(_update)" not in first, first
    more = _compilations(lambda: ours.run(2, out=None, show_progress=False))
    assert more.get("jit(_update_program)") == 1 and "jit(_update)" not in more, more

    ref = driver()  # the driver's update traced inside jax.jit, as before
    ref._run_update = lambda args, static: _vmc_sr._update(*args, **static)
    ref.run(3, out=None, show_progress=False)
    assert_tree_allclose(ours.state.parameters, ref.state.parameters, rtol=1e-10, atol=1e-12)


def test_the_sr_phase_runs_only_the_updates_programs(monkeypatch):
    """Beyond the local energies and their statistics (NetKet's, stubbed here with one step's), a
    step's SR phase runs two programs: the update's jitted preparation and its compiled program. The
    samples are taken to rows and the hyperparameters to arrays inside the preparation, not by eager
    ops of their own (each an op in sequence, and on a TPU host a dispatch: ``jit(reshape)`` and
    ``jit(stage)``, compiled once per shape; the SR phase measured 1.17x NetKet's at N = 256,
    benchmarks/results/device-tpu-v5e-2026-12-07e). With JAX's caches emptied after a first step,
    what a second step compiles is what it runs (the update's program is compiled again by its
    choice's lookup; its executable is the driver's)."""
    H, _, _ = _states(np.float64)
    sampler = nk.sampler.MetropolisLocal(H.hilbert, n_chains=2 * N_DEV)
    vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), n_samples=N_SAMPLES, seed=3, sampler_seed=4)
    kw = dict(diag_shift=1e-3, proj_reg=1.0, momentum=0.8, use_ntk=True)
    driver = vnk.VMC_SR(H, optax.sgd(0.02), variational_state=vs, **kw)
    driver.run(2, out=None, show_progress=False)  # (the momentum's buffer an argument from step 2)
    local = vs.local_estimators(H)
    stats, online = nk.stats.statistics(local), driver._loss_stats_online
    monkeypatch.setattr(vs, "local_estimators", lambda *a, **k: local)
    monkeypatch.setattr(nk.stats, "statistics", lambda *a, **k: stats)
    monkeypatch.setattr(nk.stats, "online_statistics", lambda *a, **k: online)
    before = driver._dp
    jax.clear_caches()
    compiled = _compilations(driver.compute_loss_and_update)
    assert set(compiled) <= {"jit(prepare)", "jit(_update_program)"}, compiled
    assert compiled.get("jit(prepare)") == 1, compiled
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(driver._dp)))


def test_steps_where_the_memory_in_use_moves_search_nothing_again(monkeypatch, caplog):
    """On a GPU or TPU the default budget is half the free memory, which moves from step to step.
    It is read once per device: priced for a TPU at the default budgets, the first step makes every
    choice (the route, the update's chunk, the gradient's and the local values' chunks) and the
    next two compile nothing and search nothing (no candidate logged). Read at every call, each step
    searched again, and within one choice the chunk search and the lookup of its record saw two
    budgets (AttributeError: 'NoneType' object has no attribute 'value')."""
    import logging

    from vmcgrad._chunks import default_budget

    device = DriftingDevice(limit=2**33)
    monkeypatch.setattr(default_budget, "_first_device", lambda: device)
    default_budget._READ.clear()  # (each device read again: this one first)
    H, _, _ = _states(np.float64)
    sampler = nk.sampler.MetropolisLocal(H.hilbert, n_chains=2 * N_DEV)
    kw = dict(n_samples=N_SAMPLES, seed=3, sampler_seed=4)
    vs = vnk.MCState(sampler, nk.models.RBM(alpha=1), chunk_size="auto", **kw)
    driver = vnk.VMC_SR(H, optax.sgd(0.02), variational_state=vs, diag_shift=1e-3, use_ntk=True)
    with vmcgrad.cost_platform("tpu"), caplog.at_level(logging.DEBUG, logger="vmcgrad"):
        first = _compilations(lambda: driver.run(1, out=None, show_progress=False))
        searched = len(caplog.records)
        later = _compilations(lambda: driver.run(2, out=None, show_progress=False))
    assert first.get("jit(_update_program)", 0) >= 1 and searched >= 1, (first, searched)
    assert "jit(_update_program)" not in later and "jit(_local_estimators_impl)" not in later, later
    assert len(caplog.records) == searched, [r.getMessage() for r in caplog.records[searched:]]
    assert device.reads == 1


@pytest.mark.filterwarnings("ignore::vmcgrad.VmcgradWarning")  # (NetKet's own step is said once)
def test_netkets_own_step_on_an_automatic_chunk_runs_at_the_states_chunk():
    """``use_ntk=False`` on a state with ``chunk_size="auto"``: NetKet's own step reads the driver's
    ``chunk_size_bwd``, which must be an int or None (it was ``"auto"``: a TypeError deep in NetKet's
    chunking); it runs at the state's chosen chunk, and equals NetKet's driver on NetKet's state at
    the same seeds (the energy to 1e-12, parameters to 1e-10)."""
    H, _, _ = _states(np.float64)
    sampler = nk.sampler.MetropolisLocal(H.hilbert, n_chains=2 * N_DEV)
    kw = dict(n_samples=N_SAMPLES, seed=3, sampler_seed=4)
    ours = vnk.MCState(sampler, nk.models.RBM(alpha=1), chunk_size="auto", memory_budget=2**20, **kw)
    ref = nk.vqs.MCState(sampler, nk.models.RBM(alpha=1), **kw)
    args = dict(diag_shift=1e-3, use_ntk=False)
    drv = vnk.VMC_SR(H, optax.sgd(0.02), variational_state=ours, **args)
    assert drv.chunk_size_bwd == ours.chunk_size and isinstance(ours.chunk_size, int)
    theirs = nk.driver.VMC_SR(H, optax.sgd(0.02), variational_state=ref, **args)
    drv.run(1, out=None, show_progress=False)
    theirs.run(1, out=None, show_progress=False)
    np.testing.assert_allclose(drv._loss_stats.mean, theirs._loss_stats.mean, rtol=1e-12)
    assert_tree_allclose(ours.parameters, ref.parameters, rtol=0, atol=1e-10)
