"""The SR phase of a VMC + SR step on the race's model: NetKet's best route against vmcgrad's at a budget.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/bench_sr_phase.py                      # 4x4 J1-J2 GCNN, N = 256 and 1024, 1 GiB
    python benchmarks/bench_sr_phase.py --n 256 --cg-iters 50 --repeats 7 --json sr-phase.json

What is timed is one call of the preconditioner as ``nk.driver.VMC`` makes it, ``sr(vstate, grad)``:
the QGT built on the step's samples (``lhs_constructor``) and its conjugate-gradient solve, at a fixed
number of iterations (``tol=0``, ``--cg-iters``; ``solver_restart=True``, so every call starts from
zero), on the same samples and gradient for every contender. Contenders:

- ``netket``: ``nk.optimizer.SR(qgt=QGTOnTheFly, solver=cg)`` on ``nk.vqs.MCState`` without a chunk:
  NetKet's fastest route where the step fits (it keeps one ``jax.linearize`` of the whole batch);
- ``vmcgrad-auto``: ``vmcgrad.netket.SR()`` on ``vmcgrad.netket.MCState(chunk_size="auto",
  memory_budget=B)``: the chunk and the product's design chosen by the budget, and the
  linearisations kept through the solve where the budget holds them (``QGTOperator.kept_solve``);
- ``netket-chunked``: NetKet's SR on ``nk.vqs.MCState(chunk_size=c)``, ``c`` the product's chunk that
  ``auto`` chose (NetKet's route within a budget its unchunked step exceeds: a jvp pass and a vjp
  pass per product, each chunk's forward recomputed);
- ``vmcgrad-recompute``: vmcgrad's at that chunk, given as an integer: every product recomputes each
  chunk's forward pass (the route before ``kept_solve``).

Times are medians of interleaved repeats (the contenders take turns), with the ratio to NetKet's;
the updates are checked to agree (the same iterations on the same matrix: rounding only).

``--chunk-scan C ...`` instead times ``vmcgrad.QGT(..., chunk_size=c).solve`` at the first ``--n``,
recomputing each chunk's forward pass per product and on kept linearisations (``S.linearize()``),
at each chunk ``c``, with the compiled bytes of each solve (``vmcgrad.program_bytes``)::

    python benchmarks/bench_sr_phase.py --n 1024 --chunk-scan 128 256 512 1024 --cg-iters 30 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

MiB = 2**20


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024], help="samples per step")
    ap.add_argument("--budget-mib", type=float, default=1024)
    ap.add_argument("--cg-iters", type=int, default=50)
    ap.add_argument("--diag-shift", type=float, default=1e-3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=3, help="GCNN layers (the race's: 3)")
    ap.add_argument("--features", type=int, default=8, help="GCNN features per layer (the race's: 8)")
    ap.add_argument("--chunk-scan", type=int, nargs="+", metavar="C", help="time the core solve per chunk")
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


def problem(n: int, args: argparse.Namespace):
    """``(H, model, sampler, state kwargs)`` of the race's 4x4 J1-J2 model at ``n`` samples."""
    import jax.numpy as jnp
    import netket as nk

    g = nk.graph.Square(4)
    hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
    H = nk.operator.Heisenberg(
        hi, nk.graph.Square(4, max_neighbor_order=2), J=[1.0, 0.5], sign_rule=[True, False]
    )
    features = (args.features,) * args.layers
    model = nk.models.GCNN(symmetries=g, layers=args.layers, features=features, param_dtype=jnp.float64)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=16, d_max=2)
    return H, model, sampler, dict(n_samples=n, n_discard_per_chain=4, seed=0, sampler_seed=1000)


def chunk_scan(n: int, args: argparse.Namespace) -> list[dict]:
    """The core solve per chunk, recomputing and on kept linearisations: time and compiled bytes."""
    import jax
    import jax.numpy as jnp
    import netket as nk
    from benchlib import log_psi

    import vmcgrad

    _, model, sampler, kw = problem(n, args)
    vs = nk.vqs.MCState(sampler, model, **kw)
    x, params = vs.samples.reshape(-1, vs.samples.shape[-1]), vs.parameters
    logpsi = log_psi(model.apply, vs.model_state)
    b = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
    options = dict(tol=0.0, maxiter=args.cg_iters)
    solves = {
        "recomputed": jax.jit(lambda S, b: S.solve(b, **options)[0]),
        "kept": jax.jit(lambda S, b: S.linearize().solve(b, **options)[0]),
    }
    cases = {}
    for c in args.chunk_scan:
        S = vmcgrad.QGT(logpsi, params, x, chunk_size=c, diag_shift=args.diag_shift)
        for route, solve in solves.items():
            mib = vmcgrad.program_bytes(solve.lower(S, b).compile()) / MiB
            jax.block_until_ready(solve(S, b))  # compiles
            cases[(c, route)] = (S, solve, mib, [])
    for _ in range(args.repeats):
        for S, solve, _, times in cases.values():
            t0 = time.perf_counter()
            jax.block_until_ready(solve(S, b))
            times.append(time.perf_counter() - t0)
    return [
        {"n": n, "chunk": c, "route": route, "mib": mib, "median_s": statistics.median(t), "times_s": t}
        for (c, route), (_, _, mib, t) in cases.items()
    ]


