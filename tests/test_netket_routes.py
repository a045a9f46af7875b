"""Every NetKet path through ``vmcgrad.netket.MCState(chunk_size=c)`` runs chunked, and equals NetKet.

Each spy test (``netket_spy.Spy`` records the batch sizes the model is run on, at run time) runs a
path twice on the same samples: NetKet's unchunked ``nk.vqs.MCState`` — the spy must see a batch
larger than ``c`` there (the companion check: the spy catches an unchunked path) — and the switch,
where every batch must be at most ``c`` (NetKet's chunked local-value kernels count their chunk in
configurations, connected ones included; vmcgrad's passes differentiate at most ``c``), with
results equal to NetKet's to 1e-10. NetKet's own code on the switch runs chunked too, so batch
sizes cannot tell vmcgrad's route from NetKet's: each test also says which one it expects, and
``netket_spy.vmcgrad_passes`` checks it (a path claimed by vmcgrad binds vmcgrad's chunked pass,
one claimed by NetKet binds none); :func:`test_route_check_catches_a_switch_that_takes_netkets_chunked_path`
is its companion.

Host callbacks deadlock on several fake CPU devices (jax 0.10.2), so the spy tests run on one
device: in the README's test command's second pass (``VMCGRAD_TEST_DEVICES=1 python -m pytest``,
also run by ``.ci/run``); the 4-device pass skips them and runs the rest of this file.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, compiled_names
from jax.sharding import AxisType, Mesh
from netket_spy import Spy, run_and_record, vmcgrad_passes

with jax.set_mesh(None):
    import netket as nk

    import vmcgrad
    import vmcgrad.netket as vnk
    from vmcgrad.netket._netket_chunked import NetKetChunkFallbackError

N_DEV = jax.device_count()
N_CHAINS = 4 * N_DEV
N_SAMPLES = 63 * N_CHAINS  # 252 on one device
CHUNK = 16  # divides neither 252 nor 63; larger than max_conn (9)
RTOL, ATOL = 1e-10, 1e-12

#: The spy's callback (``netket_spy.Spy``) is row-local (its zero, per configuration, multiplies the
#: output), which vmcgrad's row-coupling check cannot decide for a traced ``pure_callback``: its
#: notice is expected here. The module runs in the 1-device pass of the README's command (its spy
#: tests need one device; the 4-device pass skips them).
pytestmark = [
    pytest.mark.one_device_smoke,
    pytest.mark.filterwarnings(r"ignore:vmcgrad. no row-coupling rule for the JAX primitive .pure_callback."),
]

one_device = pytest.mark.skipif(
    N_DEV != 1,
    reason="host callbacks deadlock on several CPU devices; run in the VMCGRAD_TEST_DEVICES=1 pass",
)


@pytest.fixture(autouse=True)
def netket_mesh():
    experimental = nk.config.netket_experimental
    nk.config.netket_experimental = True  # non-hermitian gradients (NETKET_EXPERIMENTAL=1)
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        nk.config.netket_experimental = experimental


# --- systems ---------------------------------------------------------------------------------

GRAPH = nk.graph.Chain(8, pbc=True)
HILBERT = nk.hilbert.Spin(0.5, 8, total_sz=0)
H = nk.operator.Heisenberg(HILBERT, GRAPH)  # a jax operator; max_conn_size 9


def hop():
    """A non-hermitian, Sz-conserving operator: one-way hops |↓↑> -> |↑↓> on the bonds (numba)."""
    m = np.zeros((4, 4))
    m[1, 2] = 0.3
    return sum(nk.operator.LocalOperator(HILBERT, [m], [[i, (i + 1) % 8]]) for i in range(8))


OPERATORS = {
    "heisenberg": lambda: H,
    "heisenberg_numba": lambda: H.to_numba_operator(),
    "hop": hop,
    "hop_jax": lambda: hop().to_jax_operator(),
}

MODELS = {
    "rbm_real": lambda: nk.models.RBM(alpha=1, param_dtype=jnp.float64),
    "rbm_modphase": lambda: nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64),
    "rbm_complex": lambda: nk.models.RBM(alpha=1, param_dtype=jnp.complex128),
}


def states(model_name, spy=True, chunk=CHUNK, budget=None, **kw):
    """(NetKet's unchunked state, the switch at ``chunk``, default CHUNK, and ``budget``): same model,
    seeds, samples."""
    model = MODELS[model_name]()
    model = Spy(model) if spy else model

    def make(cls, **extra):
        sampler = nk.sampler.MetropolisExchange(HILBERT, graph=GRAPH, n_chains=N_CHAINS)
        return cls(sampler, model, n_samples=N_SAMPLES, seed=0, sampler_seed=1, **kw, **extra)

    ref, ours = make(nk.vqs.MCState), make(vnk.MCState, chunk_size=chunk, memory_budget=budget)
    np.testing.assert_array_equal(np.asarray(ours.samples), np.asarray(ref.samples))
    return ref, ours


def assert_stats_equal(got, expected):
    for field in ("mean", "error_of_mean", "variance"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, field)), np.asarray(getattr(expected, field)), rtol=RTOL, atol=ATOL
        )


def assert_routed(ref_fun, our_fun, *, via, bound=CHUNK):
    """NetKet's run exceeds the bound (the spy sees it), ours stays within it and goes ``via``
    ``"vmcgrad"`` (binds vmcgrad's chunked pass) or ``"netket"`` (binds none); returns both results."""
    expected, seen_ref = run_and_record(ref_fun)
    with vmcgrad_passes() as passes:
        got, seen = run_and_record(our_fun)
    assert seen and seen_ref, "the spy recorded nothing"
    assert max(seen_ref) > bound, f"NetKet's unchunked path was not caught: batches {sorted(set(seen_ref))}"
    assert max(seen) <= bound, f"batches {sorted(set(seen))} exceed chunk_size={bound}"
    if via == "vmcgrad":
        assert passes, "the switch did not go through vmcgrad (no vmcgrad chunked pass was traced)"
    else:
        assert not passes, f"a NetKet path went through {len(passes)} vmcgrad passes"
    return got, expected


# --- the spy itself ----------------------------------------------------------------------------


@one_device
def test_spy_records_runs_not_traces():
    """eval_shape traces at full size and records nothing; a pullback that drops the output still records."""
    ref, _ = states("rbm_real")
    sigma = ref.samples.reshape(-1, 8)
    _, seen = run_and_record(lambda: jax.eval_shape(ref.log_value, sigma))
    assert seen == []

    def loss(p):
        return ref._apply_fun({"params": p}, sigma).sum()

    _, seen = run_and_record(jax.grad(loss), ref.parameters)
    assert seen == [N_SAMPLES]


@one_device
def test_spy_catches_a_switch_that_takes_netkets_unchunked_path(monkeypatch):
    """The companion test of the batch bound: a switch whose expect_and_grad is NetKet's and that
    hides its chunk size from NetKet (``chunk_size`` None) runs unchunked, and the bound fails."""
    ref, ours = states("rbm_modphase")
    monkeypatch.setattr(vnk.MCState, "chunk_size", property(lambda self: None))
    monkeypatch.setattr(vnk.MCState, "expect_and_grad", nk.vqs.MCState.expect_and_grad)
    with pytest.raises(AssertionError, match="exceed chunk_size"):
        assert_routed(lambda: ref.expect_and_grad(H), lambda: ours.expect_and_grad(H), via="vmcgrad")


@one_device
@pytest.mark.parametrize("method", ["expect_and_grad", "expect_and_forces"])
def test_route_check_catches_a_switch_that_takes_netkets_chunked_path(monkeypatch, method):
    """The companion test of the route check: a switch whose method is NetKet's runs NetKet's own
    chunked path (at chunk_size 14 <= c, so the batch bound holds and the numbers agree); the
    route check fails, and it passes on the real switch."""
    ref, ours = states("rbm_modphase")
    run, run_ref = getattr(ours, method), getattr(ref, method)
    got, expected = assert_routed(lambda: run_ref(H), lambda: run(H), via="vmcgrad")
    assert_tree_allclose(got[1], expected[1], rtol=RTOL, atol=ATOL)
    monkeypatch.setattr(vnk.MCState, method, getattr(nk.vqs.MCState, method))
    with pytest.raises(AssertionError, match="did not go through vmcgrad"):
        assert_routed(lambda: run_ref(H), lambda: getattr(ours, method)(H), via="vmcgrad")
    theirs, _ = assert_routed(lambda: run_ref(H), lambda: getattr(ours, method)(H), via="netket")
    assert_tree_allclose(theirs[1], expected[1], rtol=RTOL, atol=ATOL)  # same numbers: no tell


# --- expect_and_grad ---------------------------------------------------------------------------


@one_device
@pytest.mark.parametrize(
    ("model_name", "op_name"),
    [
        ("rbm_real", "heisenberg"),
        ("rbm_modphase", "heisenberg"),
        ("rbm_modphase", "heisenberg_numba"),
        ("rbm_complex", "heisenberg"),
    ],
)
def test_expect_and_grad_hermitian(model_name, op_name):
    ref, ours = states(model_name)
    op = OPERATORS[op_name]()
    (stats, grad), (stats_ref, grad_ref) = assert_routed(
        lambda: ref.expect_and_grad(op), lambda: ours.expect_and_grad(op), via="vmcgrad"
    )
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(grad, grad_ref, rtol=RTOL, atol=ATOL)


def netket_nonhermitian_reference(model_name, grad):
    """NetKet's non-hermitian gradient, corrected where NetKet is twice the gradient (see below)."""
    if model_name == "rbm_modphase":
        return jax.tree.map(lambda g: g / 2, grad)
    return grad


@one_device
@pytest.mark.parametrize(
    ("model_name", "op_name", "kw"),
    [
        ("rbm_real", "heisenberg", {"use_covariance": False}),
        ("rbm_modphase", "heisenberg", {"use_covariance": False}),
        ("rbm_complex", "heisenberg_numba", {"use_covariance": False}),
        ("rbm_real", "hop", {}),
        ("rbm_modphase", "hop_jax", {}),
        ("rbm_complex", "hop", {}),
    ],
)
# the local values differentiated here scatter per sample (NetKet's operator kernels), which vmcgrad
# cannot decide under NetKet's jit either: its notice names them beside the spy's callback
@pytest.mark.filterwarnings(
    r"ignore:vmcgrad. no row-coupling rule for the JAX primitives .pure_callback., .scatter., .scatter-add."
)
def test_expect_and_grad_without_covariance(model_name, op_name, kw):
    """Non-hermitian operators and use_covariance=False: NetKet's formula, one chunked vmcgrad pass."""
    ref, ours = states(model_name)
    op = OPERATORS[op_name]()
    (stats, grad), (stats_ref, grad_ref) = assert_routed(
        lambda: ref.expect_and_grad(op, **kw), lambda: ours.expect_and_grad(op, **kw), via="vmcgrad"
    )
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(grad, netket_nonhermitian_reference(model_name, grad_ref), rtol=RTOL, atol=ATOL)


@one_device
@pytest.mark.parametrize("model_name", ["rbm_complex"])
def test_expect_and_grad_squared(model_name):
    ref, ours = states(model_name)
    op = nk.operator.Squared(H)
    (stats, grad), (stats_ref, grad_ref) = assert_routed(
        lambda: ref.expect_and_grad(op), lambda: ours.expect_and_grad(op), via="vmcgrad"
    )
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(grad, grad_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_netket_nonhermitian_gradient_is_twice_the_gradient_for_real_parameters_and_complex_psi():
    """Why :func:`netket_nonhermitian_reference` halves NetKet for RBMModPhase: the exact gradient.

    With exact sampling and many samples both estimators approach the exact gradient of <H>
    (``FullSumState``); NetKet's ``use_covariance=False`` for real parameters and a complex
    log-amplitude approaches twice it (its ``nk.jax.expect`` pullback returns a complex cotangent
    for real parameters, which the outer R→C rule then counts twice), vmcgrad's the gradient itself.
    """
    hi = nk.hilbert.Spin(0.5, 6)
    ham = nk.operator.Ising(hi, nk.graph.Chain(6, pbc=True), h=1.0)
    model = nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64)
    vs = vnk.MCState(nk.sampler.ExactSampler(hi), model, n_samples=50000 * N_DEV, seed=0, chunk_size=4096)
    vs.parameters = jax.tree.map(lambda p: 20 * p + 0.05, vs.parameters)
    exact = nk.vqs.FullSumState(hi, model, variables=vs.variables).expect_and_grad(ham)[1]
    ours = vs.expect_and_grad(ham, use_covariance=False)[1]
    theirs = nk.vqs.MCState.expect_and_grad(vs, ham, use_covariance=False)[1]

    def rel(a):
        a, e = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, exact))
        return np.linalg.norm(a.real - e) / np.linalg.norm(e)

    assert rel(ours) < 0.15, rel(ours)
    assert abs(rel(theirs) - 1) < 0.15, rel(theirs)


