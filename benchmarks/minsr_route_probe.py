"""Each route of ``vmcgrad.minsr_update`` on the 1-D GCNN of issue 48 at a memory budget: whether its
compiled update fits (``chunk_size="auto"``), its bytes, its time and CG's iterations; and the route
the rule takes, priced for the CPU and for the TPU (``vmcgrad.cost_platform``): each fitting route's
modelled time (``vmcgrad.program_cost`` of its compiled program, CG at its expected iterations).

The model: NetKet's GCNN on ``Chain(20)``, 3 layers of 8 features, complex parameters (5 304), the
Heisenberg chain, N = 512 samples at the initial parameters. Figures: docs/performance.md ("The route
chosen by compiled bytes and modelled cost").

    python benchmarks/minsr_route_probe.py --budget-mib 8 --diag-shift 1e-3
    python benchmarks/minsr_route_probe.py --budget-mib 8 --routes cg --ranks auto 19 64 --chunk 64

``--routes`` limits the routes tried; ``--ranks`` gives the ``"cg"`` route's ``nystrom_rank`` (``auto``:
the budget's; 0: plain CG), each printed with its block and passes (``nystrom.nystrom_block``), and
also timed stopped after one CG iteration (``maxiter=1``: the preconditioner's build and one
iteration); ``--chunk`` an integer chunk instead of ``"auto"``; ``--tol`` CG's tolerance (default
1e-10). Every program is compiled first, then all are timed in turns, ``--repeats`` rounds (median and
least).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=8.0)
    parser.add_argument("--diag-shift", type=float, default=1e-3)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument(
        "--platforms",
        nargs="+",
        default=["cpu", "tpu"],
        help="the platforms to price the rule's choice for; one per process gives each its own programs "
        "(jax.jit's trace cache keeps a program traced for the first: its Jacobian batch)",
    )
    parser.add_argument("--rule-only", action="store_true", help="print the rule's choice; time no route")
    parser.add_argument("--routes", nargs="+", default=["dense", "parameter", "cg"])
    parser.add_argument("--ranks", nargs="+", default=["auto"])
    parser.add_argument("--chunk", default="auto")
    parser.add_argument("--tol", type=float, default=1e-10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    import netket as nk

    import vmcgrad
    import vmcgrad.netket as vnk
    from vmcgrad._sr.ntk import minsr

    g = nk.graph.Chain(20, pbc=True)
    hi = nk.hilbert.Spin(0.5, N=20, total_sz=0)
    model = nk.models.GCNN(symmetries=g, layers=3, features=8, param_dtype=complex)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=16)
    vs = vnk.MCState(sampler, model, n_samples=args.n, seed=0, sampler_seed=1)
    e = vs.local_estimators(nk.operator.Heisenberg(hi, g)).reshape(-1)
    x = vs.samples.reshape(-1, 20)
    lp = jax.tree_util.Partial(lambda ms, w, x: model.apply({"params": w, **ms}, x), vs.model_state)
    budget = int(args.budget_mib * 2**20)
    print(f"{vs.n_parameters} parameters, N = {args.n}, budget {args.budget_mib} MiB")
    for platform in args.platforms:
        with vmcgrad.cost_platform(platform):
            kw = dict(diag_shift=args.diag_shift, chunk_size="auto", memory_budget=budget)
            choice = minsr.update_choice(lp, vs.parameters, x, e, **kw)
        each = ", ".join(f"{r} {t:.3g} s" for r, t in choice.priced)
        route, chunk = choice.value
        print(f"rule, priced for {platform}: {route} at chunk {chunk} ({each}; {choice.ops:g} ops)")
    chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
    routes = [] if args.rule_only else args.routes
    runs = [(r, None) for r in routes if r != "cg"]
    runs += [("cg", rank if rank == "auto" else int(rank) or None) for rank in args.ranks if "cg" in routes]
    compiled = {}
    for route, rank in runs:
        kw = dict(diag_shift=args.diag_shift, route=route, chunk_size=chunk, memory_budget=budget)
        label = route
        if route == "cg":
            kw.update(nystrom_rank=rank, tol=args.tol)
            label = f"cg, rank {_plan(vs, args.n, budget, rank)}"
        try:
            compiled[label] = [_compiled(lp, vs.parameters, x, e, kw), []]
            if route == "cg":  # the build and one iteration
                compiled[label + " (maxiter=1)"] = [
                    _compiled(lp, vs.parameters, x, e, dict(kw, maxiter=1)),
                    [],
                ]
        except MemoryError as err:
            print(f"{label}: does not fit ({str(err).split(';')[1].strip()})")
    for _ in range(args.repeats):  # in turns, so that a change of the machine's load is shared
        for c, times in compiled.values():
            start = time.perf_counter()
            jax.block_until_ready(c(vs.parameters, x, e))
            times.append(time.perf_counter() - start)
    for label, (c, times) in compiled.items():
        info = c(vs.parameters, x, e)[2]
        iterations = int(info.iterations) if isinstance(info, vmcgrad.CGInfo) else "-"
        mib = vmcgrad.program_bytes(c) / 2**20
        print(
            f"{label}: {mib:.2f} MiB, median {statistics.median(times):.3f} s per update (least "
            f"{min(times):.3f}), CG iterations {iterations}"
        )


def _plan(vs, n, budget, rank):
    """``r (block b, m passes)`` of the cg route at ``budget`` ('complex' mode, K = 2)."""
    from vmcgrad._sr.ntk import nystrom, routes

    _, p, itemsize = routes.system_sizes("complex", n, vs.parameters)
    r = nystrom.nystrom_rank(n, 2, p, itemsize, budget) if rank == "auto" else rank or 0
    block = nystrom.nystrom_block(n, 2, p, itemsize, budget, r)
    return f"{r} (block {block}, {nystrom.Plan(r, block).passes} passes)"


def _compiled(lp, params, x, e, kw):
    """The update compiled, run once."""
    import jax

    import vmcgrad

    update = jax.jit(lambda w, x, e: vmcgrad.minsr_update(lp, w, x, e, **kw))
    compiled = update.lower(params, x, e).compile()
    jax.block_until_ready(compiled(params, x, e))
    return compiled


if __name__ == "__main__":
    main()
