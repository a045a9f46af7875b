"""``vmcgrad.netket.VMC_SR.state_dict`` / ``load_state_dict``: the driver's public, resumable state.

A driver run for a few steps, its state dict (and the variational state's variables and sampler
state) put into a fresh driver, continues bit for bit as the first one does: SPRING's momentum, the
optimizer's state (Adam's moments) and the step count (a schedule of the diagonal shift) all carry over.
"""

import jax
import numpy as np
import optax
import pytest
from flax import serialization
from jax.sharding import AxisType, Mesh

with jax.set_mesh(None):
    import netket as nk

    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def netket_mesh():
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        yield


def _driver(seed=3):
    hi = nk.hilbert.Spin(0.5, 6)
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=2 * N_DEV)
    vs = vnk.MCState(
        sampler,
        nk.models.RBM(alpha=1, param_dtype=np.float64),
        n_samples=16 * N_DEV,
        seed=seed,
        sampler_seed=seed + 1,
        chunk_size=8,
    )
    H = nk.operator.Ising(hi, nk.graph.Chain(6), h=1.0)
    return vnk.VMC_SR(
        H,
        optax.adam(0.01),
        variational_state=vs,
        diag_shift=optax.linear_schedule(1e-2, 1e-3, 10),
        momentum=0.8,
        use_ntk=True,
        linear_solver=nk.optimizer.solver.solve,
    )


def _energies(driver, n):
    out = []
    driver.run(
        n,
        show_progress=False,
        callback=lambda step, log, d: out.append(float(log["Energy"].mean.real)) or True,
    )
    return out


def _to_host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def test_a_state_dict_continues_the_run_bit_for_bit():
    a = _driver()
    _energies(a, 3)
    saved = _to_host(a.state_dict())
    assert saved["step_count"] == 3 and saved["old_updates"] is not None
    assert saved["n_samples"] == 16 * N_DEV and saved["grow"] == {
        "history": [],
        "grown": [],
        "stopped": False,
    }
    variables = _to_host(serialization.to_state_dict(a.state.variables))
    sampler_state = serialization.to_state_dict(a.state.sampler_state)
    expected = _energies(a, 3)

    b = _driver(seed=11)  # other parameters and chains: everything comes from the saved state
    b.load_state_dict(saved)
    b.state.variables = serialization.from_state_dict(b.state.variables, variables)
    b.state.sampler_state = serialization.from_state_dict(b.state.sampler_state, sampler_state)
    b.state.reset()
    assert b.step_count == 3
    assert _energies(b, 3) == expected


def test_a_state_dict_of_another_model_is_refused_by_name():
    saved = _to_host(_driver().state_dict())
    saved["old_updates"] = {"Dense": {"kernel": np.zeros((6, 12))}, "visible_bias": np.zeros(6)}
    with pytest.raises(ValueError, match="load_state_dict: its 'old_updates' does not fit"):
        _driver().load_state_dict(saved)
    with pytest.raises(ValueError, match="lacks 'optimizer_state'"):
        _driver().load_state_dict({"step_count": 0, "grow": {}})
    driver = _driver()  # the parameters' structure, each array of another shape
    saved = _to_host(driver.state_dict())
    wrong = lambda x: np.zeros((*x.shape, 2), x.dtype)
    saved["old_updates"] = jax.tree.map(wrong, _to_host(driver.state.parameters))
    with pytest.raises(
        ValueError, match=r"its 'old_updates' does not fit .*: an array of .* where the target"
    ):
        driver.load_state_dict(saved)