def run(n: int, args: argparse.Namespace) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import netket as nk
    import numpy as np

    import vmcgrad.netket as vnk

    H, model, sampler, kw = problem(n, args)
    budget = int(args.budget_mib * MiB)
    netket_state = nk.vqs.MCState(sampler, model, **kw)
    auto_state = vnk.MCState(sampler, model, chunk_size="auto", memory_budget=budget, **kw)
    _, grad = netket_state.expect_and_grad(H)
    n_params = netket_state.n_parameters
    np.testing.assert_array_equal(np.asarray(auto_state.samples), np.asarray(netket_state.samples))
    solver = functools.partial(jax.scipy.sparse.linalg.cg, tol=0.0, maxiter=args.cg_iters)
    options = dict(solver=solver, diag_shift=args.diag_shift, solver_restart=True)
    sr_auto = vnk.SR(**options)
    qgt = sr_auto.lhs_constructor(auto_state, args.diag_shift).qgt
    chunk = qgt.chunk_size
    recompute_state = vnk.MCState(sampler, model, chunk_size=chunk, **kw)
    chunked_state = nk.vqs.MCState(sampler, model, chunk_size=chunk, **kw)
    np.testing.assert_array_equal(np.asarray(chunked_state.samples), np.asarray(netket_state.samples))
    np.testing.assert_array_equal(np.asarray(recompute_state.samples), np.asarray(netket_state.samples))
    contenders = {
        "netket": (nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTOnTheFly, **options), netket_state),
        "netket-chunked": (nk.optimizer.SR(qgt=nk.optimizer.qgt.QGTOnTheFly, **options), chunked_state),
        "vmcgrad-auto": (sr_auto, auto_state),
        "vmcgrad-recompute": (vnk.SR(**options), recompute_state),
    }
    updates = {k: jax.block_until_ready(sr(vs, grad)) for k, (sr, vs) in contenders.items()}  # compiles
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for k, (sr, vs) in contenders.items():
            t0 = time.perf_counter()
            jax.block_until_ready(sr(vs, grad))
            times[k].append(time.perf_counter() - t0)
    ref = jax.tree.leaves(updates["netket"])
    scale = max(float(jnp.max(jnp.abs(x))) for x in ref)
    kept_mib = qgt.linearize().nbytes / MiB if qgt.kept_solve else None
    base = statistics.median(times["netket"])
    rows = []
    for k, t in times.items():
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(updates[k]), ref)) / scale
        route = {
            "netket": "unchunked, linearised once",
            "netket-chunked": f"chunk {chunk}, recomputed per product",
            "vmcgrad-auto": f"product chunk {chunk}, kept_solve={qgt.kept_solve}",
        }
        rows.append(
            {
                "n": n,
                "n_params": n_params,
                "contender": k,
                "route": route.get(k, f"chunk {chunk}, recomputed per product"),
                "median_s": statistics.median(t),
                "ratio": statistics.median(t) / base,
                "times_s": t,
                "max_rel_diff": err,
                "kept_mib": kept_mib if k == "vmcgrad-auto" else None,
            }
        )
    return rows


def main(argv=None) -> None:
    args = parse(argv)
    import warnings

    import jax

    jax.config.update("jax_enable_x64", True)
    warnings.filterwarnings("ignore", category=UserWarning)
    from benchlib import write_json

    if args.chunk_scan:
        rows = chunk_scan(args.n[0], args)
        print(f"vmcgrad.QGT(...).solve, N = {args.n[0]}, cg {args.cg_iters} iterations, {jax.devices()[0]}")
        print(f"{'chunk':>6}  {'route':10}  {'compiled MiB':>12}  {'solve (s)':>9}")
        for r in rows:
            print(f"{r['chunk']:>6}  {r['route']:10}  {r['mib']:>12.1f}  {r['median_s']:>9.3f}")
        write_json({"args": vars(args), "rows": rows}, args.json)
        return
    rows = [row for n in args.n for row in run(n, args)]
    print(
        f"4x4 J1-J2 GCNN (P = {rows[0]['n_params']}), {args.budget_mib:g} MiB, "
        f"cg {args.cg_iters} iterations, device: {jax.devices()[0]}"
    )
    print(
        f"{'N':>5}  {'contender':18}  {'route':36}  {'SR phase (s)':>12}  {'vs NetKet':>9}  "
        f"{'kept MiB':>8}  {'max rel diff':>12}"
    )
    for r in rows:
        kept = "-" if r["kept_mib"] is None else f"{r['kept_mib']:.1f}"
        print(
            f"{r['n']:>5}  {r['contender']:18}  {r['route']:36}  {r['median_s']:>12.3f}  "
            f"{r['ratio']:>8.2f}x  {kept:>8}  {r['max_rel_diff']:>12.1e}"
        )
    write_json({"args": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