# --- expect_and_forces, local_estimators, expect --------------------------------------------------


@one_device
@pytest.mark.parametrize(
    ("model_name", "op_name"),
    [
        ("rbm_real", "heisenberg"),
        ("rbm_modphase", "heisenberg"),
        ("rbm_modphase", "hop"),
        ("rbm_complex", "hop_jax"),
    ],
)
def test_expect_and_forces(model_name, op_name):
    """F = (1/N) Σ conj(O_i)(L_i − L̄), NetKet's dtypes (complex for RBMModPhase), hermitian or not."""
    ref, ours = states(model_name)
    op = OPERATORS[op_name]()
    (stats, force), (stats_ref, force_ref) = assert_routed(
        lambda: ref.expect_and_forces(op), lambda: ours.expect_and_forces(op), via="vmcgrad"
    )
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(force, force_ref, rtol=RTOL, atol=ATOL)
    # the public function, on NetKet's own state
    _, force2 = vnk.expect_and_forces(ref, op, chunk_size=CHUNK)
    assert_tree_allclose(force2, force_ref, rtol=RTOL, atol=ATOL)


@one_device
@pytest.mark.parametrize("op_name", ["heisenberg_numba"])
def test_local_estimators_and_expect(op_name):
    ref, ours = states("rbm_modphase")
    op = OPERATORS[op_name]()
    got, expected = assert_routed(
        lambda: ref.local_estimators(op).data, lambda: ours.local_estimators(op).data, via="netket"
    )
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    got, expected = assert_routed(lambda: ref.expect(op), lambda: ours.expect(op), via="netket")
    assert_stats_equal(got, expected)


