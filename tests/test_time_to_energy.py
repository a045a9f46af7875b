"""``benchmarks/time_to_energy.py``: its one-minute smoke run (the race itself is a benchmark, not a test)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


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
        # the phases add up to no more than the step (each is timed inside it)
        assert r["sample_s"] + r["local_s"] + r["sr_s"] <= r["step_s"] * (1 + 1e-6) + 1e-6, r
        # the sample-space kernel's compiled program, measured at the contender's own N and chunk
        assert r["kernel_mib"] is not None and 0 < r["kernel_mib"] <= budget_mib, r
        assert r["peak_rss_mib"] > 0
    assert (out / "energy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| vmcgrad-vmcsr | 0 | 128 |" in (out / "table.md").read_text()
    assert os.path.exists(out / "trace-vmcgrad-vmcsr-seed0.jsonl")
