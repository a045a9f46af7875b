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
import numpy as np

from ._harness import Candidate, Row, measure

#: Relative tolerance of the cross-check (max |x - ref| / max |ref| over each leaf).
CHECK_RTOL = 1e-10


def check_agree(results: dict[str, Any], *, rtol: float = CHECK_RTOL) -> dict[str, float]:
    """Asserts that every result has the first one's structure, shapes, dtypes and close values.

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
        err = 0.0
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise AssertionError(f"{name}: leaf {x.shape} {x.dtype} != {names[0]} {y.shape} {y.dtype}")
            x, y = np.asarray(x), np.asarray(y)
            err = max(err, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-300)))
        errs[name] = err
        if not err <= rtol:
            raise AssertionError(
                f"{name} disagrees with {names[0]}: max relative error {err:.3e} > {rtol:.0e}"
            )
    return errs


def candidates(
    *, L: int, n_samples: int, chunk_size: int, alpha: int = 1, seed: int = 0
) -> tuple[list[Candidate], dict[str, Any]]:
    """Builds the three jitted candidates for RBMModPhase and checks that they agree.

    Returns:
        ``(candidates, info)``; ``info`` has the relative errors of the cross-check.
    """
    import netket as nk
    import netket.jax as nkjax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from netket.vqs.mc.common import force_to_grad

    import vmcgrad

    hi = nk.hilbert.Spin(0.5, L)
    model = nk.models.RBMModPhase(alpha=alpha, param_dtype=jnp.float64)
    k_s, k_p, k_v = jax.random.split(jax.random.key(seed), 3)
    samples = hi.random_state(k_s, n_samples)
    variables = model.init(k_p, samples[:2])
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    lr, li = jax.random.normal(k_v, (2, n_samples))
    local_values = (lr + 1j * li - 0.5 * L).astype(jnp.complex128)  # like E_loc: nonzero mean

    mesh = jax.sharding.get_mesh()
    if not mesh.empty:  # NetKet's global mesh, axis "S"
        samples = jax.device_put(samples, NamedSharding(mesh, P("S")))
        local_values = jax.device_put(local_values, NamedSharding(mesh, P("S")))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        model_state = jax.device_put(model_state, NamedSharding(mesh, P()))

    apply = model.apply
    # the model state travels as traced data (a Partial), as vmcgrad.netket passes it
    logpsi = jax.tree_util.Partial(lambda ms, w, x: apply({"params": w, **ms}, x), model_state)

    def centred(lv):
        return jnp.conj(lv - jnp.mean(lv)) / lv.shape[0]

    @jax.jit
    def run_vmcgrad(w, x, lv):
        return vmcgrad.expect_grad(logpsi, w, x, lv, chunk_size=chunk_size)

    @jax.jit
    def run_netket(w, x, lv):
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
        (force,) = vjp_fun(centred(lv))
        return force_to_grad(force, w)

    @jax.jit
    def run_jax(w, x, lv):
        _, f_vjp = jax.vjp(lambda w: apply({"params": w, **model_state}, x), w)
        return jax.tree.map(lambda g: 2 * g, f_vjp(centred(lv))[0])

    fns = {"vmcgrad": run_vmcgrad, "netket": run_netket, "jax.vjp": run_jax}
    args = (params, samples, local_values)
    results = {name: jax.block_until_ready(fns[name](*args)) for name in ("jax.vjp", "vmcgrad", "netket")}
    errs = check_agree(results)
    cands = [Candidate(name, (lambda f=f: f(*args)), f.lower(*args).compile()) for name, f in fns.items()]
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
        Rows of :func:`vmcgrad.bench.measure` (vmcgrad, netket, jax.vjp); each setting records
        ``devices`` (``L``, ``N`` and ``chunk`` are the arguments).
    """
    cands, info = candidates(L=L, n_samples=n_samples, chunk_size=chunk_size)
    errs = ", ".join(f"{k} {e:.1e}" for k, e in info["max_rel_err_vs_jax.vjp"].items())
    log(f"[devices={jax.device_count()}] results agree; max rel. error vs jax.vjp: {errs}")
    return measure("grad_rbmmodphase", {"devices": jax.device_count()}, cands, repeats=repeats)
