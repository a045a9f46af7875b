"""The benchmark suite's runner (``python benchmarks/run.py``, :mod:`benchlib.suite`), in-process and tiny.

``benchmarks/`` is on ``sys.path`` through pytest's ``pythonpath`` (pyproject.toml), as it is for the
scripts run from there; the suite is not part of the installed package.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from benchlib import suite
from test_cli import N_DEVICES, _is_png

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
