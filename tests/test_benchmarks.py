"""The benchmark suite's runner (``python benchmarks/run.py``, :mod:`benchlib.suite`), in-process and tiny.

``benchmarks/`` is on ``sys.path`` through pytest's ``pythonpath`` (pyproject.toml), as it is for the
scripts run from there; the suite is not part of the installed package.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from benchlib import suite
from helpers import N_DEVICES, child_env, start
from helpers import is_png as _is_png

ROOT = Path(__file__).resolve().parents[1]


def _strict(text):
    """``json.loads`` as a strict parser reads it: no NaN/Infinity."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _run_in_process(argv):
    # NetKet's global mesh, as after a plain `import netket` (test modules import NetKet with the
    # context mesh cleared, so that it does not leak into other tests)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        return suite.main([*argv, "--devices", str(N_DEVICES)])


def test_ratios_pair_vmcgrad_with_its_own_setting():
    def row(name, dtype, t, mem, loop, out):
        setting = {"bench": "core_vjp", "devices": 2, "dtype": dtype, "L": 8, "N": 64, "chunk": 16}
        measured = {"median_s": t, "times_s": [t], "temp_bytes": mem}
        return {**setting, "name": name, **measured, "collectives_in_loops": loop, "collectives_outside": out}

    rows = [
        row("vmcgrad", "float64", 1.0, 100, 0, 1),
        row("netket", "float64", 2.0, 400, 0, 1),
        row("jax.vjp", "float64", 4.0, 1000, 0, 1),
        row("vmcgrad", "complex128", 3.0, 300, 0, 1),
        row("netket", "complex128", 3.0, 150, 1, 1),
    ]
    entries = suite.ratios(rows)
    assert [(e["dtype"], e["name"]) for e in entries] == [("float64", "vmcgrad"), ("complex128", "vmcgrad")]
    real, cplx = entries
    assert (real["time_vs_netket"], real["memory_vs_netket"]) == (0.5, 0.25)
    assert (real["time_vs_jax"], real["memory_vs_jax"]) == (0.25, 0.1)
    assert (cplx["time_vs_netket"], cplx["memory_vs_netket"], "time_vs_jax" in cplx) == (1.0, 2.0, False)
    assert (cplx["collectives"], cplx["collectives_netket"]) == ("0/1", "1/1")
    table = suite.format_ratios(entries)
    assert "complex128" in table.splitlines()[3] and "0.25" in table.splitlines()[2]


def test_suite_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    sizes = ["--L", "6", "--samples", "32", "48", "--chunk-sizes", "8", "--repeats", "1"]
    rc = _run_in_process(["--only", "grad", *sizes, "--out", str(out)])
    captured = capsys.readouterr()
    stdout = captured.out
    assert rc == 0, stdout + captured.err
    result = json.loads((out / "bench.json").read_text())
    assert result["errors"] == [] and result["status"] == "finished"
    assert {(r["bench"], r["N"], r["chunk"]) for r in result["rows"]} == {
        ("grad_rbmmodphase", 32, 8),
        ("grad_rbmmodphase", 48, 8),
    }
    assert {r["name"] for r in result["rows"]} == {"vmcgrad", "netket", "jax.vjp"}
    assert all(e["time_vs_netket"] > 0 and e["time_vs_jax"] > 0 for e in result["ratios"])
    if N_DEVICES > 1:  # one reduction after the loop, none inside
        assert all(e["collectives"].startswith("0/") for e in result["ratios"])
    assert _is_png(out / "bench.png")
    assert "t/netket" in stdout


