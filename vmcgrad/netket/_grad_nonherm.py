r"""The gradient of :math:`\langle O\rangle` without the covariance formula (non-hermitian, ``Squared``).

NetKet's ``expect_and_grad_nonhermitian`` (``netket/vqs/mc/mc_state/expect_grad.py``) differentiates
the Monte Carlo estimate :math:`\langle O\rangle \approx \frac1N\sum_i L_i(\theta)` through
``nk.jax.expect``, whose backward pass is the score-function estimator

.. math::

    h_i(\theta) = \Delta L_i \,\log p_\theta(\sigma_i) + L_i(\theta), \qquad
    \Delta L_i = L_i - \bar L \ \text{(held fixed)}, \qquad
    \log p_\theta = m\,\mathrm{Re}\log\psi_\theta \ (m = \text{the sampler's machine\_pow}),

    g = \overline{\texttt{nk.jax.vjp}\Bigl(\theta \mapsto \tfrac1N \textstyle\sum_i h_i(\theta)\Bigr)(1)}

where :math:`L_i(\theta) = \sum_{\sigma'} O_{\sigma_i\sigma'}\psi_\theta(\sigma')/\psi_\theta(\sigma_i)`
is itself differentiated (no ``force_to_grad``). This :math:`g` is what NetKet 3.23 returns, except
for real parameters with a complex :math:`\log\psi` (e.g. ``RBMModPhase``): there NetKet returns
:math:`2g` (its ``nk.jax.expect`` pullback hands a complex cotangent to real parameters, which the
outer R→C rule of ``nk.jax.vjp`` counts twice), and vmcgrad returns :math:`g`, the gradient itself
(with exact sampling it approaches the exact ``FullSumState`` gradient, NetKet's twice it:
``tests/test_netket_routes.py::test_netket_nonhermitian_gradient_is_twice_the_gradient_for_real_parameters_and_complex_psi``;
``docs/netket.md``, "One deliberate difference"). Here
:math:`h` is a per-sample function of the parameters, so :math:`g` is one
:func:`vmcgrad.batched_vjp` pass (:func:`~vmcgrad.netket._netket_vjp.netket_vjp`: NetKet's dtype
rules) with the cotangent :math:`1/N` and one reduction. Each chunk evaluates the model on the
chunk's samples and on all their connected configurations under differentiation, so the pass
takes ``max(1, chunk_size // max_conn)`` samples per chunk: the model is differentiated on at most
``chunk_size`` configurations at a time (``max_conn`` if that is larger), as NetKet's chunked jax
kernels count their chunk in configurations.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import netket as nk
from jax.tree_util import Partial
from netket.operator import Squared
from netket.utils import HashablePartial
from netket.vqs.mc import get_local_kernel_arguments

from vmcgrad._problem import validation as check

from . import _nk_private as nkp
from ._expect_grad import auto_chunk_size, check_state
from ._forces import check_operator
from ._local_values import (
    differentiable_kernel,
    forward_kernel,
    max_connections,
    per_sample_arguments,
    split_per_sample,
)
from ._netket_vjp import netket_vjp

NAME = "vmcgrad.netket.expect_and_grad_nonhermitian"

EXPERIMENTAL_MESSAGE = """
            Computing the gradient of non hermitian operator is an
            experimental feature under development and is known not to
            return wrong values sometimes.

            If you want to debug it, set the environment variable
            NETKET_EXPERIMENTAL=1
            """  # NetKet's own message and gate (expect_grad.py)


def supports(operator: Any) -> bool:
    """Whether vmcgrad can split this operator's local-kernel data per chunk."""
    return per_sample_arguments(operator) is not None


