"""vmcgrad for NetKet users: ``expect_and_grad``, an SR-ready ``QGTOnTheFly``, and ``MCState``.

The switch for a NetKet VMC script (one line; two with SR, TDVP or ``VMC_SR``): replace
``nk.vqs.MCState(sampler, model, ...)`` by ``vmcgrad.netket.MCState(sampler, model, ...,
chunk_size=256)``. The driver (``nk.driver.VMC``, with or without ``nk.optimizer.SR``), loggers and
callbacks are NetKet's, unchanged; the gradient of each step is computed by vmcgrad, chunked with no
divisibility requirement and reduced once. For vmcgrad's chunked QGT in SR, replace
``nk.optimizer.SR(...)`` by ``vmcgrad.netket.SR(...)`` (NetKet's SR whose QGT defaults to
vmcgrad's), or pass ``qgt=vmcgrad.netket.QGTOnTheFly`` (also to TDVP); for MinSR / SPRING, replace
``nk.driver.VMC_SR`` by ``vmcgrad.netket.VMC_SR``.

This subpackage imports NetKet; ``import vmcgrad`` alone does not.
"""

from ._expect_grad import expect_and_grad as expect_and_grad
from ._forces import expect_and_forces as expect_and_forces
from ._grow import GrowSamples as GrowSamples
from ._qgt import QGTOnTheFly as QGTOnTheFly
from ._qgt import QGTOnTheFlyT as QGTOnTheFlyT
from ._sr import SR as SR
from ._sr import QGTAuto as QGTAuto
from ._state import MCState as MCState
from ._vmc_sr import VMC_SR as VMC_SR

__all__ = [
    "SR",
    "VMC_SR",
    "GrowSamples",
    "MCState",
    "QGTAuto",
    "QGTOnTheFly",
    "QGTOnTheFlyT",
    "expect_and_forces",
    "expect_and_grad",
]
