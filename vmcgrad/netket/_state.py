"""``MCState``: NetKet's ``MCState`` whose gradients go through vmcgrad — the one-line driver switch."""

from __future__ import annotations

from typing import Any

import netket as nk
from flax import serialization
from netket.operator import AbstractOperator, Squared
from netket.vqs import expect as nk_expect
from netket.vqs.mc.mc_state.state import deserialize_MCState, serialize_MCState

from .. import _validation as check
from ._expect_grad import auto_chunk_size, expect_and_grad


class MCState(nk.vqs.MCState):
    """``nk.vqs.MCState`` computing ``expect_and_grad`` with vmcgrad at its own ``chunk_size``.

    The switch for an existing NetKet script is one line::

        vstate = nk.vqs.MCState(sampler, model, n_samples=8192, seed=0)               # before
        vstate = vmcgrad.netket.MCState(sampler, model, n_samples=8192, seed=0, chunk_size=256)  # after

    Everything else — ``nk.driver.VMC`` with or without ``nk.optimizer.SR``, loggers, callbacks,
    ``run(n_iter, out=...)``, the progress bar — is NetKet's, unchanged. The driver calls
    ``vstate.expect_and_grad(H)`` once per step; for a hermitian operator and a non-mutable model
    this is :func:`vmcgrad.netket.expect_and_grad` at ``chunk_size`` (one jitted program: NetKet's
    chunked local-value kernels, ``nk.stats.statistics``, and :func:`vmcgrad.expect_grad`). Other
    cases (``Squared`` or non-hermitian operators, ``use_covariance=False``, mutable models) go to
    NetKet's implementation.

    ``chunk_size`` is vmcgrad's, stored as :attr:`vmcgrad_chunk_size`; NetKet's own
    :attr:`chunk_size` stays None (unless given as ``netket_chunk_size``), so that NetKet's
    ``vjp_chunked`` and its divisibility requirement (sample count per device a multiple of the
    chunk size) are never triggered by it. ``expect`` (loggers' observables) evaluates its local
    values with NetKet's forward-chunked kernels at ``vmcgrad_chunk_size`` (no divisibility needed
    there). For a chunked QGT use ``nk.optimizer.SR(qgt=vmcgrad.netket.QGTOnTheFly, ...)``: it
    picks up ``vmcgrad_chunk_size``.

    Args:
        sampler, model: as for ``nk.vqs.MCState``.
        chunk_size: samples per chunk on each device for vmcgrad's gradient and the local values
            (any positive int: it need not divide anything), None for no chunking, or ``"auto"``
            (:func:`vmcgrad.auto_chunk_size` of the gradient pass, chosen at each call, cached).
        netket_chunk_size: NetKet's own ``chunk_size`` for the paths NetKet still computes (default None).
        **kwargs: every other keyword of ``nk.vqs.MCState`` (``n_samples``, ``seed``, ...).
    """

    def __init__(
        self,
        sampler: Any,
        model: Any = None,
        *,
        chunk_size: int | None = None,
        netket_chunk_size: int | None = None,
        **kwargs: Any,
    ):
        self.vmcgrad_chunk_size = check.check_chunk_size("vmcgrad.netket.MCState", chunk_size)
        super().__init__(sampler, model, chunk_size=netket_chunk_size, **kwargs)

    def expect_and_grad(
        self,
        O: AbstractOperator,  # noqa: E741 (NetKet's argument name)
        *,
        mutable: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        """As ``nk.vqs.MCState.expect_and_grad``; hermitian operators go through vmcgrad."""
        if mutable is None:
            mutable = self.mutable
        use_cov = kwargs.get("use_covariance")
        if (
            mutable is False
            and set(kwargs) <= {"use_covariance"}
            and isinstance(O, AbstractOperator)
            and not isinstance(O, Squared)
            and (use_cov if use_cov is not None else O.is_hermitian)
            and O.is_hermitian
        ):
            return expect_and_grad(self, O, chunk_size=self.vmcgrad_chunk_size)
        return super().expect_and_grad(O, mutable=mutable, **kwargs)

    def expect(self, O: Any) -> Any:  # noqa: E741 (NetKet's argument name)
        """As ``nk.vqs.MCState.expect``, local values forward-chunked at ``vmcgrad_chunk_size``."""
        chunk_size = self.chunk_size if self.chunk_size is not None else self.vmcgrad_chunk_size
        if chunk_size == "auto":
            chunk_size = auto_chunk_size(self, self.samples)
        return nk_expect(self, O, chunk_size)

    def _replace_model(self, model=None, *, apply_fun=None, variables=None):
        new = super()._replace_model(model, apply_fun=apply_fun, variables=variables)
        new.vmcgrad_chunk_size = self.vmcgrad_chunk_size
        new.chunk_size = self.chunk_size
        return new

    def __repr__(self) -> str:
        return super().__repr__().replace("MCState(", "vmcgrad.netket.MCState(", 1)


def _serialize(vstate: MCState) -> dict:
    return {**serialize_MCState(vstate), "vmcgrad_chunk_size": vstate.vmcgrad_chunk_size}


def _deserialize(vstate: MCState, state_dict: dict) -> MCState:
    state_dict = dict(state_dict)
    chunk = state_dict.pop("vmcgrad_chunk_size", vstate.vmcgrad_chunk_size)
    new = deserialize_MCState(vstate, state_dict)
    new.vmcgrad_chunk_size = chunk
    return new


serialization.register_serialization_state(MCState, _serialize, _deserialize)
