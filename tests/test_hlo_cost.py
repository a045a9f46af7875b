"""``benchmarks/hlo_cost.py``: saved programs costed again, beside their measured times."""

from pathlib import Path

import hlo_cost  # benchmarks/ is on sys.path (pyproject.toml's pythonpath)
import pytest

import vmcgrad

TPU_HLO = Path(__file__).resolve().parent / "data" / "tpu-v5e-fori-loop-16.hlo"


def test_each_file_is_one_line_of_its_program_cost(capsys):
    hlo_cost.main([str(TPU_HLO), "--platform", "tpu", "--measured", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    c = vmcgrad.program_cost(TPU_HLO.read_text(), platform="tpu")
    ms = 1e3 * c.time("tpu")
    assert lines[2] == (
        f"| {TPU_HLO.name} | {c.ops:,.0f} | 16×4 | {c.flops / 1e9:.1f} | {c.bytes / 1e9:.2f} | {ms:.1f} |"
        f" 0.5 | {ms / 0.5:.2f} |"
    ), lines
    assert c.ops == 69  # the test_program_cost count of this program: 16 trips of 4 ops, 5 more


def test_measured_times_are_one_per_file():
    with pytest.raises(SystemExit):
        hlo_cost.main([str(TPU_HLO), "--measured", "1.0", "2.0"])
