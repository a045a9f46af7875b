"""vmcgrad for NetKet users: ``expect_and_grad``, an SR-ready ``QGTOnTheFly``, and ``MCState``.

The one-line switch for a NetKet VMC script: replace ``nk.vqs.MCState(sampler, model, ...)`` by
``vmcgrad.netket.MCState(sampler, model, ..., chunk_size=256)``. The driver (``nk.driver.VMC``,
with or without ``nk.optimizer.SR``), loggers and callbacks are NetKet's, unchanged; the gradient
of each step is computed by vmcgrad, chunked with no divisibility requirement and reduced once.
For a chunked QGT in SR, pass ``qgt=vmcgrad.netket.QGTOnTheFly``.

This subpackage imports NetKet; ``import vmcgrad`` alone does not.
"""

from ._expect_grad import expect_and_grad as expect_and_grad
from ._forces import expect_and_forces as expect_and_forces
from ._qgt import QGTOnTheFly as QGTOnTheFly
from ._qgt import QGTOnTheFlyT as QGTOnTheFlyT
from ._state import MCState as MCState
from ._vmc_sr import VMC_SR as VMC_SR

__all__ = ["VMC_SR", "MCState", "QGTOnTheFly", "QGTOnTheFlyT", "expect_and_forces", "expect_and_grad"]