def _local_values(state, op):
    return state.local_estimators(op).data


def _local_chunk_spy(monkeypatch):
    """Records each choice of the local values' chunk: ``(candidates, compile_at, budget, chunk)``."""
    from vmcgrad.netket import _local_values

    made = []

    def choose(key, n, compile_at, budget, *, candidates, **kw):
        chunk = _local_values_choose(key, n, compile_at, budget, candidates=candidates, **kw)
        made.append((list(candidates), compile_at, budget, chunk))
        return chunk

    _local_values_choose = _local_values.choose_chunk
    monkeypatch.setattr(_local_values, "choose_chunk", choose)
    return made


@one_device
def test_local_estimators_auto_on_an_accelerator_take_the_fewest_trips_that_fit(monkeypatch):
    """chunk_size="auto" priced for a TPU: the local values run in one pass of every sample's
    connected configurations where it fits (the default budget), equal to NetKet's, and the run
    compiles nothing beyond the candidates (it reuses the chosen one's executable); priced for a CPU
    (the companion), at the gradient's chunk, as before. A jax operator and a numba one (one test:
    the 1-device pass runs each test's first instance only)."""
    made = _local_chunk_spy(monkeypatch)
    for op_name in ("heisenberg", "heisenberg_numba"):
        ref, ours = states("rbm_modphase", chunk="auto")
        op = OPERATORS[op_name]()
        made.clear()
        gradient_chunk = ours._chunk()
        expected, _ = run_and_record(functools.partial(_local_values, ref, op))
        with vmcgrad.cost_platform("cpu"):
            got, seen = run_and_record(functools.partial(_local_values, ours, op))
        assert not made and max(seen) <= gradient_chunk, (op_name, made, sorted(set(seen)), gradient_chunk)
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
        with vmcgrad.cost_platform("tpu"):
            with compiled_names() as names:
                got, seen = run_and_record(functools.partial(_local_values, ours, op))
            with compiled_names() as again:
                got2, _ = run_and_record(functools.partial(_local_values, ours, op))
        candidates, _, _, chunk = made[0]
        assert [m[3] for m in made] == [chunk]  # (the second call finds it cached: no search)
        configurations = N_SAMPLES * 9  # (max_conn_size 9: each sample's connected ones, padded)
        assert candidates[0] == gradient_chunk and candidates[-2] < configurations <= candidates[-1]
        assert chunk == candidates[-1] and max(seen) == configurations, (op_name, chunk, sorted(set(seen)))
        assert names.count("jit(_local_estimators_impl)") == 1, (op_name, names)
        assert "jit(_local_estimators_impl)" not in again, (op_name, again)
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(got2, got)


