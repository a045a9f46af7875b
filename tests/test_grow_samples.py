"""``vmcgrad.netket.GrowSamples``: the rule that raises N when the energy has settled."""

import math

import numpy as np
import pytest

from vmcgrad.netket._grow import GrowSamples


def _series(drift_per_step, sigma, w=20):
    return list(-10.0 + drift_per_step * np.arange(w)), [sigma] * w


def test_settles_when_the_drift_over_the_window_is_below_one_error_bar():
    rule = GrowSamples(max_samples=4096, window=20)
    # drift 0.4 sigma over the window: settled; 2.5 sigma: still moving
    assert rule.settled(*_series(drift_per_step=0.02 * 0.01, sigma=0.01))
    assert not rule.settled(*_series(drift_per_step=0.125 * 0.01, sigma=0.01))
    # the slope is a least-squares slope: pure noise of one error bar, no drift, is settled
    rng = np.random.default_rng(1)
    noise = list(-10.0 + 0.01 * rng.normal(size=200))
    hits = sum(rule.settled(noise[i : i + 20], [0.01] * 20) for i in range(180))
    # |slope|*W of white noise is normal with std W*sigma/sqrt(W(W^2-1)/12) = 0.78 sigma at W = 20,
    # so about 80 % of windows are within one error bar (a fixed seed; overlapping windows)
    assert hits > 0.6 * 180, hits
    # fewer points than the window, or a non-finite value: no decision
    assert not rule.settled([-1.0] * 19, [0.1] * 19)
    e, s = _series(0.0, 0.01)
    e[3] = math.nan
    assert not rule.settled(e, s)


def test_next_n_is_a_multiple_of_the_granule_and_stops_at_the_maximum():
    rule = GrowSamples(max_samples=3000, factor=2)
    assert rule.next_n(512, granule=16) == 1024
    assert rule.next_n(1024, granule=16) == 2048
    assert rule.next_n(2048, granule=16) == 2992  # min(4096, 3000) rounded down to chains x devices
    assert rule.next_n(2992, granule=16) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_samples=0), "max_samples"),
        (dict(max_samples=True), "max_samples"),
        (dict(max_samples=64, window=2), "window"),
        (dict(max_samples=64, factor=1), "factor"),
        (dict(max_samples=64, tolerance=0.0), "tolerance"),
        (dict(max_samples=64, tolerance=math.inf), "tolerance"),
    ],
)
def test_bad_arguments_are_refused_with_the_name(kwargs, match):
    with pytest.raises(ValueError, match=f"GrowSamples: `{match}`"):
        GrowSamples(**kwargs)
