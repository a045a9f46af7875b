"""VMC+SR step benchmark: a NetKet driver step with vmcgrad (``vmcgrad.netket``) vs NetKet's own.

One step of ``nk.driver.VMC`` with ``nk.optimizer.SR`` is, for each implementation at the same
chunk size ``c``:

- ``netket``: ``nk.vqs.MCState(..., chunk_size=c)`` (its chunked ``expect_and_grad``: NetKet's
  ``vjp_chunked``) and ``SR(qgt=nk.optimizer.qgt.QGTOnTheFly)`` (chunked at ``vstate.chunk_size``);
- ``vmcgrad``: ``vmcgrad.netket.MCState(..., chunk_size=c)`` and
  ``SR(qgt=vmcgrad.netket.QGTOnTheFly)``.

Both use the same sampler, Hamiltonian (Heisenberg chain, ``LocalOperatorJax``), seeds, and the same
solver: ``jax.scipy.sparse.linalg.cg`` with ``tol=0`` and a fixed ``maxiter`` (so both do exactly
the same number of QGT products). The step is timed with the samples fixed (``sampling excluded``:
``expect_and_grad`` + SR solve) and with a fresh sample first (``sampling included``: ``reset()``,
``samples``, then the same). Results are cross-checked (energy, gradient, SR update) first.

Memory: the compiled programs of a step — the gradient program, and the SR solve (and, for
vmcgrad, the QGT construction pass) — are lowered at N samples without running them; a step's
memory is the largest ``temp_size_in_bytes`` among them. They are built from public functions only
(:func:`step_programs`); the samples come from the state's own sampler. :func:`memory_scan` reports
the memory for growing N, and the largest N under a budget. NetKet is imported inside the functions.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._harness import Candidate, Row, max_rel_err, measure
from ._setup import log_psi

IMPLS = ("vmcgrad", "netket")

#: What is timed: the whole step without / with sampling, and its two halves (same samples).
PARTS = ("step_excl_sampling", "step_incl_sampling", "expect_and_grad", "sr_solve")


def make_model(name: str, L: int) -> Any:
    """'rbm_modphase': RBMModPhase(alpha=1); 'mlp': real ``nk.models.MLP`` with hidden (2L, L), tanh."""
    import flax.linen as nn
    import netket as nk

    if name == "rbm_modphase":
        return nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64)
    if name == "mlp":
        return nk.models.MLP(hidden_dims=(2 * L, L), param_dtype=jnp.float64, hidden_activations=nn.tanh)
    raise ValueError(f"unknown model {name!r}; expected 'rbm_modphase' or 'mlp'")


def make_step(
    impl: str,
    model_name: str,
    *,
    L: int,
    n_samples: int,
    chunk_size: int,
    cg_iters: int,
    n_chains: int,
    seed: int = 0,
) -> tuple[Any, Any, Any]:
    """Returns ``(vstate, hamiltonian, sr)`` for one implementation."""
    import netket as nk

    import vmcgrad.netket as vnk

    g = nk.graph.Chain(L, pbc=True)
    hi = nk.hilbert.Spin(0.5, L, total_sz=0)
    H = nk.operator.Heisenberg(hi, g)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=n_chains)
    kw = dict(n_samples=n_samples, n_discard_per_chain=0, seed=seed, sampler_seed=seed + 1)
    solver = functools.partial(jax.scipy.sparse.linalg.cg, tol=0.0, atol=0.0, maxiter=cg_iters)
    if impl == "netket":
        vs = nk.vqs.MCState(sampler, make_model(model_name, L), chunk_size=chunk_size, **kw)
        qgt = nk.optimizer.qgt.QGTOnTheFly
    elif impl == "vmcgrad":
        vs = vnk.MCState(sampler, make_model(model_name, L), chunk_size=chunk_size, **kw)
        qgt = vnk.QGTOnTheFly
    else:
        raise ValueError(impl)
    sr = nk.optimizer.SR(qgt=qgt, solver=solver, diag_shift=0.01)
    return vs, H, sr


def step(vs: Any, H: Any, sr: Any, *, resample: bool) -> Any:
    """One VMC+SR step as ``nk.driver.VMC.compute_loss_and_update`` does it (no parameter update)."""
    if resample:
        vs.reset()
    stats, grad = vs.expect_and_grad(H)
    return stats, sr(vs, grad, 0)


def _part_call(part: str, vs: Any, H: Any, sr: Any) -> Any:
    if part == "step_excl_sampling":
        return functools.partial(step, vs, H, sr, resample=False)
    if part == "step_incl_sampling":
        return functools.partial(step, vs, H, sr, resample=True)
    if part == "expect_and_grad":
        return functools.partial(vs.expect_and_grad, H)
    grad = vs.expect_and_grad(H)[1]
    return functools.partial(sr, vs, grad, 0)


def run(
    *,
    models: tuple[str, ...] = ("rbm_modphase", "mlp"),
    L: int = 64,
    n_samples: int = 8192,
    chunk_size: int = 256,
    cg_iters: int = 10,
    n_chains: int = 1024,
    repeats: int = 5,
    log: Any = print,
) -> list[Row]:
    """Times one VMC+SR step (sampling excluded / included) and its two halves, vmcgrad vs NetKet.

    Candidates are interleaved (:func:`benchlib.measure`); setting ``part`` is one of
    :data:`PARTS`. The local values are NetKet's kernel at the same chunk size in both.
    """
    rows = []
    for model_name in models:
        states = {
            impl: make_step(
                impl,
                model_name,
                L=L,
                n_samples=n_samples,
                chunk_size=chunk_size,
                cg_iters=cg_iters,
                n_chains=n_chains,
            )
            for impl in IMPLS
        }
        out = {impl: jax.block_until_ready(step(*states[impl], resample=False)) for impl in IMPLS}
        e_err = abs(complex(out["vmcgrad"][0].mean) - complex(out["netket"][0].mean))
        u_err = max_rel_err(out["vmcgrad"][1], out["netket"][1])
        log(f"[{model_name}] same samples: |dE| = {e_err:.1e}, SR update max rel. error {u_err:.1e}")
        # fixed-iteration CG (tol=0) amplifies rounding differences over many iterations: 1e-4
        if not (e_err < 1e-8 and u_err < 1e-4):
            raise AssertionError(f"{model_name}: vmcgrad and NetKet disagree (|dE|={e_err}, update {u_err})")
        for part in PARTS:
            cands = [Candidate(impl, _part_call(part, *states[impl])) for impl in IMPLS]
            rows += measure("vmc_sr_step", {"model": model_name, "part": part}, cands, repeats=repeats)
    return rows


@functools.partial(jax.jit, static_argnames=("kernel", "apply", "chunk_size"))
def _vmcgrad_grad_step(kernel, apply, chunk_size, params, model_state, sigma, args):
    """The gradient program of :class:`vmcgrad.netket.MCState` (``vmcgrad.netket.expect_and_grad``),
    restated from public functions: NetKet's chunked local-value kernel, ``nk.stats.statistics``
    over the chains, :func:`vmcgrad.expect_grad`."""
    import netket as nk

    import vmcgrad

    n_chains = sigma.shape[0]
    if sigma.ndim >= 3:
        sigma = jax.lax.collapse(sigma, 0, 2)
    o_loc = kernel(apply, {"params": params, **model_state}, sigma, args, chunk_size=chunk_size)
    stats = nk.stats.statistics(o_loc.reshape((n_chains, -1)))
    grad = vmcgrad.expect_grad(log_psi(apply, model_state), params, sigma, o_loc, chunk_size=chunk_size)
    return stats, grad


def step_programs(impl: str, vs: Any, H: Any, sr: Any) -> dict[str, Any]:
    """The compiled programs of one step, lowered with the state's arrays (not run).

    Built from public functions only, with ``vs.model.apply`` as the model's apply function:
    ``grad``: NetKet's ``forces_expect_hermitian_chunked`` / the program of
    ``vmcgrad.netket.expect_and_grad`` (:func:`_vmcgrad_grad_step`); ``sr_solve``:
    ``jax.jit(lambda S, g: S.solve(sr.solver, g))`` on the QGT that ``sr`` builds; for vmcgrad also
    ``qgt_build``: ``jax.jit(lambda w, x: vmcgrad.QGT(logpsi, w, x, chunk_size=c))``, the pass that
    computes the mean of the per-sample derivatives when the operator is built.
    """
    from netket.vqs.mc import get_local_kernel, get_local_kernel_arguments
    from netket.vqs.mc.mc_state.expect_forces_chunked import forces_expect_hermitian_chunked

    import vmcgrad

    sigma, args = get_local_kernel_arguments(vs, H)
    apply, params, model_state = vs.model.apply, vs.parameters, vs.model_state
    c = vs.chunk_size if impl == "netket" else vs.vmcgrad_chunk_size
    kernel = get_local_kernel(vs, H, c)
    progs = {}
    if impl == "netket":
        progs["grad"] = forces_expect_hermitian_chunked.lower(
            c, kernel, apply, False, params, model_state, sigma, args
        )
    else:
        progs["grad"] = _vmcgrad_grad_step.lower(kernel, apply, c, params, model_state, sigma, args)
    S = sr.lhs_constructor(vs, 0)
    grad = jax.tree.map(jnp.zeros_like, params)
    progs["sr_solve"] = jax.jit(lambda S, g: S.solve(sr.solver, g)[0]).lower(S, grad)
    if impl == "vmcgrad":
        flat = jax.jit(lambda s: s.reshape(-1, s.shape[-1]))(sigma)
        logpsi = log_psi(apply, model_state)
        build = jax.jit(lambda w, x: vmcgrad.QGT(logpsi, w, x, chunk_size=c))
        progs["qgt_build"] = build.lower(params, flat)
    return {k: p.compile() for k, p in progs.items()}


def memory_scan(
    *,
    model_name: str = "rbm_modphase",
    L: int = 64,
    sizes: tuple[int, ...] = (8192, 16384, 32768, 65536, 131072),
    chunk_size: int = 256,
    budget_mib: float | None = None,
    log: Any = print,
) -> list[dict]:
    """Compiled temp bytes of a step's programs for growing N (samples from the state's sampler; the
    programs are compiled, not run).

    Returns one dict per (N, impl): ``{"N", "impl", "<program>_mib"..., "step_mib"}``; with
    ``budget_mib`` the log names the largest N whose step fits, per implementation.
    """
    out = []
    for n in sizes:
        for impl in IMPLS:
            n_chains = max(jax.device_count(), n // 8)
            vs, H, sr = make_step(
                impl, model_name, L=L, n_samples=n, chunk_size=chunk_size, cg_iters=10, n_chains=n_chains
            )
            progs = step_programs(impl, vs, H, sr)
            mib = {f"{k}_mib": p.memory_analysis().temp_size_in_bytes / 2**20 for k, p in progs.items()}
            row = {"N": n, "impl": impl, **mib, "step_mib": max(mib.values())}
            log("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            out.append(row)
    if budget_mib is not None:
        for impl in IMPLS:
            fit = [r["N"] for r in out if r["impl"] == impl and r["step_mib"] <= budget_mib]
            log(f"budget {budget_mib} MiB: largest N for {impl}: {max(fit) if fit else 'none'}")
    return out