@one_device
@pytest.mark.parametrize(
    ("method", "program"),
    [("expect_and_grad", "jit(_expect_and_grad_step)"), ("expect_and_forces", "jit(_forces_step)")],
)
def test_a_step_auto_on_an_accelerator_runs_the_local_values_in_fewest_trips(monkeypatch, method, program):
    """The same choice inside ``expect_and_grad`` (VMC's step) and ``expect_and_forces`` (TDVP's),
    each one program of the local values and a pass over the samples: priced for a TPU the local
    values run in one pass of every sample's connected configurations where it fits (the default
    budget), the pass at the gradient's chunk, the candidates being that program's own, and the run
    compiling nothing beyond them; priced for a CPU (the companion), the local values at the
    gradient's chunk, as before. Both equal NetKet's energy and gradient (force)."""
    made = _local_chunk_spy(monkeypatch)
    op = OPERATORS["heisenberg"]()
    ref, ours = states("rbm_modphase", chunk="auto")
    gradient_chunk = ours._chunk()
    (stats_ref, grad_ref), _ = run_and_record(lambda: getattr(ref, method)(op))
    with vmcgrad.cost_platform("cpu"):
        (stats, grad), seen = run_and_record(lambda: getattr(ours, method)(op))
    assert not made and max(seen) <= gradient_chunk, (made, sorted(set(seen)), gradient_chunk)
    assert_tree_allclose(grad, grad_ref, rtol=RTOL, atol=ATOL)
    with vmcgrad.cost_platform("tpu"):
        with compiled_names() as names:
            (stats, grad), seen = run_and_record(lambda: getattr(ours, method)(op))
        with compiled_names() as again:
            (_, grad2), _ = run_and_record(lambda: getattr(ours, method)(op))
    ((candidates, _, _, chunk),) = made  # (the second call finds it cached: no search)
    configurations = N_SAMPLES * 9  # (max_conn_size 9: each sample's connected ones, padded)
    assert candidates[0] == gradient_chunk and candidates[-2] < configurations <= candidates[-1]
    assert chunk == candidates[-1] and max(seen) == configurations, (chunk, sorted(set(seen)))
    # one candidate compiled (one pass fits), the step's own program, and the run reused it
    assert names.count(program) == 1, names
    assert "jit(_local_estimators_impl)" not in names, names
    assert program not in again, again
    np.testing.assert_allclose(stats.mean, stats_ref.mean, rtol=RTOL, atol=ATOL)
    assert_tree_allclose(grad, grad_ref, rtol=RTOL, atol=ATOL)
    assert_tree_allclose(grad2, grad, rtol=0)


