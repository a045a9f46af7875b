r"""QGT benchmark: ``vmcgrad.QGT`` against NetKet's ``QGTOnTheFly`` (product and CG solve).

For NetKet's ``RBM`` with real float64 parameters (mode 'real'),

.. math::

    (S + \epsilon) v,\qquad S = \frac1N \mathrm{Re}(\Delta O^\dagger \Delta O),

- ``matvec``: ``S @ v`` with ``chunk_size`` samples per chunk:
  ``vmcgrad`` (operator built once, outside the timed call: :math:`\bar O` is computed when the
  operator is built), ``vmcgrad+build`` (building it, one extra pass, and one product),
  ``vmcgrad c/2`` (a product with half the chunk size: about NetKet's temp memory on CPU),
  ``vmcgrad 2-pass`` (NetKet's design with vmcgrad's public passes: ``batched_jvp``, the
  centring, ``batched_vjp``; the fused product linearises each chunk once instead, which saves a
  forward pass and keeps more of the chunk alive), and ``netket``:
  ``QGTOnTheFly_DefaultConstructor(...) @ v`` (its construction is lazy, so this is its product; a
  jvp pass, a centring all-reduce, a vjp pass);
- ``solve``: an SR solve of 50 conjugate-gradient iterations (``tol=0``), operator construction
  included: ``vmcgrad`` ``QGT(...).solve(b, tol=0, maxiter=50)``, ``vmcgrad cached`` (the same
  through ``QGT(...).linearize().solve(...)``: every chunk's linearisation kept, no forward pass
  per iteration) and ``netket``
  ``QGTOnTheFly(...).solve(partial(jax.scipy.sparse.linalg.cg, tol=0, maxiter=50), b)`` (the
  solver ``nk.optimizer.SR`` uses by default).

Each candidate is one ``jax.jit``; samples are placed as NetKet places them (``P("S")`` on its
global mesh). Results are cross-checked before timing. ``temp_memory`` compiles (does not run) the
products at two sample counts to show the temp memory flat in N.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ._harness import Row, checked_candidates, measure
from ._setup import init_model, log_psi, place


def _setup(L: int, n_samples: int, seed: int = 0) -> dict[str, Any]:
    import netket as nk

    model = nk.models.RBM(alpha=1, param_dtype=jnp.float64)
    s = init_model(model, L, n_samples, seed)
    leaves, tdef = jax.tree.flatten(s["params"])
    keys = jax.random.split(s["key"], len(leaves))
    v = tdef.unflatten([jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])
    samples, (params, model_state, v) = place(
        s["samples"].astype(jnp.float64), (s["params"], s["model_state"], v)
    )
    return {"model": model, "params": params, "model_state": model_state, "samples": samples, "v": v}


def _functions(model: Any, model_state: Any, chunk_size: int, diag_shift: float) -> dict[str, Any]:
    from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

    import vmcgrad

    apply = model.apply
    logpsi = log_psi(apply, model_state)

    def ours(w, x, chunk_size=chunk_size):
        return vmcgrad.QGT(logpsi, w, x, chunk_size=chunk_size, diag_shift=diag_shift)

    def theirs(w, x):
        return QGTOnTheFly_DefaultConstructor(
            apply, w, model_state, x, chunk_size=chunk_size, diag_shift=diag_shift
        )

    def two_pass(w, x, v):
        t = vmcgrad.batched_jvp(logpsi, w, x, v, chunk_size=chunk_size)  # O v (real here)
        g = vmcgrad.batched_vjp(logpsi, w, x, (t - jnp.mean(t)) / t.shape[0], chunk_size=chunk_size)
        return jax.tree.map(lambda a, b: a + diag_shift * b, g, v)

    solver = partial(jax.scipy.sparse.linalg.cg, tol=0.0, maxiter=50)  # nk.optimizer.SR's default
    return {
        "matvec": {
            "vmcgrad": jax.jit(lambda S, v: S @ v),
            "vmcgrad+build": jax.jit(lambda w, x, v: ours(w, x) @ v),
            "vmcgrad c/2": jax.jit(lambda S, v: S @ v),
            "vmcgrad 2-pass": jax.jit(two_pass),
            "netket": jax.jit(lambda w, x, v: theirs(w, x) @ v),
        },
        "solve": {
            "vmcgrad": jax.jit(lambda w, x, b: ours(w, x).solve(b, tol=0.0, maxiter=50)[0]),
            "vmcgrad cached": jax.jit(
                lambda w, x, b: ours(w, x).linearize().solve(b, tol=0.0, maxiter=50)[0]
            ),
            "netket": jax.jit(lambda w, x, b: theirs(w, x).solve(solver, b)[0]),
        },
        "build": jax.jit(ours),
        "build c/2": jax.jit(partial(ours, chunk_size=max(1, chunk_size // 2))),
    }


def run(
    *,
    L: int = 48,
    n_samples: int = 8192,
    chunk_size: int = 1024,
    diag_shift: float = 0.01,
    repeats: int = 5,
    log: Any = print,
) -> list[Row]:
    """Measures the product and the solve; returns rows (settings: devices, N).

    Each row has the process CPU time of each timed call (:attr:`Row.cpu_times`; steadier than
    wall time on a shared machine).
    """
    s = _setup(L, n_samples)
    fns = _functions(s["model"], s["model_state"], chunk_size, diag_shift)
    w, x, v = s["params"], s["samples"], s["v"]
    S = jax.block_until_ready(fns["build"](w, x))
    S_half = jax.block_until_ready(fns["build c/2"](w, x))
    args = {
        "vmcgrad": (S, v),
        "vmcgrad+build": (w, x, v),
        "vmcgrad c/2": (S_half, v),
        "vmcgrad 2-pass": (w, x, v),
        "netket": (w, x, v),
    }
    setting = {"devices": jax.device_count(), "N": n_samples}
    cands, errs, _ = checked_candidates(fns["matvec"], args, reference="netket", rtol=1e-10)
    log(f"[devices={jax.device_count()}] S@v agree; max rel. error vs netket: {errs}")
    rows = measure("qgt_matvec", setting, cands, repeats=repeats)
    cands, errs, _ = checked_candidates(fns["solve"], (w, x, v), reference="netket", rtol=1e-6)
    log(f"[devices={jax.device_count()}] 50-iteration CG solves agree; max rel. error vs netket: {errs}")
    rows += measure("qgt_solve50", setting, cands, repeats=max(3, repeats // 2))
    return rows


def temp_memory(
    *, L: int = 48, n_samples: tuple[int, ...] = (8192, 32768), chunk_size: int = 1024
) -> list[dict]:
    """Compiled temp bytes of the products at several N (compiled, not run)."""
    out = []
    for n in n_samples:
        s = _setup(L, n)
        fns = _functions(s["model"], s["model_state"], chunk_size, 0.01)
        w, x, v = s["params"], s["samples"], s["v"]
        S = fns["build"](w, x)
        mv = fns["matvec"]
        for name, a in (("vmcgrad", (S, v)), ("vmcgrad 2-pass", (w, x, v)), ("netket", (w, x, v))):
            compiled = mv[name].lower(*a).compile()
            out.append({"N": n, "name": name, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes})
    return out


def equal_memory(
    *,
    L: int = 48,
    n_samples: int = 8192,
    chunk_size: int = 1024,
    diag_shift: float = 0.01,
    repeats: int = 5,
    log: Any = print,
) -> list[Row]:
    r"""The product and the 50-iteration CG solve at equal compiled memory: NetKet's
    ``QGTOnTheFly`` at ``chunk_size`` against ``vmcgrad.QGT(chunk_size="auto", memory_budget=B)``.

    :math:`B` is NetKet's compiled temp bytes of ``S @ v`` plus vmcgrad's own arguments and outputs
    (``memory_analysis()``; the rule of ``chunk_size="auto"`` counts all three), so vmcgrad's
    temp bytes are at most NetKet's. Candidates (all at that budget): ``vmcgrad auto`` (the design
    and chunk :func:`vmcgrad.QGT` picks; named with them), and each design forced at its own largest
    fitting chunk (``vmcgrad fused``, ``vmcgrad jvp_vjp``). The solve builds the operator inside the
    timed call, at the picked design and chunk, as the ``solve`` rows of :func:`run` do.
    """
    import vmcgrad

    s = _setup(L, n_samples)
    fns = _functions(s["model"], s["model_state"], chunk_size, diag_shift)
    w, x, v = s["params"], s["samples"], s["v"]
    logpsi = log_psi(s["model"].apply, s["model_state"])
    nk_temp = fns["matvec"]["netket"].lower(w, x, v).compile().memory_analysis().temp_size_in_bytes
    matvec = jax.jit(lambda S, v: S @ v)
    m = matvec.lower(fns["build"](w, x), v).compile().memory_analysis()
    budget = nk_temp + m.argument_size_in_bytes + m.output_size_in_bytes
    auto = vmcgrad.QGT(logpsi, w, x, chunk_size="auto", memory_budget=budget, diag_shift=diag_shift)
    picked = f"vmcgrad auto ({auto.design}, {auto.chunk_size})"
    chosen = {picked: (auto.design, auto.chunk_size)}
    for design in ("fused", "jvp_vjp"):
        op = vmcgrad.QGT(
            logpsi, w, x, chunk_size="auto", memory_budget=budget, diag_shift=diag_shift, design=design
        )
        chosen[f"vmcgrad {design} ({op.chunk_size})"] = (design, op.chunk_size)
    log(
        f"[devices={jax.device_count()}] equal memory: NetKet chunk {chunk_size}, temp {nk_temp} B; "
        f"budget {budget} B per device; picked {auto.design} at chunk {auto.chunk_size}"
    )
    # the operators at the chosen chunks, fixed (nothing left to choose inside the timed calls)
    ops = {
        name: vmcgrad.QGT(logpsi, w, x, chunk_size=c, diag_shift=diag_shift, design=d)
        for name, (d, c) in chosen.items()
    }
    setting = {"devices": jax.device_count(), "N": n_samples}
    mv = {"netket": fns["matvec"]["netket"], **{name: matvec for name in ops}}
    args = {"netket": (w, x, v), **{name: (op, v) for name, op in ops.items()}}
    cands, errs, _ = checked_candidates(mv, args, reference="netket", rtol=1e-10)
    log(f"[devices={jax.device_count()}] S@v agree at equal memory; max rel. error vs netket: {errs}")
    rows = measure("qgt_matvec_eqmem", setting, cands, repeats=repeats)

    def ours(w, x, b):
        S = vmcgrad.QGT(logpsi, w, x, chunk_size=auto.chunk_size, diag_shift=diag_shift, design=auto.design)
        return S.solve(b, tol=0.0, maxiter=50)[0]

    solve = {"netket": fns["solve"]["netket"], picked: jax.jit(ours)}
    cands, errs, _ = checked_candidates(solve, (w, x, v), reference="netket", rtol=1e-6)
    log(f"[devices={jax.device_count()}] 50-iteration CG at equal memory agree; max rel. error: {errs}")
    rows += measure("qgt_solve50_eqmem", setting, cands, repeats=max(3, repeats // 2))
    return rows
