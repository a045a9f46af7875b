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

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._harness import Candidate, Row, measure

#: Relative tolerance of the cross-check, per parameter dtype (sums over 16384 samples).
CHECK_RTOL = {"float64": 1e-10, "complex128": 1e-10}


def _max_rel_err(a: Any, b: Any) -> float:
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        errs.append(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-300)))
    return max(errs)


def check_agree(results: dict[str, Any], *, rtol: float) -> dict[str, float]:
    """Asserts that every result has the first one's structure/shapes/dtypes and close values.

    Returns:
        name -> max over leaves of ``max|x - ref| / max|ref|`` against the first result.
    """
    names = list(results)
    ref = results[names[0]]
    errs = {}
    for name in names[1:]:
        got = results[name]
        if jax.tree.structure(got) != jax.tree.structure(ref):
            raise AssertionError(f"{name}: tree {jax.tree.structure(got)} != {jax.tree.structure(ref)}")
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise AssertionError(f"{name}: leaf {x.shape} {x.dtype} != {names[0]} {y.shape} {y.dtype}")
        errs[name] = _max_rel_err(got, ref)
        if not errs[name] <= rtol:
            raise AssertionError(
                f"{name} disagrees with {names[0]}: max relative error {errs[name]:.3e} > {rtol:.0e}"
            )
    return errs


def candidates(
    param_dtype: str, *, L: int, n_samples: int, chunk_size: int, seed: int = 0
) -> tuple[list[Candidate], dict[str, Any]]:
    """Builds the three jitted candidates for one RBM and checks that they agree.

    Returns:
        ``(candidates, info)``; ``info`` has the relative errors of the cross-check.
    """
    import netket as nk
    import netket.jax as nkjax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vmcgrad

    hi = nk.hilbert.Spin(0.5, L)
    model = nk.models.RBM(alpha=1, param_dtype=getattr(jnp, param_dtype))
    k_s, k_p, k_v = jax.random.split(jax.random.key(seed), 3)
    samples = hi.random_state(k_s, n_samples)
    variables = model.init(k_p, samples[:2])
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    out_dtype = jax.eval_shape(model.apply, variables, samples[:2]).dtype
    vr, vi = jax.random.normal(k_v, (2, n_samples))
    v = (vr + 1j * vi if jnp.issubdtype(out_dtype, jnp.complexfloating) else vr).astype(out_dtype)
    v = v / n_samples  # like (E_loc - Ē) / N

    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # NetKet's global mesh, axis "S"
        samples = jax.device_put(samples, NamedSharding(mesh, P("S")))
        v = jax.device_put(v, NamedSharding(mesh, P("S")))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        model_state = jax.device_put(model_state, NamedSharding(mesh, P()))

    apply = model.apply

    def logpsi(w, x):  # one object for the whole run: vmcgrad caches on its identity
        return apply({"params": w, **model_state}, x)

    def conj(tree):
        return jax.tree.map(jnp.conj, tree)

    @jax.jit
    def run_vmcgrad(w, x, v):
        return conj(vmcgrad.batched_vjp(logpsi, w, x, jnp.conj(v), chunk_size=chunk_size))

    @jax.jit
    def run_netket(w, x, v):
        vjp_fun = nkjax.vjp_chunked(
            lambda w, ms, x: apply({"params": w, **ms}, x),
            w,
            model_state,
            x,
            conjugate=True,
            chunk_size=chunk_size,
            chunk_argnums=2,
            nondiff_argnums=(1, 2),
        )
        (grad,) = vjp_fun(jnp.conj(v))
        return grad

    @jax.jit
    def run_jax(w, x, v):
        _, f_vjp = jax.vjp(lambda w: logpsi(w, x), w)
        return conj(f_vjp(jnp.conj(v))[0])

    fns = {"vmcgrad": run_vmcgrad, "netket": run_netket, "jax.vjp": run_jax}
    args = (params, samples, v)
    # The reference first; every result must be params-shaped and params-typed (NetKet's real path
    # keeps float64 only because v is real for a real output, as in expect_and_grad).
    results = {name: jax.block_until_ready(fns[name](*args)) for name in ("jax.vjp", "vmcgrad", "netket")}
    errs = check_agree(results, rtol=CHECK_RTOL[param_dtype])
    if jax.tree.leaves(results["jax.vjp"])[0].dtype != jnp.dtype(param_dtype):
        raise AssertionError(f"result dtype {jax.tree.leaves(results['jax.vjp'])[0].dtype} != {param_dtype}")
    cands = [Candidate(name, (lambda f=f: f(*args)), f.lower(*args).compile()) for name, f in fns.items()]
    return cands, {"max_rel_err_vs_jax.vjp": errs}


def _cpu_timed(call: Any, record: list[float]) -> Any:
    """``call`` that also appends its process CPU time (all threads) to ``record``."""

    def timed():
        t0 = time.process_time()
        out = jax.block_until_ready(call())
        record.append(time.process_time() - t0)
        return out

    return timed


def run(
    *,
    L: int = 64,
    n_samples: int = 16384,
    chunk_size: int = 1024,
    repeats: int = 5,
    param_dtypes: tuple[str, ...] = ("float64", "complex128"),
    log: Any = print,
    cpu_times: dict | None = None,
) -> list[Row]:
    """Measures the three candidates for each parameter dtype on this process's devices.

    ``log`` receives one line per dtype with the cross-check errors (done before timing).
    ``cpu_times``, when given, is filled with ``(devices, dtype, name) -> [s, ...]``: the process CPU
    time of each timed call (the warm-up call dropped). On a shared, oversubscribed machine it is
    a steadier measure of the work done than wall-clock medians.

    Returns:
        Rows of :func:`vmcgrad.bench.measure`, in the order vmcgrad, netket, jax.vjp per dtype; each
        setting records ``devices`` and ``dtype`` (short enough for :func:`format_table`; ``L``, ``N``
        and ``chunk`` are the arguments).
    """
    rows = []
    for dtype in param_dtypes:
        cands, info = candidates(dtype, L=L, n_samples=n_samples, chunk_size=chunk_size)
        errs = ", ".join(f"{k} {e:.1e}" for k, e in info["max_rel_err_vs_jax.vjp"].items())
        log(f"[devices={jax.device_count()} {dtype}] results agree; max rel. error vs jax.vjp: {errs}")
        records = {c.name: [] for c in cands}
        cands = [Candidate(c.name, _cpu_timed(c.call, records[c.name]), c.compiled) for c in cands]
        setting = {"devices": jax.device_count(), "dtype": dtype}  # L, N, chunk: the caller's
        rows += measure("core_vjp", setting, cands, repeats=repeats)
        if cpu_times is not None:
            for name, rec in records.items():
                cpu_times[(jax.device_count(), dtype, name)] = rec[1:]
    return rows