@one_device
def test_local_estimators_auto_on_an_accelerator_within_a_tight_budget(monkeypatch):
    """Where one pass is over the budget, the largest doubling of the gradient's chunk whose compiled
    program fits it is taken (the next one is over), and the model never runs on more
    configurations than that chunk at once."""
    op = OPERATORS["heisenberg"]()
    budget = 2**19  # (512 KiB: the gradient's chunk 128 fits; one pass, about 0.9 MiB, does not)
    ref, ours = states("rbm_modphase", chunk="auto", budget=budget)
    made = _local_chunk_spy(monkeypatch)
    expected, _ = run_and_record(lambda: ref.local_estimators(op).data)
    with vmcgrad.cost_platform("tpu"):
        got, seen = run_and_record(lambda: ours.local_estimators(op).data)
    ((candidates, compile_at, used, chunk),) = made
    i = candidates.index(chunk)
    assert used == budget and 0 < i < len(candidates) - 1, (candidates, chunk)
    assert vmcgrad.program_bytes(compile_at(chunk)) <= budget < vmcgrad.program_bytes(compile_at(2 * chunk))
    assert max(seen) <= chunk, (chunk, sorted(set(seen)))
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# --- drivers: VMC_SR, VMC + SR with NetKet's QGT -------------------------------------------------

VMC_SR_MODES = [(False, False), (True, False), (True, True)]


def vmc_sr_update(vstate, use_ntk, on_the_fly, **kw):
    driver = nk.driver.VMC_SR(
        H,
        optax.sgd(0.01),
        diag_shift=0.01,
        variational_state=vstate,
        use_ntk=use_ntk,
        on_the_fly=on_the_fly,
        **kw,
    )
    return driver, lambda: driver.compute_loss_and_update()


@one_device
@pytest.mark.filterwarnings("ignore:.*largest divisor:UserWarning")
@pytest.mark.parametrize(("use_ntk", "on_the_fly"), VMC_SR_MODES)
def test_vmc_sr_update_matches_netket(use_ntk, on_the_fly):
    """VMC_SR's step on the switch equals NetKet's on the same samples; local energies at c, and
    NetKet's Jacobian / NTK at the chunk_size_bwd it reads from vstate.chunk_size: 14, the largest
    divisor of the 252 samples per device at most c (the NTK on the fly needs one)."""
    ref, ours = states("rbm_modphase")
    _, ref_step = vmc_sr_update(ref, use_ntk, on_the_fly)
    driver, our_step = vmc_sr_update(ours, use_ntk, on_the_fly)
    assert driver.chunk_size_bwd == 14
    (stats_ref, dp_ref), seen_ref = run_and_record(ref_step)
    (stats, dp), seen = run_and_record(our_step)
    assert_stats_equal(stats, stats_ref)
    assert_tree_allclose(dp, dp_ref, rtol=1e-8, atol=1e-10)
    assert max(seen_ref) > CHUNK
    if on_the_fly:  # NetKet's srt_onthefly differentiates all local samples at once (documented)
        assert max(seen) == N_SAMPLES  # and 32 rows for its mean-Jacobian estimate
        assert max(set(seen) - {N_SAMPLES, 32}) == 14, sorted(set(seen))  # its NTK columns
    else:
        assert max(seen) <= CHUNK, sorted(set(seen))


def test_vmc_sr_keeps_a_users_chunk_size_bwd():
    _, ours = states("rbm_real", spy=False)
    driver, _ = vmc_sr_update(ours, True, False, chunk_size_bwd=7)
    assert driver.chunk_size_bwd == 7
    assert ours.chunk_size == 14  # what NetKet's code reads: the largest divisor of 252 at most c


