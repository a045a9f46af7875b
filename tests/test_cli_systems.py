"""``vmcgrad vmc``'s systems and models: per-system defaults that converge, and the symmetric ansätze.

The convergence runs are ``python -m vmcgrad vmc`` subprocesses with every option at its default except
``--steps``, ``--out`` and ``--devices 1``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from vmcgrad.cli import _systems, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
#: A step may sit above the first one by at most this many standard errors (both steps' errors combined).
K_SIGMA = 3.0


def _trend_problem(energies, errors):
    """Why the energies do not go down from the start, or None.

    Two checks with a margin for Monte Carlo noise: no step is above step 0 by more than ``K_SIGMA``
    combined standard errors; the mean of steps 10 onwards is below the mean of steps 0–3 by more than
    three standard errors of the difference of those means.
    """
    e, s = np.asarray(energies), np.asarray(errors)
    rise = (e - e[0]) / np.sqrt(s**2 + s[0] ** 2)
    if rise.max() > K_SIGMA:
        i = int(rise.argmax())
        return f"step {i}: energy {e[i]:.4f} is {rise[i]:.1f} sigma above step 0 ({e[0]:.4f})"
    if len(e) < 11:
        raise ValueError(f"need at least 11 steps; got {len(e)}")
    head, tail = e[:4].mean(), e[10:].mean()
    margin = 3 * np.sqrt((s[:4] ** 2).sum() / 16 + (s[10:] ** 2).sum() / len(s[10:]) ** 2)
    if not tail < head - margin:
        return f"mean of steps 10+ {tail:.4f} is not below the mean of steps 0-3 {head:.4f} - {margin:.4f}"
    return None


def _run(tmp_path, *args):
    """``python -m vmcgrad vmc ARGS`` on one CPU device; its log.

    One device: the claim is about the optimisation, and on this suite's 4 fake devices the SR solve
    has been seen to return NaN now and then for the same inputs (reported; see the lead's issue list).
    """
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "NETKET_EXPERIMENTAL_SHARDING_CPU"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "vmcgrad", "vmc", *args, "--devices", "1", "--out", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "log.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("system", ["heisenberg2d", "j1j2"])
def test_square_lattice_defaults_go_down_from_the_first_step(system, tmp_path):
    log = _run(tmp_path, "--system", system, "--steps", "12")
    config = log["config"]
    assert {k: config[k] for k in _systems.DEFAULTS[system]} == _systems.DEFAULTS[system]
    assert config["model"] == "rbm-symm" and log["info"]["n_sites"] == 16
    problem = _trend_problem(log["energy_mean"], log["energy_error"])
    assert problem is None, problem
    assert log["energy_mean"][-1] < 0.85 * log["exact_energy"]  # within 15% of E0 after 12 steps (4x4)


@pytest.mark.slow
def test_trend_check_fires_on_the_kick(tmp_path):
    """The detector on a bad program: lr 0.02 kicks the symmetric RBM off its start (-36 to about -21)."""
    log = _run(tmp_path, "--system", "heisenberg2d", "--lr", "0.02", "--steps", "6")
    problem = _trend_problem(log["energy_mean"], log["energy_error"])
    assert problem is not None and "sigma above step 0" in problem


def test_trend_check_on_made_up_series():
    flat_noise = np.full(16, 0.1)
    down = -36 - 8 * (1 - np.exp(-np.arange(16) / 4))
    assert _trend_problem(down, flat_noise) is None
    bump = down.copy()
    bump[2] = down[0] + 0.5  # 3.5 sigma above the start
    assert "step 2" in _trend_problem(bump, flat_noise)
    assert "not below" in _trend_problem(np.full(16, -36.0), flat_noise)


def _parse(*argv):
    args = build_parser().parse_args(["vmc", *argv])
    _systems.fill_defaults(args)
    return args


def test_explicit_options_win_over_the_system_defaults():
    args = _parse("--system", "heisenberg2d", "--lr", "0.1", "--model", "gcnn", "--L", "6")
    assert (args.lr, args.model, args.L) == (0.1, "gcnn", 6)
    assert (args.diag_shift, args.samples, args.chunk_size) == (0.01, 1024, 256)
    args = _parse()  # the chain: the defaults of before, unchanged
    assert (args.system, args.L, args.model, args.lr, args.diag_shift) == (
        "heisenberg1d",
        16,
        "rbm",
        0.03,
        0.01,
    )


def test_help_names_every_model_and_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["vmc", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse rewraps the epilog
    for name in _systems.MODELS:
        assert f"{name}: " in text
    assert "heisenberg2d: --L 4 --model rbm-symm --samples 1024 --chunk-size 256 --lr 0.005" in text
    assert "(default: per system, see below)" in text and "(default: None)" not in text.split("--devices")[0]


def _orbit_log_values(model, system, group):
    """log ψ of a few random total-Sz = 0 states and of their images under every element of ``group``."""
    key = jax.random.key(0)
    states = system.hilbert.random_state(key, 3)
    params = model.init(jax.random.key(1), states)
    perms = np.asarray(group)  # (n_group, n_sites): site i of the image is site perms[g, i] of the state
    images = np.asarray(states)[:, perms].reshape(-1, perms.shape[1])  # (3 · n_group, n_sites)
    values = np.asarray(model.apply(params, images)).reshape(len(states), len(perms))
    return np.asarray(model.apply(params, states)), values


@pytest.mark.parametrize(
    "name, group, n_parameters",
    [("rbm-symm", "translation_group", 4 * 16 + 4 + 1), ("gcnn", "space_group", None)],
)
def test_symmetric_models_are_invariant_under_their_group(name, group, n_parameters):
    system = _systems.build("heisenberg2d", 4)
    model = _systems.make_model(name, system)
    base, images = _orbit_log_values(model, system, getattr(system.graph, group)())
    assert images.shape[1] == len(getattr(system.graph, group)())
    np.testing.assert_allclose(images, np.broadcast_to(base[:, None], images.shape), rtol=0, atol=1e-10)
    assert np.ptp(base.real) > 1e-6  # not a constant function: invariance is not trivial
    if n_parameters is not None:
        params = model.init(jax.random.key(1), system.hilbert.random_state(jax.random.key(0), 1))
        assert sum(x.size for x in jax.tree.leaves(params)) == n_parameters


def test_symmetric_model_without_the_lattice_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model 'gcnn' needs the lattice: pass make_model\('gcnn', build"):
        _systems.make_model("gcnn")


def test_symmetric_models_build_on_the_chains():
    for system in ("heisenberg1d", "ising1d"):
        built = _systems.build(system, 4)
        for name in ("rbm-symm", "gcnn"):
            model = _systems.make_model(name, built)
            x = built.hilbert.random_state(jax.random.key(0), 2)
            out = model.apply(model.init(jax.random.key(1), x), x)
            assert out.shape == (2,) and np.all(np.isfinite(out)), (system, name)


def test_the_6x6_literature_energy_is_in_the_table():
    assert _systems.EXACT_ENERGIES["heisenberg2d", 6] == pytest.approx(-97.757568, abs=1e-9)
