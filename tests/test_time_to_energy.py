"""``benchmarks/time_to_energy.py``: its one-minute smoke run (the race itself is a benchmark, not a test)."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


def _table_rows(text: str) -> dict[str, list[str]]:
    """The cells of each line of a :func:`benchlib.table` (columns apart by two spaces or more), by
    the line's first cell; the header's key is ``"contender"``."""
    lines = [line for line in text.splitlines() if line and not set(line) <= {"-"}]
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines)}


def _table_md(out: Path) -> tuple[str, dict[str, list[str]]]:
    """table.md's text and the rows of the table in its fenced code block."""
    text = (out / "table.md").read_text()
    block = re.search(r"```\n(.*?)\n```", text, re.S)
    assert block, text
    return text, _table_rows(block.group(1))


@pytest.mark.slow
def test_smoke_race_writes_a_table_a_plot_and_runs_within_the_budget(tmp_path):
    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks")}
    out = tmp_path / "race"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "time_to_energy.py"), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["contender"] for r in rows} == {"netket-vmcsr", "vmcgrad-vmcsr"}
    budget_mib = 16.0
    for r in rows:
        assert r["steps"] >= 1, r
        assert math.isfinite(r["final_rel"]) and r["final_rel"] >= 0, r
        # each step's phases add up to no more than the step (each is timed inside it); the table's
        # medians need not add up (a median of sums is not the sum of medians)
        trace = out / f"trace-{r['contender']}-seed{r['seed']}.jsonl"
        steps = [json.loads(line) for line in trace.read_text().splitlines()[1:-1]]
        assert len(steps) == r["steps"], (len(steps), r)
        for step in steps:
            assert step["sample_s"] + step["local_s"] + step["sr_s"] <= step["step_s"] * (1 + 1e-9) + 1e-9, (
                step
            )
        # the sample-space kernel's compiled program, measured at the contender's own N and chunk
        assert r["kernel_mib"] is not None and 0 < r["kernel_mib"] <= budget_mib, r
        assert r["peak_rss_mib"] > 0
    assert (out / "energy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, table = _table_md(out)
    assert table["vmcgrad-vmcsr"][:3] == ["vmcgrad-vmcsr", "0", "128"], table
    assert table["netket-vmcsr"][:4] == ["netket-vmcsr", "0", "64", "32"], table
    assert os.path.exists(out / "trace-vmcgrad-vmcsr-seed0.jsonl")


# --- the report, without running a race (quick tier) ------------------------------------------


def _fake_trace(path: Path, n: int, device_peak: int | None) -> Path:
    """A worker's trace of three steps: the head, the steps, the tail (as ``worker`` writes them)."""
    e0 = -18.0
    head = {"e0": e0, "n_params": 440, "n": n, "device": "1 x gpu NVIDIA H200"}
    steps = [
        {"t": 10.0 + i, "step_s": 1.0, "E": e0 * (1 - 0.1 / (i + 1)), "E_err": 0.01, "var": 0.1}
        | {"sample_s": 0.2, "local_s": 0.3, "sr_s": 0.4}
        for i in range(3)
    ]
    tail = {"kernel_bytes": 2 * 2**20, "peak_rss": 2**30, "device_peak": device_peak, "chunk": "32"}
    path.write_text("".join(json.dumps(line) + "\n" for line in [head, *steps, tail]))
    return path


def test_a_failed_contender_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    import time_to_energy as tte

    def run_one(args, name, seed, out, core=None):
        if name == "netket-vmcsr":
            raise RuntimeError(f"time_to_energy: {name} seed {seed} failed:\nXlaRuntimeError: boom")
        return _fake_trace(out / f"trace-{name}-seed{seed}.jsonl", args.sizes[name][0], 3 * 2**20)

    monkeypatch.setattr(tte, "run_one", run_one)
    out = tmp_path / "race"
    assert tte.main(["--smoke", "--out", str(out)]) == 1
    results = json.loads((out / "results.json").read_text())
    assert [r["contender"] for r in results["rows"]] == ["vmcgrad-vmcsr"]
    assert [(f["contender"], f["seed"]) for f in results["failed"]] == [("netket-vmcsr", 0)]
    assert "boom" in results["failed"][0]["error"]
    text, table = _table_md(out)
    assert table["vmcgrad-vmcsr"][:5] == ["vmcgrad-vmcsr", "0", "128", "32", "3"], table
    assert "netket-vmcsr" not in table and "failed: netket-vmcsr seed 0" in text
    assert (out / "energy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--parallel 2 needs two CPU cores")
def test_parallel_runs_pin_the_runs_of_a_seed_to_cores_of_their_own(tmp_path, monkeypatch):
    """``--parallel 2``: the two runs of the smoke's seed run at once, each given its own core (the
    worker pins itself with it); a count beyond the cores is refused before anything runs."""
    import time_to_energy as tte

    seen = []

    def run_one(args, name, seed, out, core=None):
        seen.append((name, core))
        time.sleep(0.2)  # both in flight at once
        return _fake_trace(out / f"trace-{name}-seed{seed}.jsonl", args.sizes[name][0], 3 * 2**20)

    monkeypatch.setattr(tte, "run_one", run_one)
    assert tte.main(["--smoke", "--parallel", "2", "--out", str(tmp_path / "race")]) == 0
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert sorted(seen) == [("netket-vmcsr", cores[0]), ("vmcgrad-vmcsr", cores[1])], seen
    with pytest.raises(SystemExit):
        tte.parse(["--parallel", str(len(os.sched_getaffinity(0)) + 1)])


def test_the_device_peak_column_appears_only_where_a_device_reports_it(tmp_path):
    import time_to_energy as tte

    gpu = tte.summarise("vmcgrad-vmcsr", 0, _fake_trace(tmp_path / "a.jsonl", 1024, 5 * 2**20), window=2)
    cpu = tte.summarise("netket-vmcsr", 0, _fake_trace(tmp_path / "b.jsonl", 256, None), window=2)
    assert gpu["device_peak_mib"] == 5.0 and cpu["device_peak_mib"] is None
    assert gpu["device"] == "1 x gpu NVIDIA H200"
    with_gpu = _table_rows(tte.race_table([cpu, gpu]))
    assert with_gpu["contender"][-2:] == ["peak RSS MiB", "device peak MiB"]
    assert with_gpu["netket-vmcsr"][-2:] == ["1024", "-"] and with_gpu["vmcgrad-vmcsr"][-2:] == ["1024", "5"]
    cpu_only = _table_rows(tte.race_table([cpu]))  # the CPU's table: peak RSS only
    assert cpu_only["contender"][-1] == "peak RSS MiB" and cpu_only["netket-vmcsr"][-1] == "1024"


@pytest.mark.parametrize("chains", ["0", "-4"])
def test_chains_must_be_positive(chains, capsys):
    import time_to_energy as tte

    with pytest.raises(SystemExit):
        tte.parse(["--chains", chains])
    assert f"--chains {chains}" in capsys.readouterr().err


def test_the_exact_energy_is_computed_by_the_first_run_only(tmp_path, monkeypatch):
    """The first worker computes the exact energy (Lanczos: 148 s on a TPU machine's host); the race
    hands it to the later workers (``--e0``), which skip Lanczos. A fake ``subprocess.run`` sees the
    argv of each worker and writes its trace."""
    import time_to_energy as tte

    argvs = []

    def fake_run(cmd, **kw):
        argvs.append(cmd)
        trace = Path(cmd[cmd.index("--worker") + 1].split(",", 2)[2])
        name = cmd[cmd.index("--worker") + 1].split(",")[0]
        _fake_trace(trace, 64 if name == "netket-vmcsr" else 128, None)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(tte.subprocess, "run", fake_run)
    assert tte.main(["--smoke", "--out", str(tmp_path / "race")]) == 0  # two runs
    assert len(argvs) == 2
    assert "--e0" not in argvs[0]
    for cmd in argvs[1:]:  # the fake trace's exact energy, -18.0
        assert float(cmd[cmd.index("--e0") + 1]) == -18.0, cmd
    # a worker given --e0 builds the problem without Lanczos and keeps the given energy
    args = tte.parse(["--smoke", "--e0", "-18.0"])
    *_, e0 = tte.build_problem(args, exact=args.e0 is None)
    assert e0 is None and args.e0 == -18.0