def test_vmc_sr_divisor_warns_once():
    import warnings

    from vmcgrad.netket import _netket_chunked

    _netket_chunked._warned.clear()
    sampler = nk.sampler.MetropolisExchange(HILBERT, graph=GRAPH, n_chains=N_CHAINS)
    ours = vnk.MCState(sampler, MODELS["rbm_real"](), n_samples=N_SAMPLES, seed=0, chunk_size=20)
    n = N_SAMPLES // N_DEV  # 252; 18 divides it
    with pytest.warns(
        UserWarning,
        match=f"runs at chunk size 18, the largest divisor of the {n} samples per device at most chunk_size=20",  # noqa: E501
    ):
        vmc_sr_update(ours, True, True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*largest divisor")
        vmc_sr_update(ours, True, True)


@one_device
@pytest.mark.parametrize("qgt", ["QGTJacobianDense", "QGTJacobianPyTree"])
def test_sr_with_netkets_qgt_is_chunked(qgt):
    """nk.optimizer.SR with NetKet's own QGT, built from the switch, runs chunked (at 14, the chunk
    size the state reports to NetKet's code)."""
    ref, ours = states("rbm_modphase")
    _, grad = ref.expect_and_grad(H)
    sr = nk.optimizer.SR(
        qgt=getattr(nk.optimizer.qgt, qgt), solver=nk.optimizer.solver.cholesky, diag_shift=0.01
    )
    got, expected = assert_routed(lambda: sr(ref, grad), lambda: sr(ours, grad), via="netket")
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)


@one_device
@pytest.mark.filterwarnings("ignore:.*largest divisor:UserWarning")
def test_sr_with_netkets_qgt_onthefly_runs_at_a_divisor():
    """nk.optimizer.SR with NetKet's QGTOnTheFly, built from the switch: its chunked S @ v needs a
    divisor of the samples per device, 14 (the largest divisor of 252 at most c); equal to NetKet."""
    ref, ours = states("rbm_modphase")
    _, grad = ref.expect_and_grad(H)
    sr = nk.optimizer.SR(
        qgt=nk.optimizer.qgt.QGTOnTheFly, solver=nk.optimizer.solver.cholesky, diag_shift=0.01
    )
    expected, seen_ref = run_and_record(lambda: sr(ref, grad))
    with vmcgrad_passes() as passes:
        got, seen = run_and_record(lambda: sr(ours, grad))
    assert max(seen_ref) == N_SAMPLES and max(seen) == 14, (sorted(set(seen_ref)), sorted(set(seen)))
    assert not passes  # NetKet's own QGT
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)


CG_TIGHT = functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-13, maxiter=2000)


@one_device
@pytest.mark.parametrize(
    "solver",
    [CG_TIGHT, nk.optimizer.solver.cholesky],
    ids=["cg", "cholesky"],
)
def test_vmcgrad_sr_default_qgt_is_vmcgrads(solver):
    """``vmcgrad.netket.SR()`` (NetKet's SR, its QGT defaulting to vmcgrad's) on the switch: the QGT
    is vmcgrad's, chunked at c, with the iterative and the dense solver; equal to NetKet's default
    ``SR()`` (QGTAuto: QGTOnTheFly for cg, QGTJacobianDense for cholesky) on the unchunked state.
    (cg at 1e-13: NetKet's default tolerance, 1e-5, would bound the difference only through S's
    condition number.) The defaults are NetKet's: cg, and the QGT vmcgrad's ``QGTAuto``."""
    default = vnk.SR()
    assert default.solver is jax.scipy.sparse.linalg.cg and isinstance(default.qgt_constructor, vnk.QGTAuto)
    ref, ours = states("rbm_modphase")
    _, grad = ref.expect_and_grad(H)
    sr = vnk.SR(solver=solver, diag_shift=0.01)
    assert isinstance(sr, nk.optimizer.SR)
    got, expected = assert_routed(
        lambda: nk.optimizer.SR(solver=solver, diag_shift=0.01)(ref, grad),
        lambda: sr(ours, grad),
        via="vmcgrad",
    )
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)


