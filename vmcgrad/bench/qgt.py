r"""QGT benchmark: ``vmcgrad.QGT`` against NetKet's ``QGTOnTheFly`` (product and CG solve).

For NetKet's ``RBM`` with real float64 parameters (mode 'real'),

.. math::

    (S + \epsilon) v,\qquad S = \frac1N \mathrm{Re}(\Delta O^\dagger \Delta O),

- ``matvec``: ``S @ v`` with ``chunk_size`` samples per chunk:
  ``vmcgrad`` (operator built once, outside the timed call: :math:`\bar O` is computed when the
  operator is built), ``vmcgrad+build`` (building it, one extra pass, and one product),
  ``vmcgrad c/2`` (a product with half the chunk size: about NetKet's temp memory on CPU), and
  ``netket``: ``QGTOnTheFly_DefaultConstructor(...) @ v`` (its construction is lazy, so this is its
  product; a jvp pass, a centring all-reduce, a vjp pass);
- ``solve``: an SR solve of 50 conjugate-gradient iterations (``tol=0``), operator construction
  included: ``vmcgrad`` ``QGT(...).solve(b, tol=0, maxiter=50)``, ``vmcgrad cached`` (the same with
  ``cache_bytes=2**30``: every chunk's linearisation kept, no forward pass per iteration) and ``netket``
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

from ._harness import Candidate, Row, measure
from .core import _cpu_timed, check_agree


def _setup(L: int, n_samples: int, seed: int = 0) -> dict[str, Any]:
    import netket as nk
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    hi = nk.hilbert.Spin(0.5, L)
    model = nk.models.RBM(alpha=1, param_dtype=jnp.float64)
    k_s, k_p, k_v = jax.random.split(jax.random.key(seed), 3)
    samples = hi.random_state(k_s, n_samples).astype(jnp.float64)
    variables = model.init(k_p, samples[:2])
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(k_v, len(leaves))
    v = tdef.unflatten([jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # NetKet's global mesh, axis "S"
        samples = jax.device_put(samples, NamedSharding(mesh, P("S")))
        params, model_state, v = jax.device_put((params, model_state, v), NamedSharding(mesh, P()))
    return {"model": model, "params": params, "model_state": model_state, "samples": samples, "v": v}


def _functions(
    model: Any, model_state: Any, chunk_size: int, diag_shift: float, cache_bytes: int = 2**30
) -> dict[str, Any]:
    from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

    import vmcgrad

    apply = model.apply
    logpsi = jax.tree_util.Partial(lambda ms, w, x: apply({"params": w, **ms}, x), model_state)

    def ours(w, x, chunk_size=chunk_size):
        return vmcgrad.QGT(logpsi, w, x, chunk_size=chunk_size, diag_shift=diag_shift)

    def theirs(w, x):
        return QGTOnTheFly_DefaultConstructor(
            apply, w, model_state, x, chunk_size=chunk_size, diag_shift=diag_shift
        )

    solver = partial(jax.scipy.sparse.linalg.cg, tol=0.0, maxiter=50)  # nk.optimizer.SR's default
    return {
        "matvec": {
            "vmcgrad": jax.jit(lambda S, v: S @ v),
            "vmcgrad+build": jax.jit(lambda w, x, v: ours(w, x) @ v),
            "vmcgrad c/2": jax.jit(lambda S, v: S @ v),
            "netket": jax.jit(lambda w, x, v: theirs(w, x) @ v),
        },
        "solve": {
            "vmcgrad": jax.jit(lambda w, x, b: ours(w, x).solve(b, tol=0.0, maxiter=50)[0]),
            "vmcgrad cached": jax.jit(
                lambda w, x, b: ours(w, x).solve(b, tol=0.0, maxiter=50, cache_bytes=cache_bytes)[0]
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
    cpu_times: dict | None = None,
) -> list[Row]:
    """Measures the product and the solve; returns rows (settings: devices, N).

    ``cpu_times``, when given, is filled with ``(bench, devices, name) -> [s, ...]``, the process CPU
    time of each timed call (steadier than wall time on a shared machine; see :mod:`.core`).
    """
    s = _setup(L, n_samples)
    fns = _functions(s["model"], s["model_state"], chunk_size, diag_shift)
    w, x, v = s["params"], s["samples"], s["v"]
    S = jax.block_until_ready(fns["build"](w, x))
    S_half = jax.block_until_ready(fns["build c/2"](w, x))
    args = {"vmcgrad": (S, v), "vmcgrad+build": (w, x, v), "vmcgrad c/2": (S_half, v), "netket": (w, x, v)}
    rows = []
    mv = fns["matvec"]
    results = {
        name: jax.block_until_ready(mv[name](*args[name]))
        for name in ("netket", *[n for n in args if n != "netket"])
    }
    errs = check_agree(results, rtol=1e-10)
    log(f"[devices={jax.device_count()}] S@v agree; max rel. error vs netket: {errs}")
    cands = [Candidate(n, (lambda f=f, a=args[n]: f(*a)), f.lower(*args[n]).compile()) for n, f in mv.items()]
    setting = {"devices": jax.device_count(), "N": n_samples}
    rows += _measure("qgt_matvec", setting, cands, repeats, cpu_times)

    sv = fns["solve"]
    results = {
        name: jax.block_until_ready(sv[name](w, x, v)) for name in ("netket", "vmcgrad", "vmcgrad cached")
    }
    errs = check_agree(results, rtol=1e-6)
    log(f"[devices={jax.device_count()}] 50-iteration CG solves agree; max rel. error vs netket: {errs}")
    cands = [Candidate(n, (lambda f=f: f(w, x, v)), f.lower(w, x, v).compile()) for n, f in sv.items()]
    rows += _measure("qgt_solve50", setting, cands, max(3, repeats // 2), cpu_times)
    return rows


def _measure(bench: str, setting: dict, cands: list, repeats: int, cpu_times: dict | None) -> list[Row]:
    records = {c.name: [] for c in cands}
    cands = [Candidate(c.name, _cpu_timed(c.call, records[c.name]), c.compiled) for c in cands]
    rows = measure(bench, setting, cands, repeats=repeats)
    if cpu_times is not None:
        for name, rec in records.items():
            cpu_times[(bench, jax.device_count(), name)] = rec[1:]  # the warm-up call dropped
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
        for name, a in (("vmcgrad", (S, v)), ("netket", (w, x, v))):
            compiled = mv[name].lower(*a).compile()
            out.append({"N": n, "name": name, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes})
    return out
