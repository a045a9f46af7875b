"""``benchmarks/accelerator_cost.py``: its smoke run (the table itself is a benchmark, not a test)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_table_costs_every_comparison_from_its_compiled_programs(tmp_path):
    from vmcgrad._hlo.cost import PLATFORMS

    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks") + ":" + str(ROOT)}
    rows_path, table_path = tmp_path / "rows.jsonl", tmp_path / "table.md"
    script = str(ROOT / "benchmarks" / "accelerator_cost.py")
    argv = [sys.executable, script, "--smoke", "--json", str(rows_path), "--markdown", str(table_path)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    programs = [r for r in rows if r["row"] == "program"]
    comparisons = [r for r in rows if r["row"] == "comparison"]
    keys = ["minsr-chunk", "minsr-auto", "minsr-auto-big", "minsr-n-big", "minsr-n-big-small-budget"]
    assert [c["key"] for c in comparisons] == [*keys, "qgt", "qgt-built", "grad"]
    # each program once (NetKet's chunked N = 32 MinSR program and its QGT product serve two comparisons
    # each): 8 of vmcgrad's, 5 of NetKet's
    assert len(programs) == 13, [(p["program"], p["N"], p["chunk"]) for p in programs]
    for p in programs:
        assert p["ops"] >= 10 and p["gflop"] > 0 and p["gbytes"] > 0 and p["temp_mib"] > 0, p
        assert p["compiled_on"] == "cpu" and p["unknown_trip_loops"] == 0, p
        assert p["loops"] >= 1, p  # every kernel here loops over chunks or blocks
        # the modelled times are the model's formula on the counts
        for name in ("cpu", "gpu", "tpu"):
            c = PLATFORMS[name]
            seconds = p["ops"] * c.t_op + 1e9 * (p["gflop"] / c.peak_flops + p["gbytes"] / c.bandwidth)
            want = 1e3 * seconds
            assert p[f"{name}_ms"] == pytest.approx(want, rel=1e-9), (name, p)
    for c in comparisons:
        assert set(c["ratio"]) == {"cpu", "gpu", "tpu"} and min(c["ratio"].values()) > 0, c
    table = table_path.read_text()
    assert "python benchmarks/accelerator_cost.py --smoke" in table
    assert table.count("| vmcgrad ") == 8 and table.count("| NetKet ") == 8, table
