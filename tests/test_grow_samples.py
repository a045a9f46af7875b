"""``vmcgrad.netket.GrowSamples``: the rule that raises N when the energy has settled."""

import math

import numpy as np
import pytest

from vmcgrad.netket._grow import GrowSamples


def _series(drift_per_step, sigma, w=20):
    return list(-10.0 + drift_per_step * np.arange(w)), [sigma] * w


def test_settles_when_the_drift_over_the_window_is_below_one_error_bar():
    rule = GrowSamples(max_samples=4096, window=20)
    # drift 0.4 sigma over the window: settled; 2.5 sigma: still moving
    assert rule.settled(*_series(drift_per_step=0.02 * 0.01, sigma=0.01))
    assert not rule.settled(*_series(drift_per_step=0.125 * 0.01, sigma=0.01))
    # the slope is a least-squares slope: pure noise of one error bar, no drift, is settled
    rng = np.random.default_rng(1)
    noise = list(-10.0 + 0.01 * rng.normal(size=200))
    hits = sum(rule.settled(noise[i : i + 20], [0.01] * 20) for i in range(180))
    # |slope|*W of white noise is normal with std W*sigma/sqrt(W(W^2-1)/12) = 0.78 sigma at W = 20,
    # so about 80 % of windows are within one error bar (a fixed seed; overlapping windows)
    assert hits > 0.6 * 180, hits
    # fewer points than the window, or a non-finite value: no decision
    assert not rule.settled([-1.0] * 19, [0.1] * 19)
    e, s = _series(0.0, 0.01)
    e[3] = math.nan
    assert not rule.settled(e, s)


def test_next_n_is_a_multiple_of_the_granule_and_stops_at_the_maximum():
    rule = GrowSamples(max_samples=3000, factor=2)
    assert rule.next_n(512, granule=16) == 1024
    assert rule.next_n(1024, granule=16) == 2048
    assert rule.next_n(2048, granule=16) == 2992  # min(4096, 3000) rounded down to chains x devices
    assert rule.next_n(2992, granule=16) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_samples=0), "max_samples"),
        (dict(max_samples=True), "max_samples"),
        (dict(max_samples=64, window=2), "window"),
        (dict(max_samples=64, factor=1), "factor"),
        (dict(max_samples=64, tolerance=0.0), "tolerance"),
        (dict(max_samples=64, tolerance=math.inf), "tolerance"),
    ],
)
def test_bad_arguments_are_refused_with_the_name(kwargs, match):
    with pytest.raises(ValueError, match=f"GrowSamples: `{match}`"):
        GrowSamples(**kwargs)


# --- in vmcgrad.netket.VMC_SR ---------------------------------------------------------------------