@one_device
@pytest.mark.parametrize("solver", [CG_TIGHT, nk.optimizer.solver.cholesky], ids=["cg", "cholesky"])
def test_vmcgrad_sr_at_auto_keeps_the_linearisation_through_a_solve(solver):
    """With ``chunk_size="auto"`` and a budget that holds them, the solve linearises every chunk once
    and the iterative solver's products run no forward pass, as NetKet's unchunked ``QGTOnTheFly``:
    the model runs once per chunk for the whole CG solve. The companion: at an integer chunk (no
    budget decides, ``kept_solve`` None) it runs once per chunk per product. A dense solver builds
    the matrix and nothing else: the linearisation it does not use is not run. The update equals
    NetKet's SR on the unchunked state."""
    ref, _ = states("rbm_modphase")
    model = Spy(MODELS["rbm_modphase"]())
    sampler = nk.sampler.MetropolisExchange(HILBERT, graph=GRAPH, n_chains=N_CHAINS)
    kw = dict(n_samples=N_SAMPLES, seed=0, sampler_seed=1)
    auto = vnk.MCState(sampler, model, chunk_size="auto", memory_budget=2**30, **kw)
    _, grad = ref.expect_and_grad(H)
    sr = vnk.SR(solver=solver, diag_shift=0.01, solver_restart=True)
    expected, _ = run_and_record(nk.optimizer.SR(solver=solver, diag_shift=0.01), ref, grad)
    chunk = sr.lhs_constructor(auto, sr.diag_shift).qgt.kept_solve  # the kept solve's (a power of two)
    chunks = -(-N_SAMPLES // chunk)
    fixed = vnk.MCState(sampler, model, chunk_size=chunk, **kw)
    lhs = {name: sr.lhs_constructor(vs, sr.diag_shift) for name, vs in [("auto", auto), ("fixed", fixed)]}
    assert lhs["auto"].qgt.kept_solve == chunk and lhs["fixed"].qgt.kept_solve is None
    got, seen = run_and_record(lambda: lhs["auto"].solve(solver, grad)[0])
    recomputed, seen_fixed = run_and_record(lambda: lhs["fixed"].solve(solver, grad)[0])
    assert chunks > 1 and len(seen) == chunks and max(seen) <= chunk, seen  # once per chunk in all
    if solver is CG_TIGHT:
        assert len(seen_fixed) > 10 * chunks and max(seen_fixed) <= chunk, seen_fixed  # per product
    else:
        assert len(seen_fixed) == chunks
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)
    assert_tree_allclose(recomputed, expected, rtol=1e-9, atol=1e-11)


@one_device
@pytest.mark.filterwarnings("ignore:.*largest divisor:UserWarning")
def test_netkets_default_sr_on_the_switch_stays_netkets():
    """vmcgrad does not patch NetKet: ``nk.optimizer.SR()`` on the switch runs NetKet's own QGT
    (chunked at the divisor the state reports), as documented."""
    ref, ours = states("rbm_modphase")
    _, grad = ref.expect_and_grad(H)
    sr = nk.optimizer.SR(solver=nk.optimizer.solver.cholesky, diag_shift=0.01)
    got, expected = assert_routed(lambda: sr(ref, grad), lambda: sr(ours, grad), via="netket")
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.heavy
def test_qgt_auto_chooses_vmcgrads_on_mc_states_and_netkets_otherwise():
    """``vmcgrad.netket.QGTAuto``: vmcgrad's operator on an MCState (the switch or NetKet's),
    keyword arguments passed on; NetKet's QGTAuto on a FullSumState."""
    ref, ours = states("rbm_real", spy=False)
    for vs in (ours, ref):
        S = vnk.QGTAuto(nk.optimizer.solver.cholesky, diag_shift=0.01)(vs)
        assert isinstance(S, vnk.QGTOnTheFlyT) and S.diag_shift == 0.01
    full = nk.vqs.FullSumState(HILBERT, MODELS["rbm_real"](), seed=0)
    S = vnk.QGTAuto()(full, diag_shift=0.01)
    assert isinstance(S, nk.optimizer.LinearOperator) and not isinstance(S, vnk.QGTOnTheFlyT)


@one_device
def test_tdvp_with_vmcgrad_qgt_auto_runs_vmcgrads_qgt():
    """``nkx.driver.TDVP(..., qgt=vmcgrad.netket.QGTAuto())`` on the switch: the QGT of each step is
    vmcgrad's, chunked at c; the trajectory equals NetKet's TDVP with its QGTAuto, unchunked (both
    with a shift: S is singular here and an unshifted solve amplifies round-off)."""
    import netket.experimental as nkx

    qgts = []

    def run(vs, qgt):
        te = nkx.driver.TDVP(H, vs, nkx.dynamics.Euler(dt=1e-3), qgt=qgt, linear_solver=CG_TIGHT)
        te.run(T=2e-3, show_progress=False)
        qgts.append(te._last_qgt)
        return vs.parameters

    ref, ours = states("rbm_modphase")
    expected, seen_ref = run_and_record(lambda: run(ref, nk.optimizer.qgt.QGTAuto(diag_shift=1e-2)))
    got, seen = run_and_record(lambda: run(ours, vnk.QGTAuto(diag_shift=1e-2)))
    assert not isinstance(qgts[0], vnk.QGTOnTheFlyT) and isinstance(qgts[1], vnk.QGTOnTheFlyT)
    assert max(seen_ref) > CHUNK >= max(seen), (sorted(set(seen_ref)), sorted(set(seen)))
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-11)


