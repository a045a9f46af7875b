"""``expect_and_grad`` for a NetKet ``MCState``: NetKet's local values and statistics, vmcgrad's gradient."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import jax
import netket as nk
from netket.operator import AbstractOperator, Squared
from netket.vqs.mc import get_local_kernel_arguments

import vmcgrad
from vmcgrad._cache import Cache
from vmcgrad._chunks.retry import run_with_oom_retry
from vmcgrad._problem import validation as check

from . import _nk_private as nkp
from ._local_values import step_arguments

NAME = "vmcgrad.netket.expect_and_grad"


def expect_and_grad(vstate: Any, operator: Any, *, chunk_size: int | None = None) -> tuple[Any, Any]:
    r"""Energy statistics and gradient of a hermitian operator, as ``vstate.expect_and_grad(operator)``.

    With the samples :math:`\sigma_1..\sigma_N` of ``vstate`` (``vstate.samples``, not resampled) and
    the local values :math:`O_{loc}(\sigma) = \sum_{\sigma'} O_{\sigma\sigma'}\,\psi(\sigma')/\psi(\sigma)`:

    .. math::

        F = \frac{1}{N} \sum_{i=1}^{N} \overline{O_i}\,\bigl(O_{loc}(\sigma_i) - \bar O\bigr),
        \qquad g = \begin{cases} 2F & \text{complex parameter leaves} \\
        2\,\mathrm{Re}\,F & \text{real parameter leaves} \end{cases}

    where :math:`O_i = \partial_\theta \log\psi_\theta(\sigma_i)`. This is what NetKet's
    ``MCState.expect_and_grad`` returns for a hermitian operator (``force_to_grad``).

    The local values use NetKet's own kernels (``get_local_kernel``/``get_local_kernel_arguments``,
    chunked as ``netket/vqs/mc/mc_state/expect_chunked.py`` does), the statistics are
    ``nk.stats.statistics`` over the ``(n_chains, n_samples_per_chain)`` local values, and the
    gradient is :func:`vmcgrad.expect_grad` at ``chunk_size`` — chunked on each device with no
    divisibility requirement and one reduction over NetKet's ``"S"`` mesh axis. The whole step is
    one jitted program, compiled once per (model, operator type, shapes, chunk size): parameters,
    model state, samples and operator data are traced arguments. The model is called on chunks of
    samples, so each of its outputs must depend on its own sample only (no batch mean or max of
    log ψ subtracted without ``jax.lax.stop_gradient``): see :func:`vmcgrad.expect_grad`.

    Args:
        vstate: an ``nk.vqs.MCState`` with a non-mutable model (``model_state`` is read, not updated).
        operator: a hermitian NetKet operator (``operator.is_hermitian``), not ``Squared``.
        chunk_size: samples per chunk on each device (any positive int), None for no chunking,
            or ``"auto"`` (:func:`vmcgrad.auto_chunk_size` of the gradient pass).

    Returns:
        ``(stats, grad)``: an ``nk.stats.Stats`` of the local values and a pytree like
        ``vstate.parameters``.

    Raises:
        TypeError, ValueError: for a state or operator this cannot handle, before anything runs.
    """
    chunk_size = check.check_chunk_size(NAME, chunk_size)
    check_state_and_operator(vstate, operator)
    return covariance_grad(vstate, operator, chunk_size)


def covariance_grad(vstate: Any, operator: Any, chunk_size: int | str | None) -> tuple[Any, Any]:
    """:func:`expect_and_grad` for a checked state and chunk size, any operator with a local
    kernel: ``force_to_grad`` of the covariance force (NetKet's ``use_covariance=True``)."""
    sigma, args = get_local_kernel_arguments(vstate, operator)

    def step(chunk, auto=False):
        step_args = step_arguments(
            vstate, operator, sigma, args, _expect_and_grad_step, chunk, auto=auto, where=NAME
        )
        return _expect_and_grad_step(*step_args)

    if chunk_size != "auto":
        return step(chunk_size)
    # the core's rule: the chunk whose gradient program fits the budget; halved once after an OOM,
    # and the smaller chunk kept for these shapes (the local values' then at it too)
    key = Cache.key(nkp.apply_fun(vstate), tuple(sigma.shape), str(sigma.dtype))
    shrunk = _SHRUNK.get(key)
    chunk = shrunk or auto_chunk_size(vstate, sigma)
    run = lambda c: step(c, auto=shrunk is None and c == chunk)
    return run_with_oom_retry(run, chunk, lambda c: _SHRUNK.__setitem__(key, c), NAME)


#: Automatic chunks halved after an out-of-memory error, per (model, sample shape and dtype).
_SHRUNK = Cache(maxsize=64, name="vmcgrad.netket: chunk halved after an out-of-memory error")


def auto_chunk_size(vstate: Any, sigma: Any) -> int:
    """``chunk_size="auto"``: :func:`vmcgrad.auto_chunk_size` of the gradient pass on these samples,
    at the state's ``memory_budget`` (:class:`vmcgrad.netket.MCState`; the default budget otherwise).

    The same chunk then bounds the local-value kernels (their memory also grows with the chunk).
    """
    flat = sigma.reshape(-1, sigma.shape[-1]) if sigma.ndim >= 3 else sigma
    logpsi = state_log_psi(vstate)
    budget = getattr(vstate, "vmcgrad_memory_budget", None)
    try:
        return vmcgrad.auto_chunk_size(logpsi, vstate.parameters, flat, memory_budget=budget)
    except MemoryError as err:
        if not hasattr(err, "need"):
            raise
        out = MemoryError(
            f"vmcgrad.netket: chunk_size='auto' found no chunk of the gradient pass that fits the "
            f"memory budget of {err.budget} bytes per device; even one sample per chunk needs "
            f"{err.need} bytes. Fix: give the state a larger budget, "
            f"vmcgrad.netket.MCState(..., chunk_size='auto', memory_budget={2 * err.need}) (bytes per "
            "device), or a fixed chunk_size, or use more devices."
        )
        out.need, out.budget = err.need, err.budget  # for callers that word their own advice (the CLI)
        raise out from None


def check_state_and_operator(vstate: Any, operator: Any) -> None:
    """Eager checks: an MCState with a non-mutable model, and a hermitian operator."""
    check_state(NAME, vstate)
    if not isinstance(operator, AbstractOperator) or isinstance(operator, Squared):
        raise TypeError(
            f"{NAME}: `operator` must be a netket AbstractOperator other than Squared; got "
            f"{type(operator).__name__}. Fix: use vstate.expect_and_grad for this operator."
        )
    if not operator.is_hermitian:
        raise ValueError(
            f"{NAME}: `operator` must be hermitian (the covariance formula); got "
            f"{type(operator).__name__} with is_hermitian=False. Fix: use vstate.expect_and_grad."
        )


def check_state(name: str, vstate: Any) -> None:
    """Eager check: an ``nk.vqs.MCState`` with a non-mutable model."""
    if not isinstance(vstate, nkp.NetKetMCState):
        raise TypeError(
            f"{name}: `vstate` must be a netket.vqs.MCState; got {type(vstate).__name__}. "
            "Fix: use the vstate's own methods for other variational states."
        )
    if vstate.mutable is not False:
        raise ValueError(
            f"{name}: `vstate` must have a non-mutable model (mutable=False); got mutable="
            f"{vstate.mutable!r}. Fix: use nk.vqs.MCState's methods (NetKet's path) for mutable models."
        )


def _log_psi(apply_fun, model_state, params, x):
    return apply_fun({"params": params, **model_state}, x)


def log_psi(apply_fun: Any, model_state: Any) -> Any:
    """``logpsi(params, x) = apply_fun({"params": params, **model_state}, x)`` for vmcgrad, compiled
    once per model.

    A ``jax.tree_util.Partial`` of ``apply_fun`` and the model state: vmcgrad traces its arrays (new
    model-state values do not recompile) and keys the rest by identity (:mod:`vmcgrad._function`).
    NetKet's apply functions are equal by value instead (``HashablePartial``: the same code and
    equal arguments; its callers make them anew, a new state of the same model has its own), so
    ``apply_fun`` is first replaced by the live one equal to it that was seen first
    (:func:`_first_equal`).
    """
    return jax.tree_util.Partial(_log_psi, _first_equal(apply_fun), model_state)


def state_log_psi(vstate: Any) -> Any:
    """:func:`log_psi` of ``vstate``'s apply function and model state (the state's log-amplitude)."""
    return log_psi(nkp.apply_fun(vstate), vstate.model_state)


#: Weak references to NetKet apply functions, each to itself: equal (and so found) by the value of
#: the function it names while that function lives (:func:`_first_equal`).
_APPLY_FUNS = Cache(maxsize=64, name="vmcgrad.netket: the first live apply function of each value")


def _first_equal(apply_fun: Any) -> Any:
    """The live apply function equal to ``apply_fun`` seen first (``apply_fun`` itself if none, or
    if it cannot be hashed or weakly referenced). Held weakly: the table keeps no model alive."""
    try:
        ref = weakref.ref(apply_fun)
        hash(ref)
    except TypeError:
        return apply_fun
    seen = _APPLY_FUNS.get(ref)  # weak references compare their live objects' values
    first = seen() if seen is not None else None
    if first is None:
        _APPLY_FUNS[ref] = ref
        return apply_fun
    return first


@partial(jax.jit, static_argnames=("kernel", "apply_fun", "chunk_size"))
def _expect_and_grad_step(kernel, apply_fun, chunk_size, params, model_state, sigma, args):
    n_chains = sigma.shape[0]  # as NetKet's forces_expect_hermitian: chains lead, then collapse
    if sigma.ndim >= 3:
        sigma = jax.lax.collapse(sigma, 0, 2)
    o_loc = kernel(apply_fun, {"params": params, **model_state}, sigma, args)
    stats = nk.stats.statistics(o_loc.reshape((n_chains, -1)))
    grad = vmcgrad.expect_grad(log_psi(apply_fun, model_state), params, sigma, o_loc, chunk_size=chunk_size)
    return stats, grad
