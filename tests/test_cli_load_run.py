"""``vmcgrad.cli.load_run``: a ``vmcgrad vmc`` run folder back to a NetKet state in one call.

A run records its problem in ``DIR/run.json``; ``load_run(DIR)`` rebuilds the state from it with the
trained parameters of ``params.mpack``, for a built-in and for a user's model. The loaded state's
energy, estimated here on fresh samples, equals the run's final energy within the error bars: the
difference of two independent estimates has the standard error sqrt(σ_run² + σ_load²) (σ_run: the
last tenth of the steps' errors combined as independent, as ``log.json``'s ``final_energy_error``;
σ_load: NetKet's error of the mean, corrected for autocorrelation), and 4 of them bound it with a
chance of a false alarm below 1e-4 for Gaussian estimates. The parameters move between the last
logged steps by far less than that at convergence (checked: the run's last energies agree within
their errors). A folder that is not a run, a run without ``run.json`` (an older vmcgrad), missing or
damaged files and parameters of another model each raise :class:`vmcgrad.cli.RunFolderError`, naming
what was given, what was expected and the fix.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import N_DEVICES
from helpers import run_vmcgrad as _vmcgrad
from jax.sharding import AxisType, Mesh

from vmcgrad.cli import Run, RunFolderError, load_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_problem.py"
LOAD_SAMPLES = 4096


@pytest.fixture(autouse=True)
def netket_mesh():
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        yield


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("load") / "run"
    args = ["vmc", "--L", "8", "--samples", "256", "--chunk-size", "32", "--steps", "30"]
    rc, stdout, err = _vmcgrad([*args, "--devices", str(N_DEVICES), "--out", str(out)], out.parent)
    assert rc == 0, err
    assert f"load it with vmcgrad.cli.load_run({str(out)!r})" in stdout
    return out


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """The docs example, given by a path relative to the run's folder: loaded from elsewhere through
    the file recorded in run.json."""
    where = tmp_path_factory.mktemp("user")
    shutil.copy(EXAMPLE, where / "my_problem.py")
    out = where / "run"
    args = ["vmc", "--system", "my_problem.py:system", "--model", "my_problem.py:model", "--steps", "30"]
    rc, _, err = _vmcgrad([*args, "--samples", "256", "--devices", str(N_DEVICES), "--out", "run"], where)
    assert rc == 0, err
    return out


def _energy_matches_the_run(run: Run):
    log = run.log
    final, final_error = log["final_energy"], log["final_energy_error"]
    state = run.state
    state.n_samples = LOAD_SAMPLES
    stats = state.expect(run.hamiltonian)
    loaded, error = float(np.real(stats.mean)), float(stats.error_of_mean)
    sigma = np.hypot(error, final_error)
    assert abs(loaded - final) < 4 * sigma, (loaded, error, final, final_error)
    assert loaded < log["energy_mean"][0] - 4 * np.hypot(error, log["energy_error"][0])  # trained
    return loaded


@pytest.mark.slow
def test_a_builtin_run_loads_back_with_its_energy(builtin_run):
    run = load_run(builtin_run)
    assert isinstance(run, Run) and run.config["system"] == {
        "name": "heisenberg1d",
        "L": 8,
        "description": "Heisenberg chain of 8 sites, periodic, total Sz = 0",
        "n_sites": 8,
    }
    assert run.config["model"]["options"] == {
        "type": "netket.models.RBM",
        "alpha": 1,
        "param_dtype": "float64",
    }
    assert run.config["seeds"] == {"parameters": 0, "sampler": 1} and run.config["dtype"] == "float64"
    assert set(run.config["versions"]) == {"vmcgrad", "jax", "netket", "flax"}
    assert run.log["status"] == "finished" and len(run.log["energy_mean"]) == 30
    with pytest.raises(AttributeError):
        run.state = None  # immutable
    loaded = _energy_matches_the_run(run)
    assert abs(loaded - run.log["exact_energy"]) < 0.01 * abs(run.log["exact_energy"])


@pytest.mark.slow
def test_a_user_model_run_loads_back_with_its_energy(user_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # elsewhere: the factory is found through the recorded file
    run = load_run(user_run)
    assert run.config["model"]["factory"] == "my_problem.py:model"
    assert run.config["model"]["file"] == str(user_run.parent / "my_problem.py")
    assert run.config["model"]["type"].endswith("LogCoshNet")
    _energy_matches_the_run(run)


def _refused(path, *needles):
    with pytest.raises(RunFolderError) as error:
        load_run(path)
    message = str(error.value)
    assert message.startswith("vmcgrad.cli.load_run(") and "expected" in message and "Fix:" in message
    for needle in needles:
        assert needle in message, message
    return message


def test_a_folder_that_is_not_a_run_is_refused_with_the_fix(tmp_path):
    _refused(tmp_path / "nowhere", "does not exist", "--out")
    old = tmp_path / "old-run"  # a run of an older vmcgrad: no run.json
    old.mkdir()
    (old / "log.json").write_text("{}")
    (old / "params.mpack").write_bytes(b"")
    _refused(old, "no run.json", "it holds log.json, params.mpack", "older than load_run")


def test_missing_or_damaged_files_are_named(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text('{"format": 1, "system": {')
    _refused(folder, "run.json cannot be read as JSON")
    (folder / "run.json").write_text(json.dumps({"format": 1}))
    _refused(folder, "no log.json")
    (folder / "log.json").write_text("{}")
    _refused(folder, "no params.mpack", f"--resume {folder}")


@pytest.mark.slow
def test_parameters_of_another_model_are_refused(builtin_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(builtin_run, folder)
    config = json.loads((folder / "run.json").read_text())
    config["model"]["name"] = "mlp"
    (folder / "run.json").write_text(json.dumps(config))
    _refused(folder, "params.mpack does not fit the recorded model", "restore the run folder whole")
