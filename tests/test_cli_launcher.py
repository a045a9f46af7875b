"""``vmcgrad vmc --distributed auto``: the processes find each other from a cluster launcher's environment.

The environment is the one SLURM's ``srun`` gives each task (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``) or Open MPI's ``mpirun`` (``OMPI_MCA_orte_hnp_uri``,
``OMPI_COMM_WORLD_*``), with the node list on 127.0.0.1; JAX's own detection derives the coordinator's
port from the job id, so the tests pick a job id whose port is free. No per-process flag is given.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import time

import pytest
from helpers import LAUNCHER_VARS, N_DEVICES
from helpers import kill_all as _kill_all
from helpers import start_vmcgrad as _start
from helpers import steps_in as _steps_in

from vmcgrad.cli import _supervise, build_parser

PER_PROCESS = max(1, N_DEVICES // 2)
TIMEOUT = 240
TINY = ["vmc", "--L", "8", "--samples", "128", "--chunk-size", "24", "--seed", "3"]
#: JAX 0.10.2's SLURM and Open MPI ports: job id mod 2^12 above 65535 - 2^12 (jax/_src/clusters).
PORT_BASE = 65535 - 2**12 + 1


def _slurm(job_id, n, i):
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": str(n),
        "SLURM_PROCID": str(i),
        "SLURM_LOCALID": str(i),
    }


def _set_env(monkeypatch, env):
    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARS):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _checked(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    args._command.check(args, args._parser)
    return args


def test_auto_takes_the_three_flags_from_slurm(monkeypatch, tmp_path):
    _set_env(monkeypatch, _slurm(5000, 4, 2))
    args = _checked(["vmc", "--distributed", "auto", "--out", str(tmp_path / "run")])
    port = 5000 % 4096 + PORT_BASE
    assert (args.coordinator, args.num_processes, args.process_id) == (f"127.0.0.1:{port}", 4, 2)
    assert args._launch.launcher == "slurm" and args._launch.local_device_ids == (2,)


def test_auto_takes_the_three_flags_from_open_mpi(monkeypatch, tmp_path):
    env = {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1,10.0.0.1:34911",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    _set_env(monkeypatch, env)
    args = _checked(["vmc", "--distributed", "auto", "--out", str(tmp_path / "run")])
    port = (1531576320 // 4096) % 4096 + PORT_BASE
    assert (args.coordinator, args.num_processes, args.process_id) == (f"127.0.0.1:{port}", 2, 1)
    assert args._launch.launcher == "ompi"


def test_auto_with_one_task_runs_without_the_runtime(monkeypatch, tmp_path):
    _set_env(monkeypatch, _slurm(5000, 1, 0))
    args = _checked(["vmc", "--distributed", "auto", "--out", str(tmp_path / "run")])
    assert (args.coordinator, args.num_processes, args.process_id) == (None, None, None)


@pytest.mark.parametrize(
    "env, extra, message",
    [
        ({}, [], "argument --distributed: auto found no cluster launcher in the environment"),
        (
            _slurm(5000, 2, 0),
            ["--coordinator", "127.0.0.1:1234"],
            "argument --distributed: not allowed with --coordinator: auto takes them from the launcher's",
        ),
        (
            {**_slurm(5000, 2, 0), "SLURM_PROCID": "2"},
            [],
            "argument --distributed: the slurm launcher gives process 2 of 2; expected 0..1",
        ),
        (
            {**_slurm(5000, 2, 0), "SLURM_JOB_ID": "job"},
            [],
            "argument --distributed: cannot read the launcher's environment: invalid literal",
        ),
    ],
    ids=["no-launcher", "with-coordinator", "id-out-of-range", "unreadable"],
)
def test_auto_refuses_with_one_line(env, extra, message, monkeypatch, tmp_path, capsys):
    _set_env(monkeypatch, env)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        _checked(["vmc", "--distributed", "auto", *extra, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vmcgrad vmc: error: " + message), err
    assert not out.exists()


def test_a_process_that_never_joins_a_launched_job_names_the_launcher():
    said = "Terminating process because the JAX distributed service detected fatal errors ... RegisterTask"
    common = dict(process_id=0, num_processes=2, coordinator="127.0.0.1:62000", timeout=10)
    by_hand = _supervise.diagnose(said, **common)
    launched = _supervise.diagnose(said, **common, launcher="slurm")
    assert "--process-id 0 to 1" in by_hand
    assert launched == (
        "process 1 of 2 did not join the coordinator at 127.0.0.1:62000 within --distributed-timeout 10 s "
        "(slurm launcher). Fix: start the command through the launcher, once per process (srun -n 2 ..., "
        "mpirun -n 2 ...), with --distributed auto in every process"
    )


# --- two processes on this machine, started with SLURM's environment alone ----------------------------


def _free_job_id() -> int:
    """A SLURM job id whose coordinator port (JAX: PORT_BASE + id mod 4096) is free on 127.0.0.1."""
    for _ in range(200):
        port = random.randrange(PORT_BASE, 65536)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4096 * random.randrange(1, 100) + port - PORT_BASE
    raise RuntimeError(f"no free port in {PORT_BASE}..65535")


@pytest.mark.slow
@pytest.mark.solo
def test_two_processes_start_from_the_launchers_environment_alone(tmp_path):
    job = _free_job_id()
    out = tmp_path / "run"
    args = [*TINY, "--steps", "3", "--devices", str(PER_PROCESS), "--out", str(out), "--distributed", "auto"]
    procs = []
    try:
        procs = [_start(args, tmp_path, _slurm(job, 2, i)) for i in range(2)]
        results = []
        for p in procs:
            try:
                results.append(p.communicate(timeout=TIMEOUT))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a vmcgrad process did not finish within {TIMEOUT} s")
    finally:
        _kill_all(procs)
    (out0, err0), (out1, err1) = results
    assert procs[0].returncode == 0, err0[-4000:]
    assert procs[1].returncode == 0, err1[-4000:]
    log = json.loads((out / "log.json").read_text())
    assert log["status"] == "finished" and len(log["energy_mean"]) == 3
    assert log["info"]["n_processes"] == 2 and log["info"]["n_devices"] == 2 * PER_PROCESS
    port = job % 4096 + PORT_BASE
    assert log["config"]["distributed"] == "auto"
    assert (log["config"]["coordinator"], log["config"]["process_id"]) == (f"127.0.0.1:{port}", 0)
    # process 1 wrote nothing
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.mpack",
        "energy.png",
        "log.json",
        "params.mpack",
        "run.json",
        "third_party.log",
    ]
    reported = re.search(r"process 1 of 2: finished after 3 steps, final energy (\S+);", out1)
    assert reported and float(reported.group(1)) == log["final_energy"], out1
    assert "in 2 processes" in out0 and "relative error" in out0 and "Traceback" not in err0 + err1


#: ``--distributed-timeout`` here, and how long after the loss the survivor may take (as
#: tests/test_cli_multiprocess.py: the timeout, JAX's heartbeat period and a busy machine).
LOST_TIMEOUT = 10
LOST_BOUND = 4 * LOST_TIMEOUT + 30


@pytest.mark.slow
@pytest.mark.solo
def test_a_launched_process_killed_mid_run_ends_the_other_with_one_line(tmp_path):
    """SIGKILL process 1 of a launched job after two steps: process 0 ends within the bound, status 1,
    one line naming process 1; its log says "failed" and its lock is gone."""
    job, out = _free_job_id(), tmp_path / "run"
    args = [*TINY, "--steps", "100000", "--devices", str(PER_PROCESS), "--out", str(out)]
    args += ["--distributed", "auto", "--distributed-timeout", str(LOST_TIMEOUT)]
    procs = []
    try:
        procs = [_start(args, tmp_path, _slurm(job, 2, i)) for i in range(2)]
        deadline = time.monotonic() + TIMEOUT
        while _steps_in(out / "log.json") < 2:  # running, past the first compile
            assert time.monotonic() < deadline, "no 2 steps within the time limit"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.2)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the supervisor; its JAX process dies with it
        t_kill = time.monotonic()
        try:
            _, err = procs[0].communicate(timeout=LOST_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still runs {LOST_BOUND} s after process 1 was killed")
        waited = time.monotonic() - t_kill
    finally:
        _kill_all(procs)
    assert procs[0].returncode == 1, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "vmcgrad vmc: error: lost process 1 of 2: its heartbeats stopped (--distributed-timeout 10 s;"
    ), err[-4000:]
    assert waited < LOST_BOUND and "    @ 0x" not in err
    log = json.loads((out / "log.json").read_text())
    assert log["status"] == "failed" and log["error"].startswith("lost process 1 of 2"), log
    # no lock file left
    kept = {"energy.png", "log.json", "checkpoint.mpack", "params.mpack", "run.json", "third_party.log"}
    assert {p.name for p in out.iterdir()} <= kept
