"""The budget search of benchmarks/benchlib/large.py (pure Python: no program is compiled here)."""

import math

import pytest
from benchlib.large import largest_n


def brute(fits, granule, n_max):
    ok = [k * granule for k in range(1, n_max // granule + 1) if fits(k * granule)]
    return max(ok) if ok else 0


@pytest.mark.parametrize("hint", [8, 1000, 3000, 10**6])
@pytest.mark.parametrize(
    "fits",
    [
        lambda n: 1000 + 3 * n <= 10_000,  # affine, like a chunked program
        lambda n: 50 + n * n / 100 <= 10_000,  # quadratic, like the NTK
    ],
    ids=["affine", "quadratic"],
)
def test_largest_n_brackets_the_limit(fits, hint):
    lo, hi, probes = largest_n(fits, granule=8, hint=hint, n_max=2**16, rel=1 / 64)
    best = brute(fits, 8, 2**16)
    assert fits(lo) and not fits(hi)  # both ends verified
    assert lo <= best < hi and (hi - lo) <= max(8, math.floor(lo / 64) * 8 + 8)
    assert probes < 40


def test_largest_n_none_fits_and_all_fit():
    assert largest_n(lambda n: False, granule=4, hint=100, n_max=1024)[:2] == (0, 4)
    assert largest_n(lambda n: True, granule=4, hint=100, n_max=1024)[:2] == (1024, None)


def test_script_lists_the_same_implementations():
    import importlib.util
    from pathlib import Path

    from benchlib import large

    path = Path(__file__).parent.parent / "benchmarks" / "bench_large.py"
    spec = importlib.util.spec_from_file_location("bench_large", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.IMPLS == large.IMPLS


def test_run_py_registers_the_large_suite():
    from benchlib.suite import parse

    assert parse(["--suite", "large"]).suite == "large"
    assert parse([]).suite == "default"
