r"""``GrowSamples``: raise the number of samples when the energy has settled to its statistical error.

Only a method that holds N samples within a fixed memory budget can raise N during a run; vmcgrad's
sample-space kernel can. The rule: start with few samples (cheap steps, fast early progress), and
double N when the energy's drift over the last ``window`` steps falls to the statistical error of one
step's energy, up to ``max_samples`` and to what ``memory_budget`` holds.

With :math:`E_k \pm \sigma_k` the energies of the last :math:`W` steps and :math:`b` the slope of their
least-squares line (energy per step), N is raised when

.. math::

    |b|\,W \le \mathrm{tolerance}\cdot\bar\sigma,
    \qquad \bar\sigma = \Big(\frac1W\sum_k \sigma_k^2\Big)^{1/2},

i.e. when the energy moves less over the window than one step's error bar: more steps at this N
mostly average noise, and a larger N lowers the noise floor. After a raise the window starts again
(W more steps at the new N before the next decision).

A raise costs compilations: the sampler, the local energies and the update at the new N (with
``chunk_size="auto"``, its chunk search). Where the budget holds less than ``factor`` × N, the raise is
made only if it reaches :math:`\sqrt{\text{factor}}` × N (:meth:`GrowSamples.worth`: half the
noise reduction of a full raise, in the exponent); below that N stays, and is not raised again: a
raise that lowers the noise by a few percent does not repay its compilations (measured:
docs/performance.md, the 12-site chain at 8 MiB).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

NAME = "vmcgrad.netket.GrowSamples"


@dataclasses.dataclass(frozen=True)
class GrowSamples:
    """The rule for raising a driver's number of samples as the energy settles.

    Args:
        max_samples: the largest N (total over devices) the run may reach.
        window: W, the steps the drift is measured over (and waited after each raise); >= 3.
        factor: N is multiplied by this integer at each raise (>= 2).
        tolerance: raise when the drift over the window is at most ``tolerance`` error bars.

    Example::

        gs = vmcgrad.netket.VMC_SR(H, opt, diag_shift=1e-3, variational_state=vs,
                                   grow_samples=vmcgrad.netket.GrowSamples(max_samples=8192))
    """

    max_samples: int
    window: int = 20
    factor: int = 2
    tolerance: float = 1.0

    def __post_init__(self):
        def bad(arg, value, expected):
            return ValueError(f"{NAME}: `{arg}` must be {expected}; got {value!r}.")

        if (
            isinstance(self.max_samples, bool)
            or not isinstance(self.max_samples, int)
            or self.max_samples < 1
        ):
            raise bad("max_samples", self.max_samples, "a positive int")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 3:
            raise bad("window", self.window, "an int >= 3 (a slope needs points)")
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 2:
            raise bad("factor", self.factor, "an int >= 2")
        if not (
            isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance) and self.tolerance > 0
        ):
            raise bad("tolerance", self.tolerance, "a positive finite number")

    def settled(self, energies: Sequence[float], errors: Sequence[float]) -> bool:
        """Whether the last ``window`` energies have settled: ``|slope| * window <= tolerance * σ̄``."""
        if len(energies) < self.window or len(errors) < self.window:
            return False
        e = [float(x) for x in energies[-self.window :]]
        s = [float(x) for x in errors[-self.window :]]
        if not all(math.isfinite(x) for x in (*e, *s)):
            return False
        w = self.window
        k_mean, e_mean = (w - 1) / 2, sum(e) / w
        slope = sum((k - k_mean) * (x - e_mean) for k, x in enumerate(e)) / sum(
            (k - k_mean) ** 2 for k in range(w)
        )
        sigma = math.sqrt(sum(x * x for x in s) / w)
        return abs(slope) * w <= self.tolerance * sigma

    def worth(self, n: int, new: int) -> bool:
        """Whether raising N from ``n`` to ``new`` is worth its compilations: ``new >= sqrt(factor) * n``."""
        return new * new >= self.factor * n * n

    def next_n(self, n: int, granule: int) -> int | None:
        """The raised N (a multiple of ``granule``: chains × devices), or None at ``max_samples``."""
        target = min(n * self.factor, self.max_samples)
        target -= target % granule
        return target if target > n else None
