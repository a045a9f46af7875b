"""The ``vmcgrad`` command line: a short ``vmcgrad vmc`` run, usage errors, an interrupted run, ``--help``.

Runs go through real subprocesses (``python -m vmcgrad``) with ``--devices`` set to this suite's device
count, so sharding is exercised as a user would see it; usage errors are also checked in-process.
"""

import json
import os
import re
import signal
import time

import numpy as np
import pytest
from helpers import N_DEVICES, TINY
from helpers import check_log as _check_log
from helpers import finish as _finish
from helpers import is_png as _is_png
from helpers import run_vmcgrad as _vmcgrad
from helpers import start_vmcgrad as _start

from vmcgrad.cli import _systems, main

#: NetKet's ``nk.exact.lanczos_ed`` on ``Heisenberg(Spin(0.5, 8, total_sz=0), Chain(8))`` (measured).
HEISENBERG_CHAIN_8 = -14.604373635748708


@pytest.mark.slow
def test_chunk_size_auto_runs(tmp_path):
    out = tmp_path / "run"
    args = ["vmc", "--L", "8", "--samples", "128", "--chunk-size", "auto", "--steps", "2", "--out", str(out)]
    rc, _, stderr = _vmcgrad([*args, "--devices", str(N_DEVICES)], tmp_path)
    assert rc == 0, stderr
    log = json.loads((out / "log.json").read_text())
    assert log["config"]["chunk_size"] == "auto" and len(log["energy_mean"]) == 2
    assert all(np.isfinite(log["energy_mean"]))


def test_short_run_writes_log_and_plot(tmp_path):
    out = tmp_path / "run"
    args = ["vmc", *TINY, "--steps", "6", "--lr", "0.05", "--seed", "3", "--out", str(out)]
    rc, stdout, stderr = _vmcgrad(args, tmp_path)
    assert rc == 0, stderr
    log = json.loads((out / "log.json").read_text())
    _check_log(log, n_steps=6)
    exact = HEISENBERG_CHAIN_8
    assert log["exact_energy"] == pytest.approx(exact, rel=1e-10)
    assert log["info"]["exact_energy_source"] == "lanczos"
    assert log["info"]["n_devices"] == N_DEVICES
    final = np.mean(log["energy_mean"][-1:])  # last tenth of 6 steps: 1 step
    assert log["final_energy"] == pytest.approx(final, rel=1e-12)
    assert log["relative_error"] == pytest.approx(abs(final - exact) / abs(exact), rel=1e-12)
    assert log["status"] == "finished"
    assert log["config"] == {
        "command": "vmc",
        "system": "heisenberg1d",
        "L": 8,
        "model": "rbm",
        "samples": 128,
        "chunk_size": 24,
        "steps": 6,
        "lr": 0.05,
        "diag_shift": 0.01,
        "seed": 3,
        "devices": N_DEVICES,
        "out": str(out),
        "checkpoint_every": 10,
        "resume": None,
        "driver": "auto",
        "memory_budget": None,
        "grow_samples": None,
        "minutes": None,
        "distributed": None,
        "coordinator": None,
        "num_processes": None,
        "process_id": None,
        "distributed_timeout": 60,
        "verbose": False,
    }
    # The energy went down from the random start: the update is applied with the right sign.
    assert min(log["energy_mean"][1:]) < log["energy_mean"][0]
    assert _is_png(out / "energy.png")
    # no temporary left
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.mpack",
        "energy.png",
        "log.json",
        "params.mpack",
        "run.json",
    ]
    printed = re.search(r"exact energy: (\S+) \(lanczos\)", stdout)
    assert printed and float(printed.group(1)) == pytest.approx(exact, rel=1e-9)
    assert "relative error" in stdout and "Traceback" not in stderr


@pytest.mark.parametrize(
    "system, L", [("heisenberg1d", 12), ("ising1d", 12), ("heisenberg2d", 4), ("j1j2", 4)]
)
def test_lanczos_reproduces_the_table(system, L):
    """The exact-diagonalisation path (used off the table) against the table (vmcgrad/cli/_systems.py)."""
    built = _systems.build(system, L)
    energy = _systems.lanczos_energy(built.n_sites, built.bonds, built.field)
    assert energy == pytest.approx(_systems.EXACT_ENERGIES[system, L], rel=1e-10, abs=0)
    assert _systems.exact_energy(system, L, built) == (_systems.EXACT_ENERGIES[system, L], "table")


def test_exact_energy_off_the_table():
    built = _systems.build("heisenberg1d", 8)
    energy, source = _systems.exact_energy("heisenberg1d", 8, built)
    assert source == "lanczos" and energy == pytest.approx(HEISENBERG_CHAIN_8, rel=1e-12)
    built = _systems.build("ising1d", 18)  # 2^18 states: past LANCZOS_MAX_SITES, not in the table
    assert _systems.exact_energy("ising1d", 18, built) == (None, None)


