"""Each route of ``vmcgrad.minsr_update`` on the 1-D GCNN of issue 48 at a memory budget: whether its
compiled update fits (``chunk_size="auto"``), its bytes, its time and CG's iterations; and the route
the rule takes, priced for the CPU and for the TPU (``vmcgrad.cost_platform``): each fitting route's
modelled time (``vmcgrad.program_cost`` of its compiled program, CG at its expected iterations).

The model: NetKet's GCNN on ``Chain(20)``, 3 layers of 8 features, complex parameters (5 304), the
Heisenberg chain, N = 512 samples at the initial parameters. Figures: docs/performance.md ("The route
chosen by compiled bytes and modelled cost").

    python benchmarks/minsr_route_probe.py --budget-mib 8 --diag-shift 1e-3
"""

from __future__ import annotations

import argparse
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
    for route in () if args.rule_only else ("dense", "parameter", "cg"):
        kw = dict(diag_shift=args.diag_shift, route=route, chunk_size="auto", memory_budget=budget)
        update = jax.jit(lambda w, x, e, kw=kw: vmcgrad.minsr_update(lp, w, x, e, **kw))
        try:
            compiled = update.lower(vs.parameters, x, e).compile()
        except MemoryError as err:
            print(f"{route}: does not fit ({str(err).split(';')[1].strip()})")
            continue
        jax.block_until_ready(compiled(vs.parameters, x, e))
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(vs.parameters, x, e))
        seconds = time.perf_counter() - start
        info = out[2]
        iterations = int(info.iterations) if isinstance(info, vmcgrad.CGInfo) else "-"
        mib = vmcgrad.program_bytes(compiled) / 2**20
        print(f"{route}: {mib:.2f} MiB, {seconds:.3f} s per update, CG iterations {iterations}")


if __name__ == "__main__":
    main()
