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
    argv = [sys.executable, script, "--smoke", "--cost-platform", "tpu", "gpu"]
    argv += ["--json", str(rows_path), "--markdown", str(table_path)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    programs = [r for r in rows if r["row"] == "program"]
    comparisons = [r for r in rows if r["row"] == "comparison"]
    keys = ["minsr-chunk", "minsr-auto", "minsr-auto-big", "minsr-n-big", "minsr-n-big-small-budget"]
    keys += ["qgt", "qgt-solve", "qgt-built", "grad", "vjp", "jvp"]
    assert [(c["key"], c["priced_for"]) for c in comparisons] == [
        (k, p) for p in ("tpu", "gpu") for k in keys
    ]
    # each program once per platform priced for (NetKet's chunked N = 32 program serves two
    # comparisons and every platform, its QGT product two more): 11 of vmcgrad's per platform, 8 of
    # NetKet's
    ours = [p for p in programs if p["program"].startswith("vmcgrad")]
    theirs = [p for p in programs if not p["program"].startswith("vmcgrad")]
    assert len(theirs) == 8 and {p["priced_for"] for p in theirs} == {None}, theirs
    assert sorted(p["priced_for"] for p in ours) == ["gpu"] * 11 + ["tpu"] * 11, ours
    # a program the gpu's choices repeat is the tpu's, by its StableHLO, and is not compiled again
    tpu = {(p["kind"], p["N"], p["chunk"], p["budget_mib"]): p for p in ours if p["priced_for"] == "tpu"}
    assert not any("same_program_as" in p for p in tpu.values()), tpu  # the first platform's: all compiled
    for p in ours:
        if p["priced_for"] == "gpu":
            same = tpu[(p["kind"], p["N"], p["chunk"], p["budget_mib"])]
            assert ("same_program_as" in p) == (p["stablehlo_sha256"] == same["stablehlo_sha256"]), p
    for p in programs:
        assert p["ops"] >= 10 and p["gflop"] > 0 and p["gbytes"] > 0 and p["temp_mib"] > 0, p
        assert p["stablehlo_lines"] >= 50 and p["lower_s"] > 0 and p["compile_s"] > 0, p
        # the CG solve's loop stops on convergence: its trip count is not in the program
        assert p["compiled_on"] == "cpu" and p["unknown_trip_loops"] == (p["kind"] == "qgt-solve"), p
        assert p["loops"] >= (p["kind"] != "minsr"), p  # MinSR's "auto" may run its kernel in one block
        # the modelled times are the model's formula on the counts
        for name in ("cpu", "gpu", "tpu"):
            c = PLATFORMS[name]
            seconds = p["ops"] * c.t_op + 1e9 * (p["gflop"] / c.peak_flops + p["gbytes"] / c.bandwidth)
            want = 1e3 * seconds
            assert p[f"{name}_ms"] == pytest.approx(want, rel=1e-9), (name, p)
    for c in comparisons:
        assert {"cpu", "gpu", "tpu", "ops", "stablehlo_lines", "temp_mib"} <= set(c["ratio"]), c
        assert min(c["ratio"].values()) > 0, c
    table = table_path.read_text()
    assert "python benchmarks/accelerator_cost.py --smoke" in table
    # every comparison: NetKet's line, and vmcgrad's once per distinct program of the platforms
    distinct = len(ours) - sum("same_program_as" in p for p in ours)
    assert table.count("| vmcgrad ") == distinct and table.count("| NetKet ") == len(keys), table

    # the same table from the rows, nothing compiled, the run its own "before": the run's command is
    # recorded, and each vmcgrad line's ops and ratios stand beside themselves
    again_path = tmp_path / "again.md"
    argv = [sys.executable, script, "--smoke", "--cost-platform", "tpu", "gpu", "--from-rows", str(rows_path)]
    argv += ["--before", str(rows_path), "--markdown", str(again_path)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = again_path.read_text()
    assert "accelerator_cost.py --smoke --cost-platform tpu gpu --json" in again, again
    lines = [line.split(" | ") for line in again.splitlines() if line.startswith("| ")]
    head = lines[0]
    ours_lines = [cells for cells in lines if cells[0] == "| vmcgrad" or cells[0].startswith("| vmcgrad ")]
    assert len(ours_lines) == distinct, again
    for cells in ours_lines:
        row = dict(zip(head, cells))
        assert row["ops"].rstrip("†") == row["ops before"], row
        assert row["ratio cpu/gpu/tpu"] == row["ratio before"], row


@pytest.mark.slow
def test_run_times_each_program_and_keeps_the_hlo_it_costed(tmp_path):
    """``--run K``: each program compiled (MinSR's update and the gradient here) is run (a warm-up, then
    K runs) on the arguments it was lowered with, the median beside the modelled times and the
    measured ratio in the comparison; ``--hlo-dir``: the optimized HLO each row was costed from, which
    ``program_cost`` reads back to the row's counts."""
    import vmcgrad

    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks") + ":" + str(ROOT)}
    rows_path, hlo = tmp_path / "rows.jsonl", tmp_path / "hlo"
    argv = [sys.executable, str(ROOT / "benchmarks" / "accelerator_cost.py"), "--smoke"]
    argv += ["--only", "minsr-auto", "grad", "--run", "3", "--hlo-dir", str(hlo), "--json", str(rows_path)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    programs = {(r["kind"], r["program"]): r for r in rows if r["row"] == "program"}
    names = {"minsr": ("vmcgrad-vmcsr", "netket-vmcsr"), "grad": ("vmcgrad", "netket")}
    assert set(programs) == {(k, name) for k, pair in names.items() for name in pair}, rows
    for p in programs.values():
        assert len(p["run_ms_all"]) == 3 and min(p["run_ms_all"]) > 0, p
        assert p["run_ms"] == sorted(p["run_ms_all"])[1], p  # the median of 3
    comparisons = {r["key"]: r for r in rows if r["row"] == "comparison"}
    for key, kind in (("minsr-auto", "minsr"), ("grad", "grad")):
        ours, theirs = (programs[(kind, name)] for name in names[kind])
        assert comparisons[key]["ratio"]["run"] == pytest.approx(ours["run_ms"] / theirs["run_ms"], rel=1e-12)
    files = {f.name: f for f in hlo.iterdir()}
    assert sorted(files) == [
        "grad-netket-64-8-None.hlo.txt",
        "grad-vmcgrad-64-8-None-tpu.hlo.txt",
        "minsr-netket-vmcsr-32-8-None.hlo.txt",
        "minsr-vmcgrad-vmcsr-32-auto-4.0-tpu.hlo.txt",
    ], files
    for name, key in [
        ("grad-netket-64-8-None", ("grad", "netket")),
        ("grad-vmcgrad-64-8-None-tpu", ("grad", "vmcgrad")),
        ("minsr-netket-vmcsr-32-8-None", ("minsr", "netket-vmcsr")),
        ("minsr-vmcgrad-vmcsr-32-auto-4.0-tpu", ("minsr", "vmcgrad-vmcsr")),
    ]:
        p = programs[key]
        cost = vmcgrad.program_cost(files[name + ".hlo.txt"].read_text(), platform="tpu")
        assert (cost.ops, cost.flops) == (p["ops"], pytest.approx(1e9 * p["gflop"], rel=1e-12)), (name, p)
