"""``benchmarks/cpu_regression.py``: the old-against-new table from the processes' JSON lines.

No process is started here (a real check runs minutes of benchmarks on two worktrees): the lines are
written by hand, and the table is checked against the medians, ranges and ratios they imply.
"""

import json

import cpu_regression as cr  # benchmarks/ is on sys.path (pyproject.toml's pythonpath)


def _line(case, side, pair, rows):
    return {
        "case": case,
        "side": side,
        "commit": ("a" if side == "old" else "b") * 40,
        "pair": pair,
        "date": f"2026-12-07T05:0{pair}:00+00:00",
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [3.0, 1.0, 1.0],
        "wall_s": 1.0,
        "rc": 0,
        "command": "benchmarks/step_regime.py ...",
        "rows": [{"metric": m, "s": s} for m, s in rows],
    }


# three processes per side; the medians: NetKet 2.0 (old) and 2.04 (new), vmcgrad 3.0 and 3.3
NK, VG = "netket-vmcsr=256:64 median_step_s", "vmcgrad-vmcsr=256:64 median_step_s"
PROCESSES = {"old": [(2.0, 3.0), (1.0, 2.9), (5.0, 9.0)], "new": [(2.05, 3.3), (2.04, 3.2), (1.9, 3.4)]}
STEP = [
    _line("step-f64", side, pair, [(NK, nk), (VG, vg)])
    for side, values in PROCESSES.items()
    for pair, (nk, vg) in enumerate(values)
]


def test_summary_takes_each_sides_median_range_and_flags_beyond_the_threshold():
    entries = {e["metric"]: e for e in cr.summary(STEP, threshold=0.05)}
    vg = entries[VG]
    assert (vg["old"], vg["new"]) == (3.0, 3.3)
    assert vg["old_range"] == (2.9, 9.0) and vg["new_range"] == (3.2, 3.4)
    assert abs(vg["ratio"] - 1.1) < 1e-12 and vg["slower"]
    nk = entries[NK]
    assert (nk["old"], nk["new"], nk["ratio"]) == (2.0, 2.04, 2.04 / 2.0) and not nk["slower"]
    # 1.1 is within a 15 % threshold
    assert not {e["metric"]: e for e in cr.summary(STEP, threshold=0.15)}[vg["metric"]]["slower"]


def test_netket_ratios_pair_each_vmcgrad_run_with_netkets_same_metric_on_the_same_side():
    ratios = cr.netket_ratios(cr.summary(STEP, threshold=0.05))
    key = ("step-f64", VG)
    assert ratios[(*key, "old")] == 3.0 / 2.0 and ratios[(*key, "new")] == 3.3 / 2.04
    assert not any(k[1].startswith("netket") for k in ratios)


def test_a_kernel_is_paired_with_netkets_candidate_of_its_benchmark_setting_and_clock():
    rows = {"qgt [N=8] vmcgrad c/2": 4.0, "qgt [N=8] vmcgrad c/2 cpu": 3.0, "qgt [N=8] netket": 2.0}
    rows |= {"qgt [N=8] netket cpu": 1.0, "qgt [N=16] netket": 8.0, "qgt [N=8] jax.vjp": 1.0}
    lines = [_line("kernels", side, 0, rows.items()) for side in ("old", "new")]
    ratios = cr.netket_ratios(cr.summary(lines, threshold=0.05))
    wall, cpu = ("kernels", "qgt [N=8] vmcgrad c/2"), ("kernels", "qgt [N=8] vmcgrad c/2 cpu")
    assert ratios == {(*wall, "old"): 2.0, (*wall, "new"): 2.0, (*cpu, "old"): 3.0, (*cpu, "new"): 3.0}


def test_table_only_writes_the_table_from_runs_jsonl(tmp_path, capsys):
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in STEP))
    assert cr.main(["--old", "unused", "--table-only", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "table.md").read_text()
    assert "aaaaaaa (old) against bbbbbbb (new)" in text
    assert "load average around the processes 1.00-3.00" in text
    row = next(r for r in text.splitlines() if r.startswith(f"| {VG}"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["3 [2.9-9]", "3.3 [3.2-3.4]", "1.100 SLOWER", "1.500", "1.618", "1.078"]
    assert text in capsys.readouterr().out


def test_a_failed_process_is_named_and_its_side_has_fewer_values():
    failed = dict(_line("step-f64", "new", 3, []), rc=1, output_tail="Traceback ...")
    lines = [*STEP, failed]
    assert "failed processes: step-f64 new pair 3: rc 1" in cr.report(lines, cr.parse(["--old", "x"]))
    assert {e["n"] for e in cr.summary(lines, 0.05)} == {(3, 3)}


def test_a_step_process_rows_pair_each_run_with_its_cpu_seconds(tmp_path):
    rows = [
        {"run": f"r{i}=8:4", "median_step_s": 1.0 + i, "first_step_s": 9.0, "chunk_size_bwd": 4}
        for i in (0, 1)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # per run: its first step, then 3 timed steps (the CPU seconds of each, in the order they ran)
    (tmp_path / "cpu.json").write_text(json.dumps([20.0, 1.0, 3.0, 2.0, 30.0, 5.0, 4.0, 6.0]))
    got = {r["metric"]: r["s"] for r in cr.metrics("step-f64", tmp_path, steps_per_run=3)}
    assert got == {
        "r0=8:4 median_step_s": 1.0, "r0=8:4 first_step_s": 9.0,
        "r0=8:4 first_step_cpu_s": 20.0, "r0=8:4 median_step_cpu_s": 2.0,
        "r1=8:4 median_step_s": 2.0, "r1=8:4 first_step_s": 9.0,
        "r1=8:4 first_step_cpu_s": 30.0, "r1=8:4 median_step_cpu_s": 5.0,
    }  # fmt: skip
