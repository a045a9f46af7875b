"""``MCState``: NetKet's ``MCState`` whose gradients go through vmcgrad — the one-line driver switch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from flax import serialization
from netket.operator import AbstractOperator, Squared
from netket.vqs import expect as nk_expect
from netket.vqs import expect_and_forces as nk_expect_and_forces
from netket.vqs import expect_and_grad as nk_expect_and_grad

from vmcgrad._problem import validation as check

from . import _nk_private as nkp
from ._expect_grad import auto_chunk_size, covariance_grad
from ._forces import expect_and_forces
from ._grad_nonherm import expect_and_grad_nonhermitian, supports
from ._local_values import fewest_trips
from ._netket_chunked import call_chunked, divisor_at_most, warn_once

NAME = "vmcgrad.netket.MCState"


class MCState(nkp.NetKetMCState):
    """``nk.vqs.MCState`` whose local values, gradients and forces are chunked at its ``chunk_size``.

    The switch for an existing NetKet script is one line::

        vstate = nk.vqs.MCState(sampler, model, n_samples=8192, seed=0)               # before
        vstate = vmcgrad.netket.MCState(sampler, model, n_samples=8192, seed=0, chunk_size=256)  # after

    Everything else — ``nk.driver.VMC`` with or without ``nk.optimizer.SR``, ``VMC_SR``,
    ``nkx.driver.TDVP``, loggers, callbacks — is NetKet's, unchanged. NetKet's default QGT
    (``QGTAuto``, in ``nk.optimizer.SR()`` and TDVP) stays NetKet's own: a second line,
    ``vmcgrad.netket.SR(...)`` for ``nk.optimizer.SR(...)`` or ``qgt=vmcgrad.netket.QGTAuto()`` for
    TDVP, makes the QGT vmcgrad's; ``vmcgrad.netket.VMC_SR`` for ``nk.driver.VMC_SR`` makes the
    sample-space kernel vmcgrad's. With a chunk size ``c``
    (non-mutable model), what runs where (the table in ``docs/netket.md``):

    - ``expect_and_grad(O)`` with the covariance formula (hermitian ``O``, or
      ``use_covariance=True``): :func:`vmcgrad.netket.expect_and_grad`'s program — NetKet's chunked
      local values, ``nk.stats.statistics``, :func:`vmcgrad.expect_grad` at ``c``.
    - ``expect_and_grad(O)`` without it (non-hermitian ``O`` under ``NETKET_EXPERIMENTAL=1``,
      ``use_covariance=False``, ``Squared``): NetKet's non-hermitian formula as one vmcgrad
      pass (``vmcgrad.netket._grad_nonherm``).
    - ``expect_and_forces(O)`` (what TDVP calls): :func:`vmcgrad.netket.expect_and_forces`.
    - ``expect(O)``, ``local_estimators(O)`` (what ``VMC_SR`` and loggers call): NetKet's
      chunked kernels at ``c``; with ``chunk_size="auto"`` on a GPU or TPU, ``local_estimators``
      at its own automatic chunk (NetKet counts this chunk in model evaluations, connected
      configurations included: the fewest trips of the model that fit the budget).
    - anything else: NetKet's dispatch at ``c``; where NetKet has no chunked implementation and
      would run unchunked, a ``NetKetChunkFallbackError`` instead. Models with ``mutable``
      collections are refused with a chunk size (neither NetKet nor vmcgrad chunks a model-state
      update made over the whole batch); with ``chunk_size=None`` they run NetKet's unchunked path.

    ``chunk_size`` is vmcgrad's (any positive int, it need not divide anything), stored as
    :attr:`vmcgrad_chunk_size`. NetKet's own attribute :attr:`chunk_size` — what NetKet's code
    that is not routed through vmcgrad reads: ``VMC_SR``'s ``chunk_size_bwd``, the chunk size of
    NetKet's QGTs built from this state (so ``SR()`` with NetKet's default QGT is chunked too),
    ``to_array`` — reads the largest divisor of the samples per device at most ``c`` (``c``
    itself when it divides them; NetKet's ``QGTOnTheFly`` and ``VMC_SR``'s NTK on the fly need a
    divisor), or NetKet's own chunk size if one is given as ``netket_chunk_size``.

    Args:
        sampler, model: as for ``nk.vqs.MCState``.
        chunk_size: samples per chunk on each device (any positive int), None for no chunking,
            or ``"auto"`` (:func:`vmcgrad.auto_chunk_size` of the gradient pass, at each call).
        netket_chunk_size: NetKet's own ``chunk_size`` (default None; when given, NetKet's paths
            and the forward kernels use it).
        memory_budget: bytes per device for ``chunk_size="auto"`` (any positive number; stored as
            :attr:`vmcgrad_memory_budget`); None for the default (half the free device memory, or
            2 GiB where the backend does not say), as :func:`vmcgrad.auto_chunk_size`. A budget given
            without ``chunk_size`` means ``chunk_size="auto"``: every chunk is then chosen within it
            (and ``vmcgrad.netket.VMC_SR`` on this state takes the same budget for its kernel).
            Without either, the state runs NetKet's unchunked paths: the switch alone changes no
            number and no memory footprint.
        **kwargs: every other keyword of ``nk.vqs.MCState`` (``n_samples``, ``seed``, ...).
    """

    def __init__(
        self,
        sampler: Any,
        model: Any = None,
        *,
        chunk_size: int | None = None,
        netket_chunk_size: int | None = None,
        memory_budget: float | None = None,
        **kwargs: Any,
    ):
        self.vmcgrad_chunk_size = check.check_chunk_size(NAME, chunk_size)
        self.vmcgrad_memory_budget = check.check_memory_budget(NAME, memory_budget)
        if self.vmcgrad_chunk_size is None and self.vmcgrad_memory_budget is not None:
            self.vmcgrad_chunk_size = "auto"  # a budget alone chooses the chunks: never set one
        super().__init__(sampler, model, chunk_size=netket_chunk_size, **kwargs)

    # --- NetKet's chunk_size, as NetKet's own code reads it ---------------------------------

    @property
    def chunk_size(self) -> int | None:
        """The chunk size NetKet's own code runs at on this state (its QGTs, ``VMC_SR``'s Jacobian
        or NTK, ``to_array``): NetKet's own if given as ``netket_chunk_size`` (or set), else the
        largest divisor of the samples per device at most vmcgrad's ``chunk_size`` (NetKet's
        ``QGTOnTheFly`` and ``VMC_SR``'s NTK on the fly need one; announced once when it is
        smaller). vmcgrad's own paths run at :attr:`vmcgrad_chunk_size` itself."""
        own = nkp.own_chunk_size(self)
        if own is not None or self.vmcgrad_chunk_size is None:
            return own
        n, c = self.n_samples_per_rank, self._chunk()
        d = divisor_at_most(n, c)
        if d != c:
            warn_once(
                (n, c),
                f"{NAME}: NetKet's own code on this state (its QGTs, VMC_SR's Jacobian or NTK, "
                f"to_array) runs at chunk size {d}, the largest divisor of the {n} samples per device "
                f"at most chunk_size={c} (NetKet's QGTOnTheFly and VMC_SR's NTK on the fly need a "
                "divisor); vmcgrad's paths run at chunk_size. Fix: choose n_samples or chunk_size so "
                "that one divides the other.",
            )
        return d

    @chunk_size.setter
    def chunk_size(self, chunk_size: int | None) -> None:
        nkp.set_own_chunk_size(self, chunk_size)

    def _chunk_setting(self) -> int | str | None:
        """The chunk size set for a NetKet path: NetKet's own if set, else vmcgrad's (``"auto"``
        not resolved)."""
        own = nkp.own_chunk_size(self)
        return own if own is not None else self.vmcgrad_chunk_size

    def _chunk(self, sigma: Any = None) -> int | None:
        """The chunk size in force for a NetKet path: :meth:`_chunk_setting`, ``"auto"`` resolved
        on the samples (or on a stand-in if none are drawn yet)."""
        c = self._chunk_setting()
        if c == "auto":
            c = auto_chunk_size(self, self._samples_or_stand_in() if sigma is None else sigma)
        return c

    def _samples_or_stand_in(self) -> Any:
        """The samples if drawn, else a stand-in of their shape, dtype and placement: each chain's
        current configuration ``chain_length`` times. Resolving ``"auto"`` compiles candidate programs
        for the samples' shape, so it need not draw them: NetKet's drivers read ``chunk_size`` when
        they are built, and a draw there would advance the chains, so that the first step saw other
        samples than NetKet's at the same seed."""
        drawn = nkp.drawn_samples(self)
        if drawn is not None:
            return drawn
        chains = self.sampler_state.σ
        return jnp.broadcast_to(chains[:, None], (chains.shape[0], self.chain_length, *chains.shape[1:]))

    def _check_mutable(self, mutable: Any, method: str) -> bool:
        """True if NetKet's unchunked path is what the user asked for (no chunk size)."""
        if mutable is False:
            return False
        if self._chunk_setting() is None:  # (not resolved: "auto" is never None)
            return True
        raise NotImplementedError(
            f"{NAME}.{method}: the model has mutable collections (mutable={mutable!r}) and "
            f"chunk_size={self.vmcgrad_chunk_size!r}. Their update is computed over the whole "
            "batch, which neither NetKet (its chunked path raises NotImplementedError) nor vmcgrad "
            "chunks. Fix: chunk_size=None to run NetKet's unchunked path, or mutable=False."
        )

    # --- the routes --------------------------------------------------------------------------

    def expect_and_grad(
        self,
        O: AbstractOperator,  # noqa: E741 (NetKet's argument name)
        *,
        mutable: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        """As ``nk.vqs.MCState.expect_and_grad``, chunked at ``chunk_size`` (see the class doc)."""
        if mutable is None:
            mutable = self.mutable
        if self._check_mutable(mutable, "expect_and_grad"):
            return super().expect_and_grad(O, mutable=mutable, **kwargs)
        use_cov = kwargs.get("use_covariance")
        if set(kwargs) <= {"use_covariance"} and isinstance(O, AbstractOperator):
            if isinstance(O, Squared):
                if use_cov is not None:  # NetKet's own error (expect_grad.py)
                    raise ValueError(
                        "Cannot specify `use_covariance` with Squared[...] operator.\n"
                        "This operator must use the same formula as non-hermitian operators to work."
                    )
                return expect_and_grad_nonhermitian(self, O, chunk_size=self.vmcgrad_chunk_size)
            if use_cov if use_cov is not None else O.is_hermitian:
                return covariance_grad(self, O, self.vmcgrad_chunk_size)
            if supports(O):
                return expect_and_grad_nonhermitian(self, O, chunk_size=self.vmcgrad_chunk_size)
        return call_chunked(
            f"{NAME}.expect_and_grad", nk_expect_and_grad, self, O, self._chunk(), mutable=mutable, **kwargs
        )

    def expect_and_forces(self, O: AbstractOperator, *, mutable: Any = None) -> tuple[Any, Any]:  # noqa: E741
        """As ``nk.vqs.MCState.expect_and_forces``: :func:`vmcgrad.netket.expect_and_forces`."""
        if mutable is None:
            mutable = self.mutable
        if self._check_mutable(mutable, "expect_and_forces"):
            return super().expect_and_forces(O, mutable=mutable)
        if isinstance(O, AbstractOperator) and not isinstance(O, Squared):
            return expect_and_forces(self, O, chunk_size=self.vmcgrad_chunk_size)
        if isinstance(O, Squared):
            return super().expect_and_forces(O, mutable=mutable)  # NetKet's NotImplementedError
        return call_chunked(
            f"{NAME}.expect_and_forces", nk_expect_and_forces, self, O, self._chunk(), mutable=mutable
        )

    def expect(self, O: Any) -> Any:  # noqa: E741 (NetKet's argument name)
        """As ``nk.vqs.MCState.expect``, local values forward-chunked at ``chunk_size``."""
        return call_chunked(f"{NAME}.expect", nk_expect, self, O, self._chunk())

    def local_estimators(self, op: Any, *, chunk_size: int | None = None) -> Any:
        """As ``nk.vqs.MCState.local_estimators`` (``VMC_SR`` calls it), forward-chunked at
        ``chunk_size`` unless one is given. With ``chunk_size="auto"`` on a GPU or TPU, at the chunk
        of least modelled time that fits the budget among the gradient's chunk and its doublings
        (:func:`~vmcgrad.netket._local_values.fewest_trips`: NetKet counts this chunk in model
        evaluations, each sample's connected configurations included)."""
        if chunk_size is None:
            if self._chunk_setting() == "auto":
                found = fewest_trips(self, op, self._chunk, self.vmcgrad_memory_budget)
                if found is not None:
                    return found
            chunk_size = self._chunk()
        return call_chunked(f"{NAME}.local_estimators", nkp.local_estimators, self, op, chunk_size)

    def _replace_model(self, model=None, *, apply_fun=None, variables=None):
        with _netket_own_chunk_size(self) as chunk:  # NetKet's copies vstate.chunk_size
            new = nkp.replace_model(self, model, apply_fun, variables)
        # NetKet passes its chunk size as ``chunk_size=``, which is vmcgrad's here: put both back
        new.vmcgrad_chunk_size, new.chunk_size = chunk, nkp.own_chunk_size(self)
        new.vmcgrad_memory_budget = self.vmcgrad_memory_budget
        return new

    def __repr__(self) -> str:
        return super().__repr__().replace("MCState(", "vmcgrad.netket.MCState(", 1)


@contextlib.contextmanager
def _netket_own_chunk_size(vstate: MCState) -> Iterator[Any]:
    """Inside the block ``vstate.chunk_size`` reads NetKet's own chunk size (no divisor, no
    ``"auto"`` resolved, i.e. no sampling): for NetKet's code that copies it into another state.
    Yields vmcgrad's chunk size, restored on exit."""
    chunk, vstate.vmcgrad_chunk_size = vstate.vmcgrad_chunk_size, None
    try:
        yield chunk
    finally:
        vstate.vmcgrad_chunk_size = chunk


def _serialize(vstate: MCState) -> dict:
    with _netket_own_chunk_size(vstate) as chunk:
        return {**nkp.serialize_MCState(vstate), "vmcgrad_chunk_size": chunk}


def _deserialize(vstate: MCState, state_dict: dict) -> MCState:
    state_dict = dict(state_dict)
    with _netket_own_chunk_size(vstate) as default:
        new = nkp.deserialize_MCState(vstate, state_dict)  # a copy of vstate
    new.vmcgrad_chunk_size = state_dict.pop("vmcgrad_chunk_size", default)
    return new


serialization.register_serialization_state(MCState, _serialize, _deserialize)
