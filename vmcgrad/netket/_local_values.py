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
- :func:`fewest_trips`: ``MCState.local_estimators`` at ``chunk_size="auto"`` on an accelerator
  (and :func:`at_fewest_trips`, the same choice inside another program: ``expect_and_grad``'s).
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
    :func:`vmcgrad.cost_platform`), or where NetKet has no chunked kernel for the pair
    (:func:`at_fewest_trips`, on NetKet's own jitted program). The values are NetKet's at any
    chunk: a chunk only splits the model's evaluations."""
    if resolve_platform().name == "cpu":
        return None  # (before the samples and operator data are read)
    try:
        sigma, args = get_local_kernel_arguments(vstate, operator)
    except NotFoundLookupError:  # (NetKet's fallback: its error, from the caller's path)
        return None
    apply_fun = nkp.apply_fun(vstate)

    def arguments(kernel: Any) -> tuple:
        return kernel, apply_fun, sigma.shape[:-1], vstate.variables, sigma, args

    where = "vmcgrad.netket.MCState.local_estimators"
    found = at_fewest_trips(
        vstate,
        operator,
        sigma,
        args,
        gradient_chunk,
        memory_budget,
        nkp.local_estimators_impl,
        arguments,
        where,
    )
    return None if found is None else LocalEstimators(nkp.local_estimators_impl(*found))


def step_arguments(
    vstate: Any,
    operator: Any,
    sigma: Any,
    args: Any,
    jitted: Any,
    chunk: int | None,
    *,
    auto: bool,
    where: str,
) -> tuple:
    r"""The arguments ``(kernel, apply_fun, chunk, params, model_state, σ, args)`` of ``jitted``, a
    program of NetKet's local values followed by a pass over the samples at ``chunk``
    (``expect_and_grad``'s, ``expect_and_forces``'): the local-value kernel at ``chunk``
    (:func:`forward_kernel`), or where ``chunk`` is the automatic one (``auto``), on a GPU or TPU at
    its own chunk in the same program (:func:`at_fewest_trips`, the whole program's bytes within the
    state's budget): NetKet counts ``chunk`` in model evaluations, so at it the model walks about
    :math:`N n_\text{conn} / c` trips."""
    apply_fun = nkp.apply_fun(vstate)

    def arguments(kernel: Any) -> tuple:
        return kernel, apply_fun, chunk, vstate.parameters, vstate.model_state, sigma, args

    if auto:
        budget = getattr(vstate, "vmcgrad_memory_budget", None)
        where = f"{where} (the local values' chunk)"
        found = at_fewest_trips(
            vstate, operator, sigma, args, lambda: chunk, budget, jitted, arguments, where, chunk
        )
        if found is not None:
            return found
    return arguments(forward_kernel(vstate, operator, chunk))


def at_fewest_trips(
    vstate: Any,
    operator: Any,
    sigma: Any,
    args: Any,
    first: Callable[[], int],
    memory_budget: float | None,
    jitted: Any,
    arguments: Callable[[Any], tuple],
    where: str,
    keyed: Any = None,
) -> tuple | None:
    r"""The arguments of ``jitted`` (a ``jax.jit`` function of NetKet's local-value kernel on the
    samples ``sigma`` and operator data ``args``, ``get_local_kernel_arguments``'; its arguments
    ``arguments(kernel)``) at the kernel's chunk of least modelled time whose compiled program fits
    ``memory_budget``; None on a CPU, or where NetKet has no chunked kernel for the pair.

    NetKet's chunked kernels count their chunk in model evaluations, the connected configurations
    included, so the gradient's chunk walks about :math:`N n_\text{conn} / c` trips of the model.
    The candidates are ``first()`` and its doublings up to one chunk of every sample's connected
    configurations (:func:`vmcgrad._chunks.budget.choose_chunk`: compiled, not run, the largest
    first, so that the run reuses the chosen one's executable). The choice is cached per ``where``,
    kernel, model, the arguments' shapes and placement (``keyed``, static data the program depends
    on, beside them), budget and platform; a call that finds it does not call ``first``."""
    platform = resolve_platform()
    if platform.name == "cpu":
        return None
    try:  # (NetKet's chunked kernel: one function for every integer chunk, bound apart below)
        kernel = get_local_kernel(vstate, operator, 1)
    except NotFoundLookupError:  # (NetKet's fallback: its error, from the caller's path)
        return None
    rows, budget = math.prod(sigma.shape[:-1]), budget_or_default(memory_budget)

    def at(c: int) -> tuple:
        return arguments(HashablePartial(kernel, chunk_size=c))

    key = (where, kernel, nkp.apply_fun(vstate), keyed, signature((vstate.variables, sigma, args)))
    known = recorded(key, rows, budget, platform)
    if known is not None:
        return at(known.value)
    total = rows * max_connections(operator, args, per_sample_arguments(operator) is True)
    candidates = [first()]
    while candidates[-1] < total:
        candidates.append(2 * candidates[-1])

    def compile_at(c: int) -> Any:
        return jitted.lower(*at(c)).compile()

    chunk = choose_chunk(
        key, rows, compile_at, budget, where=where, candidates=candidates, platform=platform, chunks=False
    )
    return at(chunk)
