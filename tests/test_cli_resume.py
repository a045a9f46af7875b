"""Checkpoints and ``--resume`` of ``vmcgrad vmc``.

The quick tests check what is refused before JAX runs, on checkpoint files made here (:mod:`._checkpoint`'s
own encoder, a synthetic state): damaged files, other versions, options that change the problem, a fresh
run into a folder that holds a checkpoint. The slow ones run the command: a run killed with SIGKILL at
random instants and resumed each time reaches the energies of the run that was never interrupted, bit
for bit; the saved parameters load into NetKet's own ``MCState`` in one line; a checkpoint of another
model is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import N_DEVICES
from helpers import run_vmcgrad as _vmcgrad
from helpers import start_vmcgrad as _start
from helpers import synthetic_checkpoint as _synthetic

import vmcgrad
from vmcgrad.cli import _checkpoint, main


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def _unchanged(folder: Path, before: dict[str, bytes]):
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written, no lock left


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_synthetic_checkpoint_reads_back(tmp_path):
    path = _synthetic(tmp_path / "run", step=3, lr=0.2)
    snap = _checkpoint.read(path.parent, version=vmcgrad.__version__)
    assert snap["step"] == 3 and snap["config"]["lr"] == 0.2 and len(snap["records"]) == 3


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "damaged or truncated"),
        (lambda b: b[:20], "damaged or truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "do not match their SHA-256"),
        (lambda b: b"PK\x03\x04" + b[4:], "not a vmcgrad checkpoint"),
        (lambda b: b"", "not a vmcgrad checkpoint"),
    ],
    ids=["half", "header-only", "one-bit", "other-file", "empty"],
)
def test_a_damaged_checkpoint_is_named_and_nothing_is_overwritten(damage, message, tmp_path, capsys):
    path = _synthetic(tmp_path / "run")
    path.write_bytes(damage(path.read_bytes()))
    before = _contents(path.parent)
    err = _refused(["vmc", "--resume", str(path.parent), "--steps", "9"], capsys)
    assert "argument --resume" in err and str(path) in err and message in err
    _unchanged(path.parent, before)


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    err = _refused(["vmc", "--resume", str(tmp_path / "run")], capsys)
    assert "no checkpoint here" in err and "checkpoint.mpack" in err


def test_a_checkpoint_of_another_version_or_format_is_refused(tmp_path, capsys):
    path = _synthetic(tmp_path / "a", version="0.0.1")
    err = _refused(["vmc", "--resume", str(path.parent), "--steps", "9"], capsys)
    assert "written by vmcgrad 0.0.1" in err and f"this is vmcgrad {vmcgrad.__version__}" in err
    from flax import serialization

    other = tmp_path / "b" / _checkpoint.CHECKPOINT
    other.parent.mkdir()
    payload = serialization.msgpack_serialize({"format": 99, "versions": {}})
    import hashlib

    other.write_bytes(_checkpoint.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    err = _refused(["vmc", "--resume", str(other.parent)], capsys)
    assert "checkpoint format 99" in err and f"reads format {_checkpoint.FORMAT}" in err


def test_options_that_change_the_problem_are_refused_with_the_list(tmp_path, capsys):
    path = _synthetic(tmp_path / "run")
    before = _contents(path.parent)
    argv = [
        "vmc",
        "--resume",
        str(path.parent),
        "--L",
        "10",
        "--lr",
        "0.05",
        "--model",
        "mlp",
        "--steps",
        "9",
    ]
    err = _refused(argv, capsys)
    assert (
        "--L: 8 in the checkpoint, 10 given" in err and "--model: 'rbm' in the checkpoint, 'mlp' given" in err
    )
    assert "--lr" not in err  # given, but the checkpoint's own value
    assert "--steps" not in err  # may change
    _unchanged(path.parent, before)


def test_steps_that_do_not_extend_the_run_and_another_out_are_refused(tmp_path, capsys):
    path = _synthetic(tmp_path / "run", step=6)  # a finished run of 6 steps
    err = _refused(["vmc", "--resume", str(path.parent)], capsys)
    assert "argument --steps" in err and "at step 6 of 6" in err and "larger than 6" in err
    err = _refused(
        ["vmc", "--resume", str(path.parent), "--steps", "9", "--out", str(tmp_path / "x")], capsys
    )
    assert "argument --out" in err and "leave out --out" in err


def test_a_new_run_into_a_folder_with_a_checkpoint_is_refused(tmp_path, capsys):
    path = _synthetic(tmp_path / "run")
    before = _contents(path.parent)
    err = _refused(["vmc", "--out", str(path.parent), "--L", "8"], capsys)
    assert f"--resume {path.parent}" in err and "holds the checkpoint" in err
    _unchanged(path.parent, before)


def test_options_given_are_told_from_defaults(tmp_path):
    """A value equal to the parser's default still counts as given (argparse fills the namespace)."""
    import argparse

    from vmcgrad.cli import _resume, build_parser

    argv = ["vmc", "--lr", "0.03", "--resume", "x"]
    args = build_parser().parse_args(argv)
    args._argv = argv
    given = _resume.given_options(args, args._parser)
    assert given == {"lr": 0.03, "resume": "x"}
    assert isinstance(args, argparse.Namespace)


