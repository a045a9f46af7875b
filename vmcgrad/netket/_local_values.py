r"""NetKet's local-value kernels, as vmcgrad's routes use them: forward-chunked, or per sample.

The local value of an operator :math:`\hat O` at a sample :math:`\sigma` is

.. math::

    O_{loc}(\sigma) = \sum_{\sigma'} O_{\sigma\sigma'} \frac{\psi(\sigma')}{\psi(\sigma)},

computed by NetKet's kernels (``get_local_kernel`` / ``get_local_kernel_arguments``). Two uses:

- :func:`forward_kernel`: the values themselves, at a chunk size — NetKet's chunked kernels
  (``netket/vqs/mc/mc_state/expect_chunked.py``), which run the model on at most ``chunk_size``
  configurations at a time (the connected ones included).
- :func:`differentiable_kernel`: :math:`O_{loc}` as a per-sample function of the parameters, for
  the non-hermitian gradient, where the local values themselves are differentiated. NetKet's
  unchunked kernel is applied to one chunk of samples inside :func:`vmcgrad.batched_vjp`; the
  operator data either travels with the samples (numba operators and ``Squared``: the connected
  configurations ``(σ', O_σσ')`` of each sample, precomputed) or is broadcast to every chunk
  (jax and continuous operators, which compute their connections inside the kernel).
"""

from __future__ import annotations

from typing import Any

import jax
from netket.operator import ContinuousOperator, DiscreteJaxOperator, DiscreteOperator, Squared
from netket.utils import HashablePartial
from netket.vqs.mc import get_local_kernel


def forward_kernel(vstate: Any, operator: Any, chunk_size: int | None) -> Any:
    """NetKet's local-value kernel ``kernel(apply_fun, variables, σ, args)`` at ``chunk_size``."""
    if chunk_size is None:
        return get_local_kernel(vstate, operator)
    return HashablePartial(get_local_kernel(vstate, operator, chunk_size), chunk_size=chunk_size)


def per_sample_arguments(operator: Any) -> bool | None:
    """Whether ``get_local_kernel_arguments``' operator data is per sample (True), one pytree for
    all samples (False), or of a kind vmcgrad does not split (None: NetKet's path)."""
    if isinstance(operator, Squared):
        return True  # (σ', mels) of the parent, per sample
    if isinstance(operator, (DiscreteJaxOperator, ContinuousOperator)):
        return False
    if isinstance(operator, DiscreteOperator):
        return True  # numba operators: (σ', mels) per sample
    return None


def max_connections(operator: Any, args: Any, per_sample: bool) -> int:
    """The largest number of connected configurations of one sample (at least 1): a local value
    evaluates the model on them at once (and, separately, on the sample itself)."""
    if per_sample:
        sigma_p, _ = args
        return max(1, int(sigma_p.shape[-2]))
    return max(1, int(getattr(operator, "max_conn_size", 1)))


def differentiable_kernel(vstate: Any, operator: Any) -> Any:
    """NetKet's unchunked kernel, applied per chunk inside vmcgrad's loop (see the module doc)."""
    return get_local_kernel(vstate, operator)


def split_per_sample(args: Any, n_lead: int, n: int) -> Any:
    """Per-sample operator data with its ``n_lead`` sample axes collapsed into one of length n."""
    return jax.tree.map(lambda a: a.reshape((n, *a.shape[n_lead:])), args)
