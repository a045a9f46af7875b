"""Core benchmark: ``batched_vjp`` against NetKet's ``vjp_chunked`` and the unchunked ``jax.vjp``.

All three candidates compute the force-like quantity NetKet's ``expect_and_grad`` needs,

.. math::

    O^\\dagger v = \\sum_{i=1}^{N} \\overline{O_i}\\, v_i, \\qquad
    O_i = \\frac{\\partial \\log\\psi_\\theta(\\sigma_i)}{\\partial \\theta},

for NetKet's ``RBM`` with real (float64) or complex (complex128) parameters:

- ``vmcgrad``: ``conj(batched_vjp(f, θ, σ, conj(v), chunk_size=c))``;
- ``netket``: ``nk.jax.vjp_chunked(..., conjugate=True, chunk_size=c)(conj(v))``, called exactly as
  NetKet's ``forces_expect_hermitian_chunked`` calls it (``netket/vqs/mc/mc_state/
  expect_forces_chunked.py``): ``(w, model_state, σ)``, ``chunk_argnums=2``, ``nondiff_argnums=(1, 2)``;
- ``jax.vjp``: ``conj(jax.vjp(lambda w: f(w, σ), θ)[1](conj(v))[0])`` over all N samples at once.

Each is one ``jax.jit`` over ``(params, samples, v)``; the samples are placed as NetKet places them
(``NamedSharding(mesh, P("S"))`` on NetKet's global mesh), the parameters and ``v`` replicated /
sharded the same way. The results are checked against each other before anything is timed
(:class:`AssertionError` if they disagree). The device count is fixed per process: run
``benchmarks/bench_core.py --devices N`` once per count.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._harness import Row, checked_candidates, format_errors, measure
from ._setup import init_model, log_psi, netket_force, place

#: Relative tolerance of the cross-check, per parameter dtype (sums over 16384 samples).
CHECK_RTOL = {"float64": 1e-10, "complex128": 1e-10}


def candidates(
    param_dtype: str, *, L: int, n_samples: int, chunk_size: int, seed: int = 0
) -> tuple[list, dict[str, Any]]:
    """Builds the three jitted candidates for one RBM and checks that they agree.

    Returns:
        ``(candidates, info)``; ``info`` has the relative errors of the cross-check.
    """
    import netket as nk

    import vmcgrad

    model = nk.models.RBM(alpha=1, param_dtype=getattr(jnp, param_dtype))
    s = init_model(model, L, n_samples, seed)
    params, model_state = s["params"], s["model_state"]
    out_dtype = jax.eval_shape(model.apply, {"params": params, **model_state}, s["samples"][:2]).dtype
    vr, vi = jax.random.normal(s["key"], (2, n_samples))
    v = (vr + 1j * vi if jnp.issubdtype(out_dtype, jnp.complexfloating) else vr).astype(out_dtype)
    v = v / n_samples  # like (E_loc - Ē) / N
    (samples, v), (params, model_state) = place((s["samples"], v), (params, model_state))

    apply = model.apply
    logpsi = log_psi(apply, model_state)

    def conj(tree):
        return jax.tree.map(jnp.conj, tree)

    @jax.jit
    def run_vmcgrad(w, x, v):
        return conj(vmcgrad.batched_vjp(logpsi, w, x, jnp.conj(v), chunk_size=chunk_size))

    @jax.jit
    def run_netket(w, x, v):
        return netket_force(apply, w, model_state, x, jnp.conj(v), chunk_size)

    @jax.jit
    def run_jax(w, x, v):
        _, f_vjp = jax.vjp(lambda w: logpsi(w, x), w)
        return conj(f_vjp(jnp.conj(v))[0])

    fns = {"vmcgrad": run_vmcgrad, "netket": run_netket, "jax.vjp": run_jax}
    args = (params, samples, v)
    # Every result must be params-shaped and params-typed (NetKet's real path keeps float64 only
    # because v is real for a real output, as in expect_and_grad).
    cands, errs, results = checked_candidates(fns, args, reference="jax.vjp", rtol=CHECK_RTOL[param_dtype])
    if jax.tree.leaves(results["jax.vjp"])[0].dtype != jnp.dtype(param_dtype):
        raise AssertionError(f"result dtype {jax.tree.leaves(results['jax.vjp'])[0].dtype} != {param_dtype}")
    return cands, {"max_rel_err_vs_jax.vjp": errs}


def run(
    *,
    L: int = 64,
    n_samples: int = 16384,
    chunk_size: int = 1024,
    repeats: int = 5,
    param_dtypes: tuple[str, ...] = ("float64", "complex128"),
    log: Any = print,
) -> list[Row]:
    """Measures the three candidates for each parameter dtype on this process's devices.

    ``log`` receives one line per dtype with the cross-check errors (done before timing). Each row
    has the process CPU time of each timed call (:attr:`Row.cpu_times`), on a shared,
    oversubscribed machine a steadier measure of the work done than wall-clock medians.

    Returns:
        Rows of :func:`benchlib.measure`, in the order vmcgrad, netket, jax.vjp per dtype; each
        setting records ``devices`` and ``dtype`` (``L``, ``N`` and ``chunk`` are the arguments).
    """
    rows = []
    for dtype in param_dtypes:
        cands, info = candidates(dtype, L=L, n_samples=n_samples, chunk_size=chunk_size)
        errs = format_errors(info["max_rel_err_vs_jax.vjp"])
        log(f"[devices={jax.device_count()} {dtype}] results agree; max rel. error vs jax.vjp: {errs}")
        setting = {"devices": jax.device_count(), "dtype": dtype}  # L, N, chunk: the caller's
        rows += measure("core_vjp", setting, cands, repeats=repeats)
    return rows
