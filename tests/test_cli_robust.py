"""The command line under hostile conditions: non-finite numbers, two runs into one ``--out``, special and
unwritable paths, a full disk, a second Ctrl-C during the first compile, ``--chunk-size auto``, sample
counts the devices do not divide.

Full runs go through subprocesses (``python -m vmcgrad``) as a user would start them, except the full-disk
cases, which patch the writer in-process (the only portable way to fill a disk at a chosen write).
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import N_DEVICES, TINY
from helpers import check_log as _check_log
from helpers import finish as _finish
from helpers import run_vmcgrad as _vmcgrad
from helpers import start_vmcgrad as _start

from vmcgrad.cli import _lock, _output, _report, main, vmc


def _strict(text):
    """``json.loads`` as a strict parser (or JavaScript's ``JSON.parse``) reads it: no NaN/Infinity."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _one_line_error(err, *parts):
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


# --- strict JSON ----------------------------------------------------------------------------------


def test_json_log_writes_nonfinite_numbers_as_null_with_the_reason(tmp_path):
    path = tmp_path / "log.json"
    _output.write_json_atomic(
        path, {"energy_error": [0.5, float("nan")], "final": float("inf"), "np": np.float64("-inf")}
    )
    log = _strict(path.read_text())
    assert log["energy_error"] == [0.5, None] and log["final"] is None and log["np"] is None
    assert log["nonfinite"]["values"] == {"energy_error[1]": "nan", "final": "inf", "np": "-inf"}
    assert "null" in log["nonfinite"]["reason"]
    _output.write_json_atomic(path, {"x": [1.0]})  # all finite: no "nonfinite" key
    assert _strict(path.read_text()) == {"x": [1.0]}


@pytest.mark.slow
def test_few_samples_auto_chunk_and_a_stale_lock_in_a_real_run(tmp_path):
    """32 samples (the fewest ``--samples`` allows: NetKet's error of the mean is NaN below) in 32
    chains: ``--chunk-size auto`` prints what it picked (the QGT's design too); a lock file left by a
    dead process is taken over. (A NaN in the log is written as null: the test above.)"""
    out = tmp_path / "run"
    out.mkdir()
    stale = _dead_pid()
    (out / _lock.LOCK_NAME).write_text(f"{stale}\n")
    args = ["vmc", "--L", "8", "--samples", "32", "--chunk-size", "auto", "--steps", "2", "--driver", "sr"]
    args += ["--out", str(out)]
    rc, stdout, stderr = _vmcgrad([*args, "--devices", str(N_DEVICES)], tmp_path)
    assert rc == 0, stderr
    log = _strict((out / "log.json").read_text())
    assert all(np.isfinite(log["energy_error"])) and "nonfinite" not in log
    assert all(np.isfinite(log["energy_mean"])) and log["status"] == "finished"
    picked = re.search(
        r"chunk size auto: picked (\d+) for the gradient and (\d+) \((fused|jvp_vjp) design\) for the QGT",
        stdout,
    )
    assert picked, stdout
    solve = re.search(r"each solve keeps every chunk's linearisation, at chunk (\d+)", stdout)
    chunks = {"gradient": int(picked.group(1)), "qgt": int(picked.group(2))}
    chunks["qgt_solve"] = int(solve.group(1)) if solve else None  # the kept solve's chunk, as printed
    assert log["info"]["chunk_size"] == chunks and log["info"]["qgt_design"] == picked.group(3)
    per_device = 32 // N_DEVICES
    assert all(c & (c - 1) == 0 and 1 <= c <= per_device for c in chunks.values()), chunks
    assert f"took over the lock file {out / _lock.LOCK_NAME} of process {stale}" in stderr
    assert sorted(p.name for p in out.iterdir()) == [  # lock released
        "checkpoint.mpack",
        "energy.png",
        "log.json",
        "params.mpack",
        "run.json",
    ]


@pytest.mark.slow
def test_auto_chunk_reports_the_qgt_design_the_run_uses(tmp_path, monkeypatch, capsys):
    """``--chunk-size auto`` prints the QGT design that ``vmcgrad.QGT(..., chunk_size="auto")`` picks,
    and every QGT operator of the run (the SR's, one per step) has that design and chunk. The time
    model is patched so that the jvp-then-vjp design wins (the fused one by default)."""
    import vmcgrad
    from vmcgrad._sr.qgt import qgt as _qgt

    monkeypatch.setattr(_qgt, "choose_design", lambda op: ("jvp_vjp", None))  # its chunk: op.chunk_size
    built, qgt = [], vmcgrad.QGT

    def spy(*args, **kwargs):
        op = qgt(*args, **kwargs)
        built.append((op.design, op.chunk_size))
        return op

    monkeypatch.setattr(vmcgrad, "QGT", spy)
    rc, stdout, stderr = _in_process_run(
        ["--chunk-size", "auto", "--steps", "2", "--out", str(tmp_path)], capsys
    )
    assert rc == 0, stderr
    picked = re.search(r"and (\d+) \((fused|jvp_vjp) design\) for the QGT", stdout)
    assert picked, stdout
    assert picked.group(2) == "jvp_vjp"
    # the pick, the measurement of the phases' bytes (once: N and the route do not change), then the
    # SR's operator at each of the 2 steps
    assert len(built) == 4, built
    assert set(built) == {("jvp_vjp", int(picked.group(1)))}, built
    assert _strict((tmp_path / "log.json").read_text())["info"]["qgt_design"] == "jvp_vjp"


# --- two runs into one --out ----------------------------------------------------------------------


def test_second_run_into_a_locked_out_refuses_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    held = _lock.OutDirLock.acquire(out)  # as a first run holds it
    try:
        with pytest.raises(SystemExit) as exc:  # in-process (a tiny run, should it start)
            main(["vmc", *TINY, "--steps", "1", "--out", str(out)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        _one_line_error(
            err,
            "vmcgrad vmc: error: argument --out:",
            f"in use by another vmcgrad run (process {os.getpid()}",
        )
        t0 = time.monotonic()
        rc, stdout, stderr = _vmcgrad(["vmc", "--out", str(out)], tmp_path, timeout=60)  # another process
        assert rc == 2 and stdout == "" and time.monotonic() - t0 < 30
        _one_line_error(stderr, "vmcgrad vmc: error: argument --out:", "in use by another vmcgrad run")
        assert not (out / "log.json").exists()
    finally:
        held.release()
    assert not (out / _lock.LOCK_NAME).exists()
    again = _lock.OutDirLock.acquire(out)  # free again
    assert again.stale_pid is None
    again.release()


def test_a_lock_whose_process_is_dead_is_taken_over(tmp_path):
    stale = _dead_pid()
    (tmp_path / _lock.LOCK_NAME).write_text(f"{stale}\n")
    lock = _lock.OutDirLock.acquire(tmp_path)
    try:
        assert lock.stale_pid == stale
        assert (tmp_path / _lock.LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_concurrent_writers_never_share_a_temporary(tmp_path):
    """Two writers of one file (as two runs once did): every write lands whole, none fails."""
    path, errors = tmp_path / "log.json", []

    def writer(k):
        try:
            for i in range(300):
                _output.write_json_atomic(path, {"writer": k, "i": i, "pad": "x" * 5000})
        except Exception as error:  # collected: a failing thread must fail the test
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads):
        if path.exists():
            assert len(_strict(path.read_text())["pad"]) == 5000  # never torn
            reads += 1
    for t in threads:
        t.join()
    assert errors == [] and reads > 0
    assert [p.name for p in tmp_path.iterdir()] == ["log.json"]  # no temporary left


# --- unwritable and special --out -----------------------------------------------------------------


SPECIAL = [
    ("/proc/x", "cannot create '/proc/x': directory '/proc' is not writable"),
    ("/dev/full", "'/dev/full' exists and is not a directory"),
    ("/dev/null/run", "cannot create '/dev/null/run': '/dev/null' is not a directory"),
]


@pytest.mark.parametrize("out, message", SPECIAL, ids=[o for o, _ in SPECIAL])
def test_special_out_paths_are_refused_before_anything_runs(out, message, capsys):
    top = Path(*Path(out).parts[:2])
    if not top.exists():
        pytest.skip(f"no {top} on this system")
    with pytest.raises(SystemExit) as exc:  # (a tiny run, should it start)
        main(["vmc", *TINY, "--steps", "1", "--out", out])
    assert exc.value.code == 2
    _one_line_error(capsys.readouterr().err, f"vmcgrad vmc: error: argument --out: {message}")


def test_a_directory_where_the_log_goes_is_refused(tmp_path, capsys):
    (tmp_path / "log.json").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["vmc", "--out", str(tmp_path)])
    assert exc.value.code == 2
    _one_line_error(capsys.readouterr().err, "log.json' exists and is not a regular file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for out in (locked, locked / "run"):
        with pytest.raises(SystemExit) as exc:
            main(["vmc", "--out", str(out)])
        assert exc.value.code == 2
        _one_line_error(capsys.readouterr().err, "is not writable")


# --- a full disk during the run -------------------------------------------------------------------


class _FullDiskOs:
    """``os`` for :mod:`vmcgrad.cli._output` whose files refuse every byte after ``ok`` files: the
    ``write``/``close`` of a full disk (``OSError(ENOSPC)``)."""

    def __init__(self, ok):
        self.ok, self.opened = ok, 0

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, mode="r", *args, **kwargs):
        f = os.fdopen(fd, mode, *args, **kwargs)
        self.opened += 1
        return f if self.opened <= self.ok else _FullFile(f)


class _FullFile:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _savefig_full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as PIL's write of the PNG raises it


def _in_process_run(args, capsys):
    # NetKet's global mesh, as after a plain `import netket`
    # (see tests/test_benchmarks.py::test_suite_writes_json_and_plot)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        rc = main(["vmc", *TINY, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.slow
def test_full_disk_while_writing_the_log_stops_with_one_line_and_keeps_the_log(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    full = _FullDiskOs(ok=4)  # run.json, the empty log, steps 1 and 2; step 3's log finds the disk full
    monkeypatch.setattr(_output, "os", full)
    monkeypatch.setattr(_report, "PLOT_EVERY_S", 1e9)
    rc, _, stderr = _in_process_run(["--steps", "50", "--out", str(out)], capsys)
    assert rc == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("vmcgrad vmc: error: cannot write ") and "log.json" in last, stderr
    assert "No space left on device (ENOSPC)" in last and "keeps the 2 steps written before" in last
    assert "Traceback" not in stderr
    log = _strict((out / "log.json").read_text())
    assert _check_log(log, n_steps=2) == 2 and log["status"] == "running"
    assert sorted(p.name for p in out.iterdir()) == ["log.json", "run.json"]  # no temporary, lock, png
    # step 3's log failed; the run stopped after that step, trying only the final plot (which the
    # full disk refused too): nothing more was written
    assert full.opened == 6


@pytest.mark.heavy
def test_full_disk_while_writing_the_plot_ends_with_one_line(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    out = tmp_path / "run"
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _savefig_full_disk)
    monkeypatch.setattr(_report, "PLOT_EVERY_S", 1e9)  # the plot at the end only
    rc, _, stderr = _in_process_run(["--steps", "2", "--out", str(out)], capsys)
    assert rc == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("vmcgrad vmc: error: cannot write ") and "energy.png" in last, stderr
    assert "No space left on device (ENOSPC)" in last and "has all 2 steps run" in last
    assert "Traceback" not in stderr
    log = _strict((out / "log.json").read_text())  # the plot is drawn last, after the final log
    assert _check_log(log, n_steps=2) == 2 and log["status"] == "finished"
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.mpack",
        "log.json",
        "params.mpack",
        "run.json",
    ]


# --- a second Ctrl-C ------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_ctrl_c_during_the_first_compile_ends_at_once_and_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = _start(["vmc", *TINY, "--steps", "100000", "--out", str(out)], tmp_path)
    try:
        deadline = time.monotonic() + 90
        line = ""
        while "exact energy" not in line:  # printed just before the driver compiles its first step
            assert time.monotonic() < deadline and proc.poll() is None, "no header within 90 s"
            line = proc.stdout.readline()
        while not (out / "log.json").exists():  # the empty log is written, then the first step compiles
            assert time.monotonic() < deadline and proc.poll() is None, "no log.json within 90 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)  # still inside the first step's compile (it takes seconds)
        proc.send_signal(signal.SIGINT)
        t_second = time.monotonic()
        rc, _, stderr = _finish(proc, timeout=60)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    waited = time.monotonic() - t_second
    assert rc == 130, stderr
    assert waited < 3.0, f"took {waited:.1f} s after the second Ctrl-C"  # not after the compile
    assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr
    assert "vmcgrad vmc: stopped at once (second interrupt); kept" in stderr, stderr
    log = _strict((out / "log.json").read_text())
    assert log["status"] == "interrupted" and log["energy_mean"] == []
    assert sorted(p.name for p in out.iterdir()) == ["log.json", "run.json"]  # no temporary, lock removed


# --- missing optional dependencies, a full disk at the start, unexpected exceptions ----------------


@pytest.mark.parametrize("hidden", [("matplotlib",), ("tqdm",), ("netket", "tqdm")])
def test_a_missing_optional_dependency_is_named_before_anything_runs(tmp_path, monkeypatch, capsys, hidden):
    """Without the ``[cli]`` extra: one line naming the modules and the pip command, status 1, nothing
    created, nothing run (before: set-up and a first step, then ModuleNotFoundError and a log saying
    "interrupted")."""
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: `import name` fails
    out = tmp_path / "run"
    rc = main(["vmc", *TINY, "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    names = " and ".join(hidden)
    _one_line_error(
        err,
        f"vmcgrad vmc: error: {names} {'is' if len(hidden) == 1 else 'are'} not installed;",
        "pip install 'vmcgrad[cli]'",
    )
    assert not out.exists()


class _FullDiskLockOs:
    """``os`` for :mod:`vmcgrad.cli._lock` on a disk that is full: files and directories can be created
    (their inodes are free) but not a byte written (``OSError(ENOSPC)``), as a full ext4 behaves."""

    def __getattr__(self, name):
        return getattr(os, name)

    def pwrite(self, fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_at_the_start_creates_nothing(tmp_path, monkeypatch, capsys):
    """``--out a/b/run2`` on a full disk: one line, status 2, and neither ``run2`` nor ``a`` nor a lock
    file is left behind (before: ``run2/`` with an empty lock file)."""
    monkeypatch.setattr(_lock, "os", _FullDiskLockOs())
    out = tmp_path / "a" / "b" / "run2"
    with pytest.raises(SystemExit) as exc:
        main(["vmc", "--out", str(out)])
    assert exc.value.code == 2
    _one_line_error(
        capsys.readouterr().err,
        f"vmcgrad vmc: error: argument --out: cannot create {str(out)!r}: ",
        "No space left on device (ENOSPC)",
    )
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "run3"  # an existing directory stays, without a lock file
    existing.mkdir()
    with pytest.raises(SystemExit):
        main(["vmc", "--out", str(existing)])
    capsys.readouterr()
    assert list(existing.iterdir()) == []


def test_an_unexpected_exception_is_logged_as_failed_with_the_error(tmp_path, monkeypatch, capsys):
    """An exception that is not an interrupt (here: the energy's statistics break at step 2) is logged
    "failed" with its type and message, and raised (before: the log said "interrupted")."""
    out = tmp_path / "run"
    calls = {"n": 0}
    real = _report.Recorder.__call__

    def breaks_at_step_2(self, step, log_data, driver):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ZeroDivisionError("a bug in a callback")
        return real(self, step, log_data, driver)

    monkeypatch.setattr(_report.Recorder, "__call__", breaks_at_step_2)
    monkeypatch.setattr(_report, "PLOT_EVERY_S", 1e9)
    with pytest.raises(ZeroDivisionError):
        _in_process_run(["--steps", "5", "--out", str(out)], capsys)
    log = _strict((out / "log.json").read_text())
    assert log["status"] == "failed" and log["error"] == "ZeroDivisionError: a bug in a callback"
    assert _check_log(log, n_steps=1) == 1
    assert sorted(p.name for p in out.iterdir()) == ["energy.png", "log.json", "run.json"]  # lock released


def test_an_exception_during_the_set_up_is_logged_as_failed(tmp_path, monkeypatch, capsys):
    """Before the first log (here: the system cannot be built): a log without steps, "failed"."""
    out = tmp_path / "run"

    def broken(*args):
        raise RuntimeError("cannot build the lattice\nsecond line")

    monkeypatch.setattr(vmc._systems, "build", broken)
    with pytest.raises(RuntimeError):
        _in_process_run(["--steps", "5", "--out", str(out)], capsys)
    log = _strict((out / "log.json").read_text())
    assert log["status"] == "failed" and log["error"] == "RuntimeError: cannot build the lattice"
    assert log["energy_mean"] == [] and log["config"]["steps"] == 5
    assert sorted(p.name for p in out.iterdir()) == ["log.json"]
