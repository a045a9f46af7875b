r"""``SR`` and ``QGTAuto``: NetKet's SR preconditioner and QGT chooser, with vmcgrad's QGT as the default.

NetKet's ``nk.optimizer.SR()`` and ``nkx.driver.TDVP`` build their QGT with
``nk.optimizer.qgt.QGTAuto``, which chooses by ``isinstance`` of the state (``QGTOnTheFly``,
``QGTJacobianDense`` or ``QGTJacobianPyTree``, all NetKet's). vmcgrad does not patch that choice;
these two names make vmcgrad's :func:`vmcgrad.netket.QGTOnTheFly` the default explicitly:

- :func:`SR` is ``nk.optimizer.SR`` (it returns one) whose ``qgt`` defaults to :class:`QGTAuto`;
- :class:`QGTAuto` builds :func:`vmcgrad.netket.QGTOnTheFly` on a Monte Carlo state
  (``nk.vqs.MCState``, so also :class:`vmcgrad.netket.MCState`) and defers to NetKet's ``QGTAuto``
  on any other state (``FullSumState``, ...).

The matrix is NetKet's in every case: :math:`S_\text{eff} = S + \epsilon_1 \operatorname{diag}(S)
+ \epsilon_2`, :math:`S = \frac1N \Delta O^\dagger \Delta O`. vmcgrad's operator serves NetKet's
iterative solvers through ``S @ v`` and its dense ones through ``to_dense()``, so, unlike NetKet's
``QGTAuto``, it needs no other type for a dense solver or a ``diag_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import netket as nk

from ._qgt import QGTOnTheFly


class QGTAuto:
    """NetKet's ``QGTAuto`` with :func:`vmcgrad.netket.QGTOnTheFly` for Monte Carlo states.

    ``QGTAuto(solver, **kwargs)(vstate, **more)`` returns ``vmcgrad.netket.QGTOnTheFly(vstate,
    **kwargs, **more)`` when ``vstate`` is an ``nk.vqs.MCState`` (at ``vstate``'s chunk size:
    vmcgrad's on a :class:`vmcgrad.netket.MCState`, any positive int), and
    ``nk.optimizer.qgt.QGTAuto(solver, **kwargs)(vstate, **more)`` otherwise.

    Pass it where NetKet takes a QGT, e.g. ``nkx.driver.TDVP(H, vstate, integrator,
    qgt=vmcgrad.netket.QGTAuto())``; :func:`vmcgrad.netket.SR` uses it by default.

    Args:
        solver: the linear solver (passed to NetKet's chooser for states that are not MCStates;
            vmcgrad's operator serves iterative and dense solvers alike).
        **kwargs: keyword arguments of the QGT constructor (``holomorphic``, ``chunk_size``,
            ``mode``, ``diag_shift``, ``diag_scale``).
    """

    def __init__(self, solver: Callable | None = None, **kwargs: Any):
        self._solver = solver
        self._kwargs = kwargs
        self._netket = nk.optimizer.qgt.QGTAuto(solver, **kwargs)

    def __call__(self, vstate: Any, *args: Any, **kwargs: Any) -> nk.optimizer.LinearOperator:
        if isinstance(vstate, nk.vqs.MCState):
            return QGTOnTheFly(vstate, *args, **self._kwargs, **kwargs)
        return self._netket(vstate, *args, **kwargs)

    def __repr__(self) -> str:
        return "vmcgrad.netket.QGTAuto()"


def SR(
    qgt: Callable | None = None,
    solver: Callable = jax.scipy.sparse.linalg.cg,
    *,
    diag_shift: Any = 0.01,
    diag_scale: Any = None,
    solver_restart: bool = False,
    **kwargs: Any,
) -> nk.optimizer.SR:
    r"""``nk.optimizer.SR`` whose QGT defaults to vmcgrad's (:class:`QGTAuto`).

    Solves :math:`(S + \epsilon_1 \operatorname{diag}(S) + \epsilon_2)\, \Delta = \nabla E` each
    step, exactly as ``nk.optimizer.SR`` (which it returns); only the default ``qgt`` differs:
    ``vmcgrad.netket.QGTAuto(solver)``, i.e. :func:`vmcgrad.netket.QGTOnTheFly` on a Monte Carlo
    state. The switch of a VMC + SR script is then two lines::

        vstate = vmcgrad.netket.MCState(sampler, model, n_samples=1008, chunk_size=256)
        sr = vmcgrad.netket.SR(diag_shift=0.01)  # was nk.optimizer.SR(diag_shift=0.01)

    Args:
        qgt: the QGT constructor; None for :class:`QGTAuto` (vmcgrad's on an ``MCState``).
        solver: the linear solver (default ``jax.scipy.sparse.linalg.cg``, as NetKet).
        diag_shift: :math:`\epsilon_2` (a scalar or a schedule; default 0.01, as NetKet).
        diag_scale: :math:`\epsilon_1` (a scalar, a schedule, or None).
        solver_restart: as NetKet's (False: start from the last solution).
        **kwargs: passed to the QGT constructor (e.g. ``holomorphic=True``, ``chunk_size=``).

    Returns:
        An ``nk.optimizer.SR``.
    """
    if qgt is None:
        qgt = QGTAuto(solver)
    return nk.optimizer.SR(
        qgt, solver, diag_shift=diag_shift, diag_scale=diag_scale, solver_restart=solver_restart, **kwargs
    )
