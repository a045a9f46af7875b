"""VMC+SR step benchmark: vmcgrad.netket (MCState + QGTOnTheFly) vs NetKet at the same chunk size.

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_vmc_step.py                       # L=64, N=8192, chunk 256, 1 device
    python benchmarks/bench_vmc_step.py --devices 4 --repeats 5 --json rows.json
    python benchmarks/bench_vmc_step.py --memory-only --budget-mib 64

Times one step of ``nk.driver.VMC`` + ``nk.optimizer.SR`` (cg with a fixed number of iterations)
for RBMModPhase and a real 3-layer MLP, sampling excluded and included, interleaved; then the
compiled temp memory of a step's programs for growing N and the largest N under a budget.
Bar (issue 4): vmcgrad step time <= 0.7x NetKet's.
"""

from __future__ import annotations

import argparse

BAR = 0.7


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1, help="fake CPU device count")
    ap.add_argument("--L", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cg-iters", type=int, default=10, help="cg iterations per SR solve (tol=0)")
    ap.add_argument("--n-chains", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["rbm_modphase", "mlp"])
    ap.add_argument("--memory-sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--budget-mib", type=float, default=None, help="default: NetKet's step at N=8192")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args()


def main() -> None:
    args = parse()
    import warnings

    from benchlib import use_cpu_devices

    use_cpu_devices(args.devices)

    from benchlib import format_table, write_json
    from benchlib.vmc_step import memory_scan, run

    warnings.filterwarnings("ignore", category=UserWarning)
    result: dict = {"args": vars(args)}
    head = f"L={args.L}, N={args.n_samples}, chunk={args.chunk_size}, devices={args.devices}"
    if not args.memory_only:
        rows = run(
            models=tuple(args.models),
            L=args.L,
            n_samples=args.n_samples,
            chunk_size=args.chunk_size,
            cg_iters=args.cg_iters,
            n_chains=args.n_chains,
            repeats=args.repeats,
        )
        result["timing"] = [r.as_dict() for r in rows]
        print(f"\nVMC+SR step ({head}, cg {args.cg_iters} iterations, repeats={args.repeats})")
        print(format_table(rows, baseline="netket"))
        print(f"\nvmcgrad / netket step time (bar {BAR}):")
        by = {(r.setting["model"], r.setting["part"], r.name): r.median for r in rows}
        for model in args.models:
            for part in ("step_excl_sampling", "step_incl_sampling", "expect_and_grad", "sr_solve"):
                t = by[(model, part, "vmcgrad")] / by[(model, part, "netket")]
                bar = f"{'ok' if t <= BAR else 'MISS'}" if part.startswith("step") else ""
                print(f"  {model:<14} {part:<20} {t:.3f} {bar}")
    if not args.timing_only:
        print(f"\nCompiled temp memory of a step's programs per device (MiB), {args.models[0]}, {head}")
        print("(grad: local values + statistics + gradient; sr_solve: SR's solve with its QGT products)")
        mem = memory_scan(
            model_name=args.models[0],
            L=args.L,
            sizes=tuple(args.memory_sizes),
            chunk_size=args.chunk_size,
            budget_mib=None,
        )
        budget = args.budget_mib
        if budget is None:
            budget = next(r["step_mib"] for r in mem if r["impl"] == "netket" and r["N"] == args.n_samples)
        for key in ("step_mib", "grad_mib", "sr_solve_mib"):
            for impl in ("vmcgrad", "netket"):
                fit = [r["N"] for r in mem if r["impl"] == impl and r[key] <= budget * (1 + 1e-9)]
                largest = max(fit) if fit else "none tried"
                print(f"budget {budget:.2f} MiB, {key[:-4]:<8}: largest N for {impl:<8} {largest}")
        result["memory"] = mem
        result["budget_mib"] = budget
    write_json(result, args.json)


if __name__ == "__main__":
    main()