def expect_and_grad_nonhermitian(
    vstate: Any, operator: Any, *, chunk_size: int | None = None
) -> tuple[Any, Any]:
    r"""Statistics and gradient of :math:`\langle O\rangle` by NetKet's non-hermitian formula (module doc).

    What ``vstate.expect_and_grad(operator, use_covariance=False)`` returns, and what it returns
    for a non-hermitian operator or a ``Squared`` one: NetKet's value, halved for real parameters
    with a complex :math:`\log\psi` (the module doc says why). As NetKet, a non-hermitian operator other
    than ``Squared`` needs ``NETKET_EXPERIMENTAL=1`` (a RuntimeError otherwise).

    Args:
        vstate: an ``nk.vqs.MCState`` with a non-mutable model.
        operator: a numba, jax or continuous NetKet operator, or ``Squared`` of one.
        chunk_size: local values and gradient chunked as the module doc says; None or ``"auto"``.

    Returns:
        ``(stats, grad)``, as NetKet's (complex leaves for real parameters when
        :math:`\langle O\rangle` is complex).

    Raises:
        RuntimeError: NetKet's experimental gate.
        TypeError, ValueError: for a state or operator this cannot handle, before anything runs.
    """
    chunk_size = check.check_chunk_size(NAME, chunk_size)
    check_state(NAME, vstate)
    check_operator(NAME, operator)
    if not isinstance(operator, Squared) and not nk.config.netket_experimental:
        raise RuntimeError(EXPERIMENTAL_MESSAGE)
    per_sample = per_sample_arguments(operator)
    if per_sample is None:
        raise TypeError(
            f"{NAME}: `operator` must be a numba, jax or continuous NetKet operator, or Squared; got "
            f"{type(operator).__name__}. Fix: use vstate.expect_and_grad (NetKet's path)."
        )
    sigma, args = get_local_kernel_arguments(vstate, operator)
    if chunk_size == "auto":
        chunk_size = auto_chunk_size(vstate, sigma)
    diff_chunk = None
    if chunk_size is not None:
        diff_chunk = max(1, chunk_size // max_connections(operator, args, per_sample))
    return _step(
        forward_kernel(vstate, operator, chunk_size),
        differentiable_kernel(vstate, operator),
        per_sample,
        nkp.apply_fun(vstate),
        float(vstate.sampler.machine_pow),
        chunk_size,
        diff_chunk,
        vstate.parameters,
        vstate.model_state,
        sigma,
        args,
    )


@partial(
    jax.jit,
    static_argnames=(
        "kernel",
        "diff_kernel",
        "per_sample",
        "apply_fun",
        "machine_pow",
        "chunk_size",
        "diff_chunk",
    ),
)
def _step(
    kernel,
    diff_kernel,
    per_sample,
    apply_fun,
    machine_pow,
    chunk_size,
    diff_chunk,
    params,
    model_state,
    sigma,
    args,
):
    n_chains, n_lead = sigma.shape[0], sigma.ndim - 1
    if sigma.ndim >= 3:
        sigma = jax.lax.collapse(sigma, 0, 2)
    n = sigma.shape[0]
    o_loc = kernel(apply_fun, {"params": params, **model_state}, sigma, args)
    stats = nk.stats.statistics(o_loc.reshape((n_chains, -1)))
    delta = o_loc - stats.mean
    objective = HashablePartial(_objective, diff_kernel, apply_fun, machine_pow, per_sample)
    if per_sample:
        fun = Partial(objective, model_state, None)
        samples = (sigma, delta, split_per_sample(args, n_lead, n))
    else:
        fun = Partial(objective, model_state, args)
        samples = (sigma, delta, None)
    out_dtype = jax.eval_shape(fun, params, samples).dtype
    cotangent = jnp.full((n,), 1 / n, dtype=out_dtype)
    grad = netket_vjp(fun, params, samples, cotangent, chunk_size=diff_chunk)
    return stats, jax.tree.map(jnp.conj, grad)


def _objective(diff_kernel, apply_fun, machine_pow, per_sample, model_state, shared_args, params, batch):
    """:math:`h_i = \\Delta L_i\\, m\\,\\mathrm{Re}\\log\\psi(\\sigma_i) + L_i(\\theta)` for a batch."""
    sigma, delta, own_args = batch
    variables = {"params": params, **model_state}
    log_p = machine_pow * apply_fun(variables, sigma).real
    local = diff_kernel(apply_fun, variables, sigma, own_args if per_sample else shared_args)
    return delta * log_p + local