@pytest.mark.skipif(N_DEVICES == 1, reason="one device divides every count")
def test_suite_rounds_the_sample_counts_up_to_a_multiple_of_the_devices(tmp_path, capsys):
    out = tmp_path / "bench"
    n = 2 * N_DEVICES + 1
    used = 3 * N_DEVICES
    sizes = ["--L", "6", "--samples", str(n), "--chunk-sizes", "4", "--repeats", "1"]
    rc = _run_in_process(["--only", "grad", *sizes, "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert (
        f"benchmarks/run.py: note: --samples {n} is not a multiple of the {N_DEVICES} devices; "
        f"using {used} (each device takes an equal share)"
    ) in captured.out
    result = _strict((out / "bench.json").read_text())
    assert result["errors"] == [] and result["samples_used"] == [used]
    assert {(r["bench"], r["N"]) for r in result["rows"]} == {("grad_rbmmodphase", used)}
    assert _is_png(out / "bench.png")


@pytest.mark.parametrize(
    "given", [["--L", "8"], ["--samples", "64"], ["--chunk-sizes", "8"], ["--only", "grad"]]
)
def test_large_suite_refuses_the_default_suites_options(given, capsys):
    """``--suite large`` runs bench_large.py with its defaults: an option it would ignore is a usage error."""
    with pytest.raises(SystemExit) as exc:
        suite.parse(["--suite", "large", *given])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{given[0]} not taken by --suite large" in err and "bench_large.py --help" in err


def test_defaults_filled_when_not_given():
    args = suite.parse([])
    assert (args.suite, args.L, args.samples, args.chunk_sizes) == ("default", 32, [1024, 4096], [128, 512])
    assert suite.parse(["--suite", "large", "--repeats", "1"]).suite == "large"


def test_run_py_help_in_a_fresh_process():
    """The one command of the suite starts from a checkout with nothing but vmcgrad importable."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--suite" in proc.stdout and "minutes" in proc.stdout


@pytest.mark.slow
def test_compile_time_plugin_attributes_programs_to_tests_and_names(tmp_path):
    """``benchmarks/pytest_compile_time.py`` on two tests: the one that jits a function is listed
    with that program (one compile, under the function's name); the one that runs no JAX, with 0."""
    (tmp_path / "test_tiny.py").write_text(
        "import jax, jax.numpy as jnp\n\n"
        "def test_compiles():\n"
        "    def doubled_sum(x):\n        return (2 * x).sum()\n\n"
        "    assert float(jax.jit(doubled_sum)(jnp.ones(3))) == 6.0\n\n"
        "def test_pure_python():\n    assert sum(range(4)) == 6\n"
    )
    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks")}
    plugins = ["-p", "pytest_compile_time", "-p", "no:xdist", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *plugins, "--compile-time-top=5", "test_tiny.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    tests = {line.split()[-1]: int(line.split()[-2]) for line in lines if "test_tiny.py::" in line}
    assert tests["test_tiny.py::test_pure_python"] == 0, proc.stdout
    assert tests["test_tiny.py::test_compiles"] >= 1, proc.stdout
    programs = {line.split()[-1]: int(line.split()[-2]) for line in lines if line.endswith("doubled_sum")}
    assert programs == {"doubled_sum": 1}, proc.stdout


# --- a suite stopped by Ctrl-C or SIGTERM ---------------------------------------------------------


def _signal_self(signum, then_wait=True):
    """Sends ``signum`` to this process, as a user's Ctrl-C or `kill` would; waits for the handler."""
    os.kill(os.getpid(), signum)
    if then_wait:
        time.sleep(30)  # the handler runs in the main thread and raises here


@pytest.mark.slow
def test_a_stopped_suite_writes_the_summary_once_and_a_second_signal_cannot_cut_it(
    tmp_path, capsys, monkeypatch
):
    """SIGTERM during the second setting: the suite stops there and writes what the first finished, as at
    the end (bench.json "interrupted" with its ratios, bench.png, the table), status 130; a second SIGTERM
    that arrives while that summary is drawn changes nothing (before: SIGTERM ended the process with
    nothing written, and Ctrl-C kept bench.json only, without plot or table)."""
    from benchlib import grad

    real_run, real_plot, calls = grad.run, suite.plot, []

    def stopped_in_the_second_setting(**kwargs):
        calls.append(kwargs["n_samples"])
        if len(calls) == 2:
            _signal_self(signal.SIGTERM)
            pytest.fail("SIGTERM did not stop the suite")
        return real_run(**kwargs)

    def signalled_while_drawing(*args, **kwargs):
        _signal_self(signal.SIGTERM, then_wait=False)
        time.sleep(0.2)  # the handler runs (in vain) while the summary is being written
        return real_plot(*args, **kwargs)

    monkeypatch.setattr(grad, "run", stopped_in_the_second_setting)
    monkeypatch.setattr(suite, "plot", signalled_while_drawing)
    out = tmp_path / "bench"
    sizes = ["--L", "6", "--samples", "8", "16", "--chunk-sizes", "4"]  # (N, chunk) in (8, 4), (16, 4)
    previous = signal.getsignal(signal.SIGTERM)
    rc = _run_in_process(["--only", "grad", *sizes, "--repeats", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert signal.getsignal(signal.SIGTERM) is previous  # the suite's handlers are gone
    assert rc == 130, captured.out + captured.err
    assert calls == [8, 16]
    result = _strict((out / "bench.json").read_text())
    assert result["status"] == "interrupted" and {r["N"] for r in result["rows"]} == {8}
    assert result["ratios"] and all(e["N"] == 8 for e in result["ratios"])
    assert captured.out.count("vmcgrad impl") == 1  # the table, once
    assert f"wrote {out / 'bench.json'} and {out / 'bench.png'}" in captured.out
    assert f"benchmarks/run.py: interrupted; kept the {len(result['rows'])} rows" in captured.err
    assert _is_png(out / "bench.png")
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.png"]  # no temporary


@pytest.mark.slow
def test_a_signal_while_the_final_summary_is_written_changes_nothing(tmp_path, capsys, monkeypatch):
    """Ctrl-C as the suite draws its plot, after every setting finished: the summary is completed, the
    status is "finished" and 0 (a KeyboardInterrupt there would leave bench.json without bench.png)."""
    real_plot = suite.plot

    def signalled_while_drawing(*args, **kwargs):
        _signal_self(signal.SIGINT, then_wait=False)
        time.sleep(0.2)  # the handler runs while the summary is being written
        return real_plot(*args, **kwargs)

    monkeypatch.setattr(suite, "plot", signalled_while_drawing)
    out = tmp_path / "bench"
    sizes = ["--L", "6", "--samples", "8", "--chunk-sizes", "4", "--repeats", "1"]
    rc = _run_in_process(["--only", "grad", *sizes, "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert _strict((out / "bench.json").read_text())["status"] == "finished"
    assert _is_png(out / "bench.png") and "vmcgrad impl" in captured.out


@pytest.mark.slow
def test_run_py_stopped_by_sigterm_keeps_the_summary_and_the_plot(tmp_path):
    """``python benchmarks/run.py`` as a user starts it, SIGTERM twice after the first setting: status
    130, no traceback, bench.json ("interrupted", the rows that finished), bench.png and the table of
    ratios (before: SIGTERM ended the process with nothing written)."""
    out = tmp_path / "bench"
    sizes = ["--L", "6", "--samples", "8", "16", "32", "--chunk-sizes", "4", "--repeats", "1"]
    sizes += ["--devices", str(N_DEVICES)]
    proc = start([str(ROOT / "benchmarks" / "run.py"), "--only", "grad", *sizes, "--out", str(out)], tmp_path)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        stdout = ""
        while "rows in" not in stdout:  # the first setting finished
            assert proc.poll() is None, proc.communicate()
            try:
                stdout += lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no setting finished within 180 s:\n{stdout}")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        stderr = proc.stderr.read()
        time.sleep(0.2)
        while not lines.empty():
            stdout += lines.get()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert rc == 130, stderr
    assert "Traceback" not in stderr and "benchmarks/run.py: interrupted; kept the" in stderr, stderr
    result = _strict((out / "bench.json").read_text())
    finished = {r["N"] for r in result["rows"]}  # the first setting, and the second if JAX swallowed
    assert result["status"] == "interrupted" and {8} <= finished <= {8, 16}  # the KeyboardInterrupt
    assert result["ratios"] and all(e["N"] in finished for e in result["ratios"])
    assert "vmcgrad impl" in stdout and f"wrote {out / 'bench.json'} and {out / 'bench.png'}" in stdout
    assert _is_png(out / "bench.png")
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.png"]  # no temporary


def test_max_rel_err_is_relative_to_the_results_scale_not_each_leafs():
    """A leaf that is exactly 0 in the reference and rounding-sized in the candidate (NetKet's ViT
    update: the output bias) is not an error of 1e+286: the error is relative to the whole result."""
    from benchlib._harness import max_rel_err

    ref = {"w": np.array([1.0, -2.0]), "b": np.zeros(3)}
    got = {"w": np.array([1.0, -2.0 + 4e-15]), "b": np.array([0.0, 3e-15, 0.0])}
    assert max_rel_err(got, ref) == pytest.approx(2e-15, rel=1e-6)
    # a real disagreement is still reported at its size, whichever leaf holds it
    got["b"] = np.array([0.0, 0.5, 0.0])
    assert max_rel_err(got, ref) == pytest.approx(0.25, rel=1e-12)
    assert max_rel_err(ref, ref) == 0.0


def test_sr_phase_benchmark_times_every_route_on_one_gradient(tmp_path, capsys):
    """benchmarks/bench_sr_phase.py on a small GCNN: every contender timed on the same samples and
    gradient, vmcgrad's auto route keeping its linearisations at a budget that holds them, and the
    updates agreeing (two CG iterations on a well-conditioned S: rounding only)."""
    import bench_sr_phase

    out = tmp_path / "sr.json"
    argv = ["--n", "32", "--cg-iters", "2", "--repeats", "1", "--layers", "1", "--features", "2"]
    argv += ["--budget-mib", "256", "--diag-shift", "0.1", "--json", str(out)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        bench_sr_phase.main(argv)
    rows = _strict(out.read_text())["rows"]
    assert [r["contender"] for r in rows] == ["netket", "netket-chunked", "vmcgrad-auto", "vmcgrad-recompute"]
    assert all(r["n"] == 32 and len(r["times_s"]) == 1 and r["median_s"] > 0 for r in rows)
    auto = rows[2]
    assert "kept_solve=" in auto["route"] and "kept_solve=None" not in auto["route"], auto["route"]
    assert auto["kept_mib"] > 0
    assert max(r["max_rel_diff"] for r in rows) < 1e-8, rows
    assert "vmcgrad-auto" in capsys.readouterr().out

    scan = tmp_path / "scan.json"  # --chunk-scan: the core solve per chunk, both routes
    argv = ["--n", "32", "--chunk-scan", "8", "32", "--cg-iters", "2", "--repeats", "1", "--layers", "1"]
    with jax.set_mesh(mesh):
        bench_sr_phase.main([*argv, "--features", "2", "--json", str(scan)])
    rows = {(r["chunk"], r["route"]): r for r in _strict(scan.read_text())["rows"]}
    assert sorted(rows) == [(8, "kept"), (8, "recomputed"), (32, "kept"), (32, "recomputed")]
    assert all(r["median_s"] > 0 and r["mib"] > 0 for r in rows.values())
    assert rows[(8, "kept")]["mib"] > rows[(8, "recomputed")]["mib"]  # every chunk's residuals at once