# ----------------------------------------------------------------------------------------------- slow
RUN = ["vmc", "--L", "8", "--samples", "256", "--chunk-size", "64", "--devices", str(N_DEVICES)]


def _log(out: Path) -> dict:
    return json.loads((out / "log.json").read_text())


def _n_logged(out: Path) -> int:
    try:
        return len(_log(out)["energy_mean"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_killed_at_random_instants_and_resumed_reaches_the_same_energies(tmp_path):
    """SIGKILL at >= 10 random instants (some during start-up, most while stepping, so also during
    checkpoint writes); each time the run is started again (``--resume`` when a checkpoint exists).
    The energies of every step equal those of the run never interrupted, bit for bit (same devices,
    same programs, same inputs: the state is restored exactly). One process at a time, no
    distributed timeout: not ``solo``, it runs beside the other tests (its waits are 120-180 s
    bounds on a start, not timed heartbeats)."""
    steps, every = 240, 3
    args = [*RUN, "--steps", str(steps), "--checkpoint-every", str(every)]
    reference = tmp_path / "reference"
    rc, _, err = _vmcgrad([*args, "--out", str(reference)], tmp_path, timeout=180)
    assert rc == 0, err
    expected = _log(reference)["energy_mean"]
    step_time = float(np.median(_log(reference)["step_time"][1:]))
    rng = random.Random(20261204)
    out, kills, starts = tmp_path / "run", [], 0
    while len(kills) < 12:
        resume = (out / _checkpoint.CHECKPOINT).exists()
        cmd = (
            ["vmc", "--resume", str(out), "--devices", str(N_DEVICES)]
            if resume
            else [*args, "--out", str(out)]
        )
        n0 = _n_logged(out)
        proc, starts = _start(cmd, tmp_path), starts + 1
        try:
            if len(kills) % 4 == 0:  # during start-up (imports, compilation, restoring)
                time.sleep(rng.uniform(0.2, 3.0))
            else:  # while stepping: within about 25 steps of the first new one
                deadline = time.monotonic() + 120
                while _n_logged(out) <= n0 and proc.poll() is None:
                    assert time.monotonic() < deadline, "no new step within 120 s"
                    time.sleep(0.01)
                time.sleep(rng.uniform(0, 25 * step_time))
            if proc.poll() is not None:
                break  # it finished before the kill
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            kills.append(_n_logged(out))
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    print(f"SIGKILL after {kills} logged steps; {starts} starts")  # shown by pytest -s
    assert len(kills) >= 10, f"only {len(kills)} kills landed before the run finished ({kills})"
    assert max(kills) > 0, "no kill landed while stepping"
    if proc.poll() is None or proc.returncode != 0:  # the last start was killed: finish the run
        rc, _, err = _vmcgrad(
            ["vmc", "--resume", str(out), "--devices", str(N_DEVICES)], tmp_path, timeout=180
        )
        assert rc == 0, err
    log = _log(out)
    assert log["status"] == "finished" and len(log["energy_mean"]) == steps
    assert log["energy_mean"] == expected, f"killed after {kills} logged steps"
    assert len(log["info"]["resumed_at"]) >= 1
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.mpack",
        "energy.png",
        "log.json",
        "params.mpack",
        "run.json",
    ]
    assert _checkpoint.read(out)["step"] == steps


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    rc, stdout, err = _vmcgrad(
        [*RUN, "--steps", "4", "--checkpoint-every", "2", "--out", str(out)], out.parent
    )
    assert rc == 0, err
    assert "checkpoint.mpack" in stdout
    return out


@pytest.mark.slow
def test_the_saved_parameters_load_into_netket_in_one_line(finished_run):
    import flax
    import jax
    import netket as nk

    from vmcgrad.cli import _systems

    system = _systems.build("heisenberg1d", 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):  # NetKet's own, as after a plain `import netket`
        vstate = nk.vqs.MCState(system.make_sampler(16), _systems.make_model("rbm", system), n_samples=256)
        before = vstate.variables
        vstate.variables = flax.serialization.from_bytes(
            vstate.variables, (finished_run / "params.mpack").read_bytes()
        )  # the documented line
        energy = vstate.expect(system.hamiltonian).mean.real  # the trained state's
    saved = _checkpoint.read(finished_run)["variables"]
    leaves = jax.tree_util.tree_leaves(vstate.variables)
    assert len(leaves) == len(jax.tree_util.tree_leaves(saved)) == 3
    for loaded, want, old in zip(leaves, jax.tree_util.tree_leaves(saved), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(loaded), want)
        assert not np.array_equal(np.asarray(old), want)  # it did change the state
    first = _log(finished_run)["energy_mean"][0]  # the random start's, before any update
    assert energy < first - 1.0, (energy, first)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_before_anything_is_written(finished_run, tmp_path):
    """The options match, the arrays do not (an RBM with another density saved as this run's)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    snap = _checkpoint.read(out)
    kernel = snap["variables"]["params"]["Dense"]["kernel"]
    snap["variables"]["params"]["Dense"]["kernel"] = np.concatenate([kernel, kernel], axis=1)
    for key in ("config", "info", "records"):
        snap[key] = json.dumps(snap[key])
    (out / _checkpoint.CHECKPOINT).write_bytes(_checkpoint.encode(snap))
    before = _contents(out)
    rc, _, err = _vmcgrad(["vmc", "--resume", str(out), "--steps", "6"], tmp_path)
    assert rc == 1, err
    assert "its variables do not fit this run's model" in err and str(out / "checkpoint.mpack") in err
    assert "Traceback" not in err
    _unchanged(out, before)


@pytest.mark.slow
def test_steps_extended_continue_the_run(finished_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    rc, stdout, err = _vmcgrad(["vmc", "--resume", str(out), "--steps", "6"], tmp_path)
    assert rc == 0, err
    assert "resuming from step 4" in stdout
    log = _log(out)
    assert len(log["energy_mean"]) == 6 and log["info"]["resumed_at"] == [4]
    assert log["energy_mean"][:4] == _log(finished_run)["energy_mean"]
    assert log["config"]["steps"] == 6 and log["config"]["resume"] == str(out)
    whole = tmp_path / "whole"  # the same 6 steps in one go: the same energies, bit for bit
    rc, _, err = _vmcgrad([*RUN, "--steps", "6", "--checkpoint-every", "2", "--out", str(whole)], tmp_path)
    assert rc == 0, err
    assert log["energy_mean"] == _log(whole)["energy_mean"]
