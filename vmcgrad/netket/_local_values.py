r"""NetKet's local-value kernels, as vmcgrad's routes use them: forward-chunked, or per sample.

The local value of an operator :math:`\hat O` at a sample :math:`\sigma` is

.. math::

    O_{loc}(\sigma) = \sum_{\sigma'} O_{\sigma\sigma'} \frac{\psi(\sigma')}{\psi(\sigma)},

computed by NetKet's kernels (``get_local_kernel`` / ``get_local_kernel_arguments``). Three uses:

- :func:`forward_kernel`: the values themselves, at a chunk size — NetKet's chunked kernels
  (``netket/vqs/mc/mc_state/expect_chunked.py``), which run the model on at most ``chunk_size``
  configurations at a time (the connected ones included).
- :func:`differentiable_kernel`: :math:`O_{loc}` as a per-sample function of the parameters, for
  the non-hermitian gradient, where the local values themselves are differentiated. NetKet's
  unchunked kernel is applied to one chunk of samples inside :func:`vmcgrad.batched_vjp`; the
  operator data either travels with the samples (numba operators and ``Squared``: the connected
  configurations ``(σ', O_σσ')`` of each sample, precomputed) or is broadcast to every chunk
  (jax and continuous operators, which compute their connections inside the kernel).
- :func:`fewest_trips`: ``MCState.local_estimators`` at ``chunk_size="auto"`` on an accelerator.
  NetKet's chunked kernels count their chunk in model evaluations (the connected configurations
  included: a chunk of :math:`c` holds :math:`c / n_\text{conn}` samples), so the gradient's chunk
  walks about :math:`N n_\text{conn} / c` trips of the model, each a fixed cost on a GPU or TPU:
  there the chunk is chosen for the local values themselves, as every automatic chunk is
  (:func:`vmcgrad._chunks.budget.choose_chunk`: the compiled program within the budget, the least
  modelled time, usually the fewest trips). On a CPU the gradient's chunk stays: it was measured
  faster than one pass (``docs/performance.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from netket.operator import ContinuousOperator, DiscreteJaxOperator, DiscreteOperator, Squared
from netket.stats import LocalEstimators
from netket.utils import HashablePartial
from netket.vqs.mc import get_local_kernel, get_local_kernel_arguments
from plum import NotFoundLookupError

from vmcgrad._chunks.budget import choose_chunk, recorded, signature
from vmcgrad._chunks.default_budget import budget_or_default
from vmcgrad._hlo.platform import resolve_platform

from . import _nk_private as nkp


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


def fewest_trips(
    vstate: Any, operator: Any, gradient_chunk: Callable[[], int], memory_budget: float | None
) -> Any:
    r"""NetKet's ``local_estimators(vstate, operator)`` at the chunk of least modelled time whose
    compiled program fits ``memory_budget`` (bytes per device; None: the default budget), among
    ``gradient_chunk()`` (the gradient's automatic chunk) and its doublings up to one chunk of every
    sample's connected configurations, :math:`N n_\text{conn}` model evaluations; or None where the
    chunk stays the gradient's: on a CPU (the platform the choices are priced for,
    :func:`vmcgrad.cost_platform`), or where NetKet has no chunked kernel for the pair.

    The candidates are compiled, not run (the largest first: one compilation where it fits), NetKet's
    own jitted program at each, so that the run reuses the chosen one's executable; the choice is
    cached per kernel, model, arguments' shapes and placement, budget and platform, and a call that
    finds it does not resolve the gradient's chunk. The values are NetKet's at any chunk: a chunk
    only splits the model's evaluations."""
    platform = resolve_platform()
    if platform.name == "cpu":
        return None
    try:  # (NetKet's chunked kernel: one function for every integer chunk, bound apart below)
        kernel = get_local_kernel(vstate, operator, 1)
    except NotFoundLookupError:  # (NetKet's fallback: its error, from the caller's path)
        return None
    sigma, args = get_local_kernel_arguments(vstate, operator)
    apply_fun, shape = nkp.apply_fun(vstate), sigma.shape[:-1]
    rows, budget = math.prod(shape), budget_or_default(memory_budget)

    def program(c: int) -> Any:
        return HashablePartial(kernel, chunk_size=c), apply_fun, shape, vstate.variables, sigma, args

    key = ("local_estimators", kernel, apply_fun, shape, signature((vstate.variables, sigma, args)))
    known = recorded(key, rows, budget, platform)
    if known is not None:
        return LocalEstimators(nkp.local_estimators_impl(*program(known.value)))
    total = rows * max_connections(operator, args, per_sample_arguments(operator) is True)
    candidates = [gradient_chunk()]
    while candidates[-1] < total:
        candidates.append(2 * candidates[-1])

    def compile_at(c: int) -> Any:
        return nkp.local_estimators_impl.lower(*program(c)).compile()

    chunk = choose_chunk(
        key,
        rows,
        compile_at,
        budget,
        where="vmcgrad.netket.MCState.local_estimators",
        candidates=candidates,
        platform=platform,
        chunks=False,
    )
    return LocalEstimators(nkp.local_estimators_impl(*program(chunk)))