def _driver(rule, **kw):
    import jax
    import netket as nk
    import optax

    import vmcgrad.netket as vnk

    hi = nk.hilbert.Spin(0.5, 6)
    chains = 2 * jax.device_count()
    vs = vnk.MCState(
        nk.sampler.MetropolisLocal(hi, n_chains=chains), nk.models.RBM(alpha=1), n_samples=8 * chains, seed=3
    )
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)
    return vnk.VMC_SR(
        H,
        optax.sgd(0.02),
        diag_shift=1e-2,
        variational_state=vs,
        grow_samples=rule,
        **{"use_ntk": True, **kw},
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_vmc_sr_raises_n_when_settled_and_logs_it(netket_mesh):
    """A rule that settles at once (a tolerance of 1e9 error bars): N doubles every window of 3 steps,
    up to max_samples; each step logs the N it sampled; the next step samples the raised N."""
    import netket as nk

    drv = _driver(None)
    n0, chains = drv.state.n_samples, drv.state.sampler.n_chains
    drv = _driver(GrowSamples(max_samples=3 * n0, window=3, tolerance=1e9))
    log = nk.logging.RuntimeLog()
    drv.run(8, out=log, show_progress=False)
    # steps 0-2 at n0 -> raise after step 2; 3-5 at 2 n0 -> raise after step 5, capped at 3 n0
    assert drv.grown == [(2, n0, 2 * n0), (5, 2 * n0, 3 * n0 - (3 * n0) % chains)]
    assert [int(n) for _, n in log.data["n_samples"]] == [n0] * 3 + [2 * n0] * 3 + [3 * n0] * 2
    assert drv.state.samples.reshape(-1, 6).shape[0] == 3 * n0


@pytest.mark.heavy  # a bisection over compiled programs
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_vmc_sr_growth_is_capped_by_what_the_budget_holds(netket_mesh):
    """On the dense route (route="dense") the N×N kernel and its factor must fit the budget (2 N²
    float64 numbers: the bound, below 2 n0 here), and the raise is halved until the compiled update at
    the new N fits. The compiled dense update needs more than the bound (about 1.1x here), so the
    budget is what it needs at 1.5 n0 with one sample per chunk: the bound then lies between 1.5 n0
    and 2 n0. Where the rule chooses the route, there is no such bound
    (test_growth_follows_the_route_rule)."""
    from vmcgrad.netket._vmc_sr import _update

    n0 = _driver(None).state.n_samples
    probe = _driver(None, memory_budget=1, route="dense")  # no chunk fits: the error has the least need
    probe._loss_stats = probe.state.expect(probe._ham)
    args, static = probe._update_arguments(*probe._abstract_rows(n0 + n0 // 2), "dense")
    with pytest.raises(MemoryError) as need:
        _update.lower(*args, **static).compile()
    budget = max(need.value.need, 2 * 8 * (n0 + n0 // 2) ** 2)
    grow = GrowSamples(max_samples=8 * n0, window=3, tolerance=1e9)
    assert _driver(grow, memory_budget=budget).max_samples_in_budget() is None
    drv = _driver(grow, memory_budget=budget, route="dense")
    cap = drv.max_samples_in_budget()
    assert cap == int((budget / 16) ** 0.5) < 2 * n0
    drv.run(4, out=None, show_progress=False)
    chains = drv.state.sampler.n_chains
    assert len(drv.grown) == 1, drv.grown
    step, old, new = drv.grown[0]
    assert (step, old) == (2, n0) and n0 < new <= cap and new % chains == 0, drv.grown
    assert drv._update_fits(new)  # the compiled update at the raised N fits the budget
    # the smallest budget that holds N = n0 (chunks chosen within it), and so nothing larger: no raise
    probe = _driver(
        GrowSamples(max_samples=8 * n0), memory_budget=budget, chunk_size_bwd="auto", route="dense"
    )
    probe._loss_stats = probe.state.expect(probe._ham)
    lo, hi = 1, budget
    while lo < hi:  # bisection on the compiled update at n0
        mid = (lo + hi) // 2
        probe._memory_budget = mid
        lo, hi = (lo, mid) if probe._update_fits(n0) else (mid + 1, hi)
    tight = _driver(GrowSamples(max_samples=8 * n0, window=3, tolerance=1e9), memory_budget=lo, route="dense")
    tight.run(4, out=None, show_progress=False)
    assert tight.grown == [] and tight.state.n_samples == n0
    cg = _driver(GrowSamples(max_samples=8 * n0), memory_budget=budget, linear_solver="cg")
    assert cg.max_samples_in_budget() is None  # matrix-free: no N×N matrix to fit


@pytest.mark.heavy  # compiled route choices at two N
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_growth_follows_the_route_rule(netket_mesh):
    """Issue 48: a growing N follows the route rule, not the dense kernel's cap. At a budget that holds
    the dense kernel of n0 but not of 2 n0 (2·(2 n0)²·8 bytes are over it), N is raised to 2 n0 and
    the step there takes a route that fits (not the dense kernel), logged as ``minsr_route``."""
    import netket as nk

    n0 = _driver(None).state.n_samples
    budget = 2 * 8 * (n0 + n0 // 2) ** 2
    drv = _driver(GrowSamples(max_samples=2 * n0, window=3, tolerance=1e9), memory_budget=budget)
    log = nk.logging.RuntimeLog()
    drv.run(4, out=log, show_progress=False)
    assert drv.grown == [(2, n0, 2 * n0)], drv.grown
    assert [int(n) for _, n in log.data["n_samples"]] == [n0] * 3 + [2 * n0]
    assert drv.route == drv.route_at(2 * n0) != "dense", drv.route  # (the log keeps 5 characters)
    assert len(log.data["minsr_route"]["value"]) == 4
    assert 2 * 8 * (2 * n0) ** 2 > budget


def test_vmc_sr_grow_samples_bad_input(netket_mesh):
    with pytest.raises(TypeError, match=r"`grow_samples` must be a vmcgrad\.netket\.GrowSamples"):
        _driver(4096)
    with pytest.raises(ValueError, match=r"`grow_samples` needs use_ntk=True"):
        _driver(GrowSamples(max_samples=4096), use_ntk=False)


def test_a_raise_below_sqrt_factor_is_not_worth_its_compilations():
    rule = GrowSamples(max_samples=4096, factor=2)
    assert rule.worth(256, 368) and rule.worth(256, 512)  # 368 >= 256 * sqrt(2) = 362.0
    assert not rule.worth(256, 352) and not rule.worth(256, 272)
    assert GrowSamples(max_samples=4096, factor=4).worth(256, 512)  # sqrt(4) = 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_where_the_budget_refuses_a_worthwhile_raise_n_stays_and_is_not_tried_again(netket_mesh, monkeypatch):
    """Every raise refused (the compiled update never fits): 2 N is tried, then 1.5 N, and the next
    halving, 1.25 N, is below sqrt(2) N: no raise, and none tried at the later settled steps."""
    drv = _driver(GrowSamples(max_samples=64 * 1024, window=3, tolerance=1e9), memory_budget=2**30)
    n0, chains = drv.state.n_samples, drv.state.sampler.n_chains
    tried = []
    monkeypatch.setattr(drv, "_update_fits", lambda n: tried.append(n) and False)
    drv.run(8, out=None, show_progress=False)
    assert tried == [2 * n0, n0 + n0 // 2] and n0 // 2 % chains == 0, tried
    assert drv.grown == [] and drv.state.n_samples == n0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_first_step_at_a_raised_n_searches_no_chunk_again(netket_mesh, monkeypatch):
    """The raise is checked by compiling the update at the new N (its chunk_size="auto" search
    included); the next step, at that N, runs the same traced program and reads the search's cache:
    no candidate of the update is compiled again (on placed arrays the key differed, and at N = 256
    on the chain the search ran twice, 13-45 s each)."""
    from vmcgrad._problem import problem as problem_module

    drv = _driver(GrowSamples(max_samples=1024, window=3, tolerance=1e9), memory_budget=2**30)
    n0 = drv.state.n_samples
    searched = []  # (step, where) of each candidate compiled
    choose = problem_module.choose_chunk

    def spy(key, n, compile_at, *a, where, **k):
        def counted(c):
            searched.append((len(steps), where))
            return compile_at(c)

        return choose(key, n, counted, *a, where=where, **k)

    monkeypatch.setattr(problem_module, "choose_chunk", spy)
    steps = []  # completed steps: len(steps) is the index of the step running
    drv.run(4, out=None, show_progress=False, callback=lambda *_: steps.append(1) or True)
    assert drv.grown == [(2, n0, 2 * n0)], drv.grown  # checked at step 2; step 3 runs at 2 N
    update = {s for s, where in searched if where == "vmcgrad.minsr_update"}
    assert 2 in update and 3 not in update, searched
