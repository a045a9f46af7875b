"""``benchmarks/local_values.py``: a step's local energies, vmcgrad's automatic chunk against NetKet."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_local_values_rows_give_each_platforms_chunk_its_counts_and_netkets_values(tmp_path):
    """The smoke run of device.sh's `local` step (the 12-site chain, N = 32, vmcgrad's default
    budget): one row per contender; priced for the CPU the state keeps the gradient's chunk, priced
    for the TPU it takes one pass of every connected configuration, a program of fewer ops in
    sequence whose compiled bytes are NetKet's unchunked program's; every row's values equal
    NetKet's unchunked ones to float32 rounding."""
    rows_path = tmp_path / "rows.jsonl"
    argv = [
        "--problem", "chain", "--layers", "1", "--features", "4", "--n", "32", "--chunk", "8",
        "--runs", "1", "--budget-mib", "default", "--priced", "cpu", "tpu", "cpu", "--json", str(rows_path),
    ]  # fmt: skip
    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks") + ":" + str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "local_values.py"), *argv],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    assert list(rows) == ["netket", "netket-chunk", "vmcgrad-cpu", "vmcgrad-tpu"], list(rows)
    netket, chunked, cpu, tpu = rows.values()
    assert (netket["chunk"], chunked["chunk"]) == (None, 8)
    assert cpu["chunk"] == 32 and tpu["chunk"] >= 32 * 2 * 12, (cpu, tpu)  # N × (up to 2L conns)
    assert tpu["ops"] < cpu["ops"] and tpu["tpu_ms"] < cpu["tpu_ms"], (cpu, tpu)
    assert tpu["mib"] == netket["mib"] and tpu["ops"] == netket["ops"], (tpu, netket)
    for r in rows.values():
        assert r["max_abs_diff"] <= 64 * np.finfo(np.float32).eps * r["max_abs"], r
        assert r["first_s"] > 0 and r["median_s"] > 0, r