MP = ["--num-processes", "2", "--process-id"]
BAD = [
    (
        ["--system", "kagome"],
        "argument --system: expected one of heisenberg1d, heisenberg2d, ising1d, j1j2, or MODULE:FACTORY",
    ),
    (
        ["--model", "cnn"],
        "argument --model: expected one of rbm, rbm-phase, mlp, rbm-symm, gcnn, or MODULE:FACTORY",
    ),
    (["--L", "0"], "argument --L: must be a positive integer; got 0"),
    (["--L", "seven"], "argument --L: expected a positive integer; got 'seven'"),
    (["--L", "7"], "argument --L: must be even for heisenberg1d"),
    (["--system", "j1j2", "--L", "2"], "argument --L: must be at least 4 for j1j2"),
    (["--samples", "-5"], "argument --samples: must be a positive integer; got -5"),
    (["--chunk-size", "0"], "argument --chunk-size: must be a positive integer; got 0"),
    (["--chunk-size", "many"], "argument --chunk-size: expected a positive integer; got 'many'"),
    (["--steps", "0"], "argument --steps: must be a positive integer; got 0"),
    (["--lr", "-1"], "argument --lr: must be a positive number; got -1"),
    (["--diag-shift", "nan"], "argument --diag-shift: must be a non-negative number; got nan"),
    (["--devices", "0"], "argument --devices: must be a positive integer; got 0"),
    (["--coordinator", "127.0.0.1"], "argument --coordinator: expected HOST:PORT, e.g. 127.0.0.1:12345"),
    (["--coordinator", "127.0.0.1:http"], "argument --coordinator: expected HOST:PORT with a numeric port"),
    (["--coordinator", "127.0.0.1:70000"], "argument --coordinator: the port must be in 1..65535; got 70000"),
    (["--coordinator", "::1:1234"], "argument --coordinator: expected HOST:PORT with a host name or address"),
    (["--coordinator", "127.0.0.1:1234"], "argument --num-processes: required with --coordinator;"),
    (["--num-processes", "2", "--process-id", "0"], "argument --coordinator: required with --num-processes"),
    (
        ["--coordinator", "127.0.0.1:1234", "--num-processes", "0", "--process-id", "0"],
        "argument --num-processes: must be a positive integer",
    ),
    (["--coordinator", "127.0.0.1:1234", *MP, "-1"], "argument --process-id: must be a non-negative integer"),
    (
        ["--coordinator", "127.0.0.1:1234", *MP, "2"],
        "argument --process-id: must be in 0..1 for --num-processes 2",
    ),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[" ".join(b) for b, _ in BAD])
def test_bad_input_exits_2_with_one_line_and_creates_nothing(bad, message, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["vmc", *bad, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vmcgrad vmc: error: ") and message in err, err
    assert not out.exists()


def test_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for out, message in [
        (blocker, "argument --out: "),
        (blocker / "run", "argument --out: cannot create"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["vmc", "--out", str(out)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "is not a directory" in err, err
    assert blocker.read_text() == "not a directory"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SystemExit):
            main(["vmc", "--out", str(locked / "run")])
        assert "is not writable" in capsys.readouterr().err
        assert not (locked / "run").exists()


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    rc, stdout, stderr = _vmcgrad(["vmc", "--system", "kagome", "--out", str(tmp_path / "out")], tmp_path)
    assert rc == 2 and stdout == ""
    assert stderr.count("\n") == 1 and "argument --system" in stderr and "heisenberg1d" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_interrupted_run_keeps_a_valid_log(tmp_path):
    out = tmp_path / "run"
    proc = _start(["vmc", *TINY, "--steps", "100000", "--out", str(out)], tmp_path)
    log_path, deadline, n = out / "log.json", time.monotonic() + 60, 0
    try:
        while n < 2:  # wait until a couple of steps are logged
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no two steps logged within 60 s"
            time.sleep(0.2)
            if log_path.exists():
                n = len(json.loads(log_path.read_text())["energy_mean"])
        proc.send_signal(signal.SIGINT)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    rc, stdout, stderr = _finish(proc, timeout=30)
    assert rc == 130, stderr
    log = json.loads(log_path.read_text())
    assert _check_log(log) >= n
    assert log["status"] == "interrupted" and log["relative_error"] is not None
    assert _is_png(out / "energy.png")
    assert "interrupted after" in stdout and "Traceback" not in stderr
    assert (
        "wrote the checkpoint of step" in stdout and f"continue with `vmcgrad vmc --resume {out}`" in stdout
    )


def test_python_m_vmcgrad_help(tmp_path):
    rc, stdout, _ = _vmcgrad(["--help"], tmp_path, timeout=60)
    assert rc == 0 and "vmc" in stdout
    rc, stdout, _ = _vmcgrad(["vmc", "--help"], tmp_path, timeout=60)
    assert rc == 0 and "--chunk-size" in stdout and "heisenberg1d" in stdout