def test_netket_qgt_onthefly_on_the_switch_takes_a_divisor_per_device():
    """NetKet's QGTOnTheFly from the switch (c = 16 divides neither 63 nor the samples per device):
    the same matrix as QGTJacobianDense, on every device count, announced once; a chunk size the
    user passes to it is NetKet's, unchanged (NetKet's own divisibility error)."""
    from vmcgrad.netket import _netket_chunked

    ref, ours = states("rbm_real", spy=False)
    dense = nk.optimizer.qgt.QGTJacobianDense(ref, diag_shift=0.01).to_dense()
    _netket_chunked._warned.clear()
    n = N_SAMPLES // N_DEV
    with pytest.warns(UserWarning, match=f"runs at chunk size 14, the largest divisor of the {n} samples"):
        S = nk.optimizer.qgt.QGTOnTheFly(ours, diag_shift=0.01)
    np.testing.assert_allclose(S.to_dense(), dense, rtol=1e-10, atol=1e-12)
    v = jax.tree.map(jnp.ones_like, ours.parameters)
    with pytest.raises(ValueError, match="divisible by chunk_size"):
        nk.optimizer.qgt.QGTOnTheFly(ours, chunk_size=CHUNK, diag_shift=0.01) @ v


# --- refusals: never an unchunked fallback -------------------------------------------------------


def test_mutable_model_with_a_chunk_size_is_refused():
    _, ours = states("rbm_real", spy=False, mutable=True)
    for call in (lambda: ours.expect_and_grad(H), lambda: ours.expect_and_forces(H)):
        with pytest.raises(NotImplementedError, match=r"mutable collections.*Fix: chunk_size=None"):
            call()


def test_netket_fallback_is_refused():
    """An observable NetKet has no chunked kernel for: an error, not an unchunked run (also where
    chunk_size="auto" chooses the local values' chunk, priced for a TPU)."""
    _, ours = states("rbm_real", spy=False)

    class Unchunked(nk.operator._abstract_observable.AbstractObservable):
        @property
        def dtype(self):
            return jnp.float64

    @nk.vqs.expect.dispatch
    def _(vstate: nk.vqs.MCState, op: Unchunked, chunk_size: None):  # only an unchunked implementation
        return nk.vqs.expect(vstate, H, None)

    with pytest.raises(NetKetChunkFallbackError, match="would run it unchunked"):
        ours.expect(Unchunked(HILBERT))
    # (chunk_size="auto" priced for an accelerator looks for NetKet's chunked local kernel first)
    _, auto = states("rbm_real", spy=False, chunk="auto")
    with vmcgrad.cost_platform("tpu"), pytest.raises(NetKetChunkFallbackError, match="would run it"):
        auto.local_estimators(Unchunked(HILBERT))
    with pytest.warns(UserWarning, match="Ignoring chunk_size=14"):  # NetKet's own method, unchunked
        theirs = nk.vqs.MCState.expect(ours, Unchunked(HILBERT))
    np.testing.assert_allclose(theirs.mean, ours.expect(H).mean, rtol=1e-12)


def test_auto_chunk_halves_once_after_out_of_memory_in_the_netket_adapter(monkeypatch):
    """``chunk_size="auto"`` in ``vmcgrad.netket.expect_and_grad``: the core's OOM rule — an eager step
    that runs out of memory is retried once at half the chunk, with a warning, and the smaller chunk
    is kept for the next call (simulated: the jitted step fails above 8 rows per chunk)."""
    import warnings

    import netket as nk

    import vmcgrad.netket as vnk
    from vmcgrad.netket import _expect_grad

    hi = nk.hilbert.Spin(0.5, 4)
    H = nk.operator.Ising(hi, nk.graph.Chain(4), h=1.0)
    vs = nk.vqs.MCState(
        nk.sampler.MetropolisLocal(hi, n_chains=4), nk.models.RBM(alpha=1), n_samples=32, seed=0
    )
    expected = vs.expect_and_grad(H)
    real_step, chunks = _expect_grad._expect_and_grad_step, []

    def step(kernel, apply_fun, chunk_size, *args):
        chunks.append(chunk_size)
        if chunk_size > 8:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")
        return real_step(kernel, apply_fun, chunk_size, *args)

    monkeypatch.setattr(_expect_grad, "_expect_and_grad_step", step)
    monkeypatch.setattr(_expect_grad, "auto_chunk_size", lambda vstate, sigma: 16)
    monkeypatch.setattr(_expect_grad, "_SHRUNK", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats, grad = vnk.expect_and_grad(vs, H, chunk_size="auto")
        vnk.expect_and_grad(vs, H, chunk_size="auto")  # remembered: 8 at once
    assert chunks == [16, 8, 8]
    assert any("out of memory at chunk_size=16" in str(w.message) for w in caught)
    np.testing.assert_allclose(stats.mean, expected[0].mean, rtol=1e-10)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(expected[1])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
