"""Every message of ``vmcgrad vmc`` in the command's own terms: the lock refusal names the option the
user gave; a lost process and a second Ctrl-C end with the ``--resume`` line; too few samples are
refused before anything runs, with the minimum (NetKet's, checked here against NetKet); a sample
count rounded to the chains is said in one line; singular and plural.
"""

import argparse
import json

import numpy as np
import pytest
from helpers import synthetic_checkpoint as _synthetic

from vmcgrad.cli import _checkpoint, _lock, _report, _supervise, _vmc_options, main, vmc


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vmcgrad vmc: error: ") and "Traceback" not in err, err
    return err


def test_the_lock_refusal_names_resume_when_the_user_gave_resume(tmp_path, capsys):
    path = _synthetic(tmp_path / "run", step=2)
    held = _lock.OutDirLock.acquire(path.parent)  # a first --resume of the same folder holds it
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["vmc", "--resume", str(path.parent), "--steps", "8"])
        assert exit_.value.code == 2
        err = _one_line(capsys)
        assert "argument --resume: " in err and "argument --out" not in err, err
        assert "in use by another vmcgrad run" in err and "resume it once that run has ended" in err
    finally:
        held.release()


def test_the_minimum_of_samples_is_netkets(tmp_path, capsys):
    import netket as nk

    rng = np.random.default_rng(0)
    for chains in (1, 2, 4, 8, 16, 31):  # below the minimum, NaN for any split into chains
        per_chain = max(1, (_vmc_options.MIN_SAMPLES - 1) // chains)
        assert np.isnan(nk.stats.statistics(rng.normal(size=(chains, per_chain))).error_of_mean)
    for chains in (1, 2, 4, 8, 16, 32):  # at it, finite
        x = rng.normal(size=(chains, _vmc_options.MIN_SAMPLES // chains))
        assert np.isfinite(nk.stats.statistics(x).error_of_mean)
    with pytest.raises(SystemExit) as exit_:
        main(["vmc", "--samples", "10", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = _one_line(capsys)
    assert "argument --samples: must be at least 32; got 10" in err and "Fix: --samples 32" in err
    assert not (tmp_path / "run").exists()


def _header(capsys, **info):
    args = argparse.Namespace(
        model="rbm",
        diag_shift=0.01,
        lr=0.03,
        steps=5,
        chunk_size=64,
        memory_budget=None,
        grow_samples=None,
        system="heisenberg1d",
    )
    base = {
        "description": "a chain",
        "n_parameters": 80,
        "n_samples": 1008,
        "samples_given": 1000,
        "n_chains": 48,
        "n_devices": 3,
        "n_processes": 1,
        "chunk_size": {"gradient": 64, "qgt": 64},
        "qgt_design": "fused",
        "driver_taken": "sr",
        "driver_reason": "--driver auto: 80 parameters <= 1008 samples",
    }
    _report.print_header(args, {**base, **info}, -1.0, "table")
    return capsys.readouterr().out


def test_a_sample_count_rounded_to_the_chains_is_said_in_one_line(capsys):
    out = _header(capsys)
    notes = [line for line in out.splitlines() if "rounded" in line]
    assert notes == [
        "note: --samples 1000 rounded up to 1008, the same number in each of the 48 chains "
        "(16 per device on 3 devices)"
    ]
    assert "rounded" not in _header(capsys, samples_given=1008)
    assert "on 1 device," in _header(capsys, n_devices=1, n_chains=16, samples_given=1008)


def test_a_lost_process_ends_with_the_resume_line(tmp_path):
    out = tmp_path / "run"
    _synthetic(out, step=2)  # the run had written a checkpoint before the process was lost
    args = argparse.Namespace(process_id=0, out=str(out))
    note = vmc.mark_log(args, "failed", "lost process 1 of 2")
    assert note.endswith(f"continue from the checkpoint with `vmcgrad vmc --resume {out}`"), note
    assert json.loads((out / "log.json").read_text())["status"] == "failed"
    (out / _checkpoint.CHECKPOINT).unlink()  # none written yet: no hint
    assert "--resume" not in vmc.mark_log(args, "failed", "lost process 1 of 2")


#: What a multi-process run's child prints besides ours: Gloo's line (seen on stdout), glog/absl lines
#: of JAX's distributed client (the format of absl's LogMessage), and ours.
THEIRS = [
    b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
    b"I0000 00:00:1733428123.456789   12345 distributed.cc:123] Connecting to coordination service\n",
    b"W0102 12:00:00.123456 777 client.cc:9] heartbeat slow\n",
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
]
OURS = [b"vmcgrad vmc: a header line\n", b"step 1/3 |#   | E = -1\r", b"Info: a line of the user\n"]


def _relayed(tmp_path, third_party, chunks):
    import io
    import os
    import threading
    import time

    r, w = os.pipe()
    out = io.BytesIO()
    stream = io.TextIOWrapper(out, write_through=True)

    def write():
        for chunk in chunks:
            os.write(w, chunk)
            time.sleep(0.002)  # the relay sees partial lines
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    _supervise._relay(r, stream, third_party)
    writer.join()
    os.close(r)
    return out.getvalue()


def test_third_party_log_lines_go_to_the_run_folder_unless_verbose(tmp_path):
    lines = [OURS[0], THEIRS[0], THEIRS[1], OURS[1], THEIRS[2], OURS[2], THEIRS[3]]
    log = tmp_path / _supervise.THIRD_PARTY_LOG
    # split mid-line too: a partial third-party line waits for its end
    data = b"".join(lines)
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    shown = _relayed(tmp_path, log, chunks)
    assert shown == b"".join(OURS), shown
    assert log.read_bytes() == b"".join(THEIRS)
    assert _relayed(tmp_path, None, chunks) == data  # --verbose: all of it, in order


@pytest.mark.parametrize("max_samples, named", [(16, False), (32, True), (None, False)])
def test_a_budget_no_route_fits_names_only_samples_the_option_takes(max_samples, named, capsys):
    """The exit 2 of a budget no MinSR route fits names ``--samples K`` only where K is at least
    ``--samples``' own minimum (32): a fix the command would refuse is no fix."""
    from vmcgrad.cli import _phases

    class NoRoute:
        def route_at(self, n):
            error = MemoryError("no route fits")
            error.need, error.max_samples = 3 * 2**20, max_samples
            raise error

    p = argparse.ArgumentParser(prog="vmcgrad vmc")
    p.error = lambda message: (_ for _ in ()).throw(SystemExit(message))
    args = argparse.Namespace(memory_budget=2**20, _parser=p)
    with pytest.raises(SystemExit) as exit_:
        _phases.route_or_exit(args, NoRoute(), 1024, _vmc_options.MIN_SAMPLES)
    message = str(exit_.value.code)
    assert "fits 1.0 MiB per device" in message and "Fix: pass --memory-budget 6MiB" in message, message
    assert ("--samples" in message) == named, message
    if named:
        assert f"at most --samples {max_samples} at this budget" in message
