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
memory is the largest ``temp_size_in_bytes`` among them. :func:`memory_scan` reports it for
growing N, and the largest N under a budget. NetKet is imported inside the functions.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._harness import Candidate, Row, measure

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


def _max_rel_err(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(np.max(np.abs(np.asarray(y))), 1e-300))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


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

    Candidates are interleaved (:func:`vmcgrad.bench.measure`); setting ``part`` is one of
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
        u_err = _max_rel_err(out["vmcgrad"][1], out["netket"][1])
        log(f"[{model_name}] same samples: |dE| = {e_err:.1e}, SR update max rel. error {u_err:.1e}")
        # fixed-iteration CG (tol=0) amplifies rounding differences over many iterations: 1e-4
        if not (e_err < 1e-8 and u_err < 1e-4):
            raise AssertionError(f"{model_name}: vmcgrad and NetKet disagree (|dE|={e_err}, update {u_err})")
        for part in PARTS:
            cands = [Candidate(impl, _part_call(part, *states[impl])) for impl in IMPLS]
            rows += measure("vmc_sr_step", {"model": model_name, "part": part}, cands, repeats=repeats)
    return rows


def step_programs(impl: str, vs: Any, H: Any, sr: Any) -> dict[str, Any]:
    """The compiled programs of one step (lowered with the state's arrays, not run)."""
    from jax.tree_util import Partial
    from netket.vqs.mc import get_local_kernel, get_local_kernel_arguments

    sigma, args = get_local_kernel_arguments(vs, H)
    x0 = None
    progs = {}
    if impl == "netket":
        from netket.optimizer.qgt import qgt_onthefly
        from netket.vqs.mc.mc_state.expect_forces_chunked import forces_expect_hermitian_chunked

        c = vs.chunk_size
        kernel = get_local_kernel(vs, H, c)
        progs["grad"] = forces_expect_hermitian_chunked.lower(
            c, kernel, vs._apply_fun, False, vs.parameters, vs.model_state, sigma, args
        )
        S = sr.lhs_constructor(vs, 0)
        grad = jax.tree.map(jnp.zeros_like, vs.parameters)
        progs["sr_solve"] = qgt_onthefly._solve.lower(S, Partial(sr.solver), grad, x0=x0)
    else:
        from netket.utils import HashablePartial

        from ..netket import _expect_grad, _qgt

        c = vs.vmcgrad_chunk_size
        kernel = HashablePartial(get_local_kernel(vs, H, c), chunk_size=c)
        progs["grad"] = _expect_grad._expect_and_grad_step.lower(
            kernel, vs._apply_fun, c, vs.parameters, vs.model_state, sigma, args
        )
        S = sr.lhs_constructor(vs, 0)
        grad = jax.tree.map(jnp.zeros_like, vs.parameters)
        progs["sr_solve"] = _qgt._solve.lower(S, Partial(sr.solver), grad, x0=x0)
        from vmcgrad import _qgt as core_qgt

        progs["qgt_build"] = core_qgt._mean.lower(S.qgt)
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
    """Compiled temp bytes of a step's programs for growing N (random valid samples, nothing run).

    Returns one dict per (N, impl): ``{"N", "impl", "<program>_mib"..., "step_mib"}``; with
    ``budget_mib`` the log names the largest N whose step fits, per implementation.
    """
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))
    out = []
    for n in sizes:
        for impl in IMPLS:
            n_chains = max(jax.device_count(), n // 8)
            vs, H, sr = make_step(
                impl, model_name, L=L, n_samples=n, chunk_size=chunk_size, cg_iters=10, n_chains=n_chains
            )
            states = vs.hilbert.random_state(
                jax.random.key(0), (n_chains, n // n_chains), dtype=vs.sampler.dtype
            )
            vs._samples = jax.device_put(states, NamedSharding(mesh, P("S")))  # as NetKet places them
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
