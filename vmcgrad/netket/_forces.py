r"""``expect_and_forces`` for a NetKet ``MCState``: NetKet's local values, vmcgrad's force pass."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import netket as nk
from netket.operator import Squared
from netket.vqs.mc import get_local_kernel_arguments

from vmcgrad._problem import validation as check

from ._expect_grad import auto_chunk_size, check_state, log_psi
from ._local_values import step_arguments
from ._netket_vjp import netket_vjp

NAME = "vmcgrad.netket.expect_and_forces"


def expect_and_forces(vstate: Any, operator: Any, *, chunk_size: int | None = None) -> tuple[Any, Any]:
    r"""Statistics and force of an operator, as ``vstate.expect_and_forces(operator)``.

    With the samples :math:`\sigma_1..\sigma_N` of ``vstate`` (not resampled), the local values
    :math:`L_i = O_{loc}(\sigma_i)`, their mean :math:`\bar L` and
    :math:`O_i = \partial_\theta \log\psi_\theta(\sigma_i)`:

    .. math::

        F = \frac{1}{N} \sum_{i=1}^{N} \overline{O_i}\,\bigl(L_i - \bar L\bigr)

    in NetKet's convention and dtypes (``netket/vqs/mc/mc_state/expect_forces.py``): the conjugate
    of ``nk.jax.vjp``'s product with the cotangent :math:`c_i = \overline{(L_i - \bar L)}/N`. For
    real parameters and a complex :math:`\log\psi` (e.g. ``RBMModPhase``) :math:`F` is complex, and
    its real and imaginary parts come from one pass (:mod:`vmcgrad.netket._netket_vjp`). The
    operator need not be hermitian (any operator with a NetKet local kernel but ``Squared``, for
    which NetKet defines no force either):
    the formula is the covariance either way, as NetKet's.

    Local values: NetKet's chunked kernels at ``chunk_size`` (the model sees at most
    ``chunk_size`` configurations at a time); statistics: ``nk.stats.statistics`` over
    ``(n_chains, n_samples_per_chain)``; force: :func:`vmcgrad.batched_vjp` at ``chunk_size``, one
    reduction after the loop. One jitted program.

    Args:
        vstate: an ``nk.vqs.MCState`` with a non-mutable model.
        operator: a NetKet operator with a local kernel (``get_local_kernel``), not ``Squared``.
        chunk_size: samples per chunk on each device (any positive int), None, or ``"auto"``.

    Returns:
        ``(stats, force)``: an ``nk.stats.Stats`` and a pytree like ``vstate.parameters`` (complex
        leaves where NetKet's force is complex).

    Raises:
        TypeError, ValueError: for a state or operator this cannot handle, before anything runs.
    """
    chunk_size = check.check_chunk_size(NAME, chunk_size)
    check_state(NAME, vstate)
    check_force_operator(NAME, operator)
    sigma, args = get_local_kernel_arguments(vstate, operator)
    auto = chunk_size == "auto"
    if auto:
        chunk_size = auto_chunk_size(vstate, sigma)
    step_args = step_arguments(vstate, operator, sigma, args, _forces_step, chunk_size, auto=auto, where=NAME)
    return _forces_step(*step_args)


def check_operator(name: str, operator: Any) -> None:
    """An ``AbstractOperator`` (NetKet's local kernels are registered for those)."""
    if not isinstance(operator, nk.operator.AbstractOperator):
        raise TypeError(
            f"{name}: `operator` must be a netket AbstractOperator; got {type(operator).__name__}. "
            "Fix: pass a NetKet operator, or use NetKet's vstate methods for other observables."
        )


def check_force_operator(name: str, operator: Any) -> None:
    """As :func:`check_operator`, and not ``Squared`` (NetKet defines no force for it either)."""
    check_operator(name, operator)
    if isinstance(operator, Squared):
        raise NotImplementedError(
            f"{name}: `operator` is Squared; NetKet defines no force for it "
            "(MCState.expect_and_forces raises too). Fix: use expect_and_grad for Squared operators."
        )


@partial(jax.jit, static_argnames=("kernel", "apply_fun", "chunk_size"))
def _forces_step(kernel, apply_fun, chunk_size, params, model_state, sigma, args):
    n_chains = sigma.shape[0]
    if sigma.ndim >= 3:
        sigma = jax.lax.collapse(sigma, 0, 2)
    n = sigma.shape[0]
    o_loc = kernel(apply_fun, {"params": params, **model_state}, sigma, args)
    stats = nk.stats.statistics(o_loc.reshape((n_chains, -1)))
    cotangent = jnp.conj(o_loc - stats.mean) / n
    a = netket_vjp(log_psi(apply_fun, model_state), params, sigma, cotangent, chunk_size=chunk_size)
    return stats, jax.tree.map(jnp.conj, a)
