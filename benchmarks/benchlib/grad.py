r"""Gradient benchmark: ``vmcgrad.expect_grad`` against NetKet's chunked force and the plain ``jax.vjp``.

All candidates compute the VMC gradient of NetKet's ``RBMModPhase`` (real parameters, complex
output: the case where NetKet's ``nk.jax.vjp`` runs two forward traces and four pullbacks),

.. math::

    g = 2\,\mathrm{Re}\,F, \qquad F = \frac{1}{N}\sum_{i=1}^{N} \overline{O_i}\,(L_i - \bar L),

from the same samples and local values :math:`L_i` (random complex numbers: the local-energy kernel
is not part of what is measured, and costs both sides the same):

- ``vmcgrad``: ``vmcgrad.expect_grad(logpsi, θ, σ, L, chunk_size=c)`` (one pullback per chunk);
- ``netket``: what ``forces_expect_hermitian_chunked`` (``netket/vqs/mc/mc_state/
  expect_forces_chunked.py``) does after the local values: centre, ``nk.jax.vjp_chunked(...,
  conjugate=True, chunk_size=c, chunk_argnums=2, nondiff_argnums=(1, 2))(conj(ΔL)/N)``, then
  ``force_to_grad`` (``netket/vqs/mc/common.py``);
- ``jax.vjp``: ``2 jax.vjp(lambda w: logpsi(w, σ), θ)[1](conj(ΔL)/N)`` over all N samples at once
  (no chunking: the memory it needs grows with N).

Each is one ``jax.jit`` over ``(params, samples, local_values)``, with the samples and local values
placed as NetKet places them (``NamedSharding(mesh, P("S"))`` on its global mesh). The results are
checked against each other before anything is timed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._harness import Row, checked_candidates, format_errors, measure
from ._setup import centred, init_model, log_psi, netket_grad, place

#: Relative tolerance of the cross-check (max |x - ref| / max |ref| over each leaf).
CHECK_RTOL = 1e-10


def candidates(
    *, L: int, n_samples: int, chunk_size: int, alpha: int = 1, seed: int = 0
) -> tuple[list, dict[str, Any]]:
    """Builds the three jitted candidates for RBMModPhase and checks that they agree.

    Returns:
        ``(candidates, info)``; ``info`` has the relative errors of the cross-check.
    """
    import netket as nk

    import vmcgrad

    model = nk.models.RBMModPhase(alpha=alpha, param_dtype=jnp.float64)
    s = init_model(model, L, n_samples, seed)
    lr, li = jax.random.normal(s["key"], (2, n_samples))
    local_values = (lr + 1j * li - 0.5 * L).astype(jnp.complex128)  # like E_loc: nonzero mean
    (samples, local_values), (params, model_state) = place(
        (s["samples"], local_values), (s["params"], s["model_state"])
    )

    apply = model.apply
    logpsi = log_psi(apply, model_state)  # the model state travels as traced data

    @jax.jit
    def run_vmcgrad(w, x, lv):
        return vmcgrad.expect_grad(logpsi, w, x, lv, chunk_size=chunk_size)

    @jax.jit
    def run_netket(w, x, lv):
        return netket_grad(apply, w, model_state, x, lv, chunk_size)

    @jax.jit
    def run_jax(w, x, lv):
        _, f_vjp = jax.vjp(lambda w: apply({"params": w, **model_state}, x), w)
        return jax.tree.map(lambda g: 2 * g, f_vjp(centred(lv))[0])

    fns = {"vmcgrad": run_vmcgrad, "netket": run_netket, "jax.vjp": run_jax}
    args = (params, samples, local_values)
    cands, errs, _ = checked_candidates(fns, args, reference="jax.vjp", rtol=CHECK_RTOL)
    return cands, {"max_rel_err_vs_jax.vjp": errs}


def run(
    *,
    L: int = 48,
    n_samples: int = 8192,
    chunk_size: int = 1024,
    repeats: int = 7,
    log: Any = print,
) -> list[Row]:
    """Measures the three candidates on this process's devices.

    Returns:
        Rows of :func:`benchlib.measure` (vmcgrad, netket, jax.vjp); each setting records
        ``devices`` (``L``, ``N`` and ``chunk`` are the arguments).
    """
    cands, info = candidates(L=L, n_samples=n_samples, chunk_size=chunk_size)
    errs = format_errors(info["max_rel_err_vs_jax.vjp"])
    log(f"[devices={jax.device_count()}] results agree; max rel. error vs jax.vjp: {errs}")
    return measure("grad_rbmmodphase", {"devices": jax.device_count()}, cands, repeats=repeats)
