"""``benchmarks/step_regime.py``: a step's time against N, by phase, and the Jacobian split it sets."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import step_regime  # benchmarks/ is on sys.path (pyproject.toml's pythonpath)
from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]

# The probe in a process of its own (it sets one CPU device), with vmcgrad's MinSR kernel spied on:
# every call of its per-sample Jacobians (the dense blocks' and the kept Jacobian's, taken where the
# N x P Jacobian fits the budget, as here) records the batch it derives at once (its ``batch``
# argument, or all the rows it is given), so the test sees the programs the split actually traced.
SPY = """
import json, sys
import step_regime
from vmcgrad._sr.ntk import dense as ntk_dense, minsr as ntk_minsr
seen = []
def spying(real):
    def spy(f, theta, x, mode, batch=None, shift=None, **kw):
        import jax
        rows = jax.tree.leaves(x)[0].shape[0]
        seen.append(rows if batch is None else min(batch, rows))
        return real(f, theta, x, mode, batch, shift, **kw)
    return spy
ntk_dense.jacobian = spying(ntk_dense.jacobian)
ntk_minsr.flat_jacobian = spying(ntk_minsr.flat_jacobian)
marks = []
real_main_step = step_regime.step
def step(*args):
    marks.append(len(seen))
    return real_main_step(*args)
step_regime.step = step
step_regime.main(sys.argv[1:])
print("SEEN " + json.dumps({"seen": seen, "marks": marks}))
"""


@pytest.mark.heavy
def test_the_probe_times_each_run_by_phase_and_the_split_sets_the_jacobian_batch(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    argv = [
        "--problem", "chain", "--layers", "1", "--features", "8", "--dtype", "float32",
        "--budget-mib", "16", "--chains", "16", "--steps", "1", "--kernel", "--json", str(rows_path),
        "--runs", "netket-vmcsr=32:16", "vmcgrad-vmcsr=32:16@2", "vmcgrad-vmcsr=32:16",
    ]  # fmt: skip
    env = {**child_env(), "PYTHONPATH": str(ROOT / "benchmarks") + ":" + str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SPY, *argv], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    assert [r["run"] for r in rows] == ["netket-vmcsr=32:16", "vmcgrad-vmcsr=32:16@2", "vmcgrad-vmcsr=32:16"]
    assert [r["jacobian_split"] for r in rows] == [None, 2, 16]
    for r in rows:
        assert r["device"] == "1 x cpu cpu" and r["device_peak"] is None, r
        # one timed step: its phases add up to it (the SR phase is the step less the other two)
        phases = r["median_sample_s"] + r["median_local_s"] + r["median_sr_s"]
        assert r["median_step_s"] > 0 and abs(phases - r["median_step_s"]) <= 1e-9 * r["median_step_s"]
        assert min(r["median_sample_s"], r["median_local_s"], r["median_sr_s"]) > 0, r
        assert r["first_step_s"] > 0 and r["chunk_size_bwd"] == 16, r
        # the first step by phase, and what it compiled: NetKet's kernel, or vmcgrad's update once
        # (the program itself, not again inside the driver's jit(_update) around it)
        first = r["first_sample_s"] + r["first_local_s"] + r["first_sr_s"]
        assert abs(first - r["first_step_s"]) <= 1e-9 * r["first_step_s"], r
        kernel = "jit(_update_program)" if r["run"].startswith("vmcgrad") else "jit(_sr_srt_common)"
        count, seconds = r["first_compiles"][kernel]
        assert count == 1 and 0 < seconds < r["first_sr_s"], r
        assert "jit(_update)" not in r["first_compiles"], r
        # --kernel: the SR kernel lowered and compiled apart (a few MiB for this tiny model: compiled
        # bytes are deterministic; the bound only catches a unit slip)
        assert r["kernel_lower_s"] > 0 and r["kernel_compile_s"] > 0 and r["kernel_stablehlo_lines"] > 100, r
        assert 0 < r["kernel_bytes"] <= 16 * 2**20, r
    spied = json.loads(proc.stdout.split("SEEN ", 1)[1])
    seen, marks = spied["seen"], spied["marks"]
    # marks: the spy's count before each of the 2 steps of each run; the kernel is traced at a run's
    # first step (NetKet's run never calls vmcgrad's kernel) and again by --kernel after the steps
    assert len(marks) == 6
    assert seen[: marks[2]] == [], seen
    split2, split16 = seen[marks[2] : marks[4]], seen[marks[4] :]
    # a chunk of 16 in two parts: 8 samples at a time (the kept Jacobian's chunks); in sixteen: 1
    assert split2 and set(split2) == {8}, split2
    assert split16 and set(split16) == {1}, split16


def test_the_budget_is_a_positive_number_of_mib_or_default():
    """``--budget-mib``: ``default`` is vmcgrad's own budget (None to the driver), a number its MiB;
    zero, a negative number or a word is refused with what it expects."""
    assert step_regime.budget_mib("default") is None
    assert step_regime.budget_mib("64") == 64.0 and step_regime.budget_mib("0.5") == 0.5
    for bad in ("0", "-8", "auto", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of MiB or 'default'"):
            step_regime.budget_mib(bad)
    assert (
        step_regime.parse(["--runs", "vmcgrad-vmcsr=256:auto", "--budget-mib", "default"]).budget_mib is None
    )
