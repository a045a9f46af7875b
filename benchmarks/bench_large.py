"""Large models at a memory budget: GCNN and ViT on a 6x6 lattice, vmcgrad vs NetKet chunked vs VMC_SR.

Usage (from a checkout, with vmcgrad installed: ``pip install -e .``, or ``PYTHONPATH=.``)::

    python benchmarks/bench_large.py                                  # everything (compile-heavy)
    python benchmarks/bench_large.py --models gcnn --dtypes float64 --json large.json
    python benchmarks/bench_large.py --size small --sizes 256 1024 --budgets-mib 16 64 --time-n 256

Memory: compiled (not run) per-device temp and total bytes against N for expect_grad, QGT @ v and one
SR step; the largest N per device under each budget (bisection over compiled programs); the SR step
time at equal memory, interleaved (see :mod:`benchlib.large`). ``python benchmarks/run.py --suite large``
runs this script with its defaults.
"""

from __future__ import annotations

import argparse
import sys

#: benchlib.large.IMPLS (not imported here: the device count must be set before JAX starts)
IMPLS = ("vmcgrad", "vmcgrad auto", "netket chunked", "VMC_SR dense", "VMC_SR ntk")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1, help="fake CPU devices (memory is per device)")
    ap.add_argument("--models", nargs="+", default=["gcnn", "vit"], choices=["gcnn", "vit"])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    ap.add_argument("--size", default="large", choices=["large", "small"], help="model size (small: 4x4)")
    ap.add_argument(
        "--sizes", type=int, nargs="+", default=[2**12, 2**14, 2**16], help="N of the memory table"
    )
    ap.add_argument("--budgets-mib", type=float, nargs="*", default=[256, 1024], help="budgets (none: skip)")
    ap.add_argument("--n-max", type=int, default=2**24, help="largest N the budget search tries")
    ap.add_argument("--chunk", type=int, default=64, help="fixed chunk of vmcgrad, NetKet and VMC_SR")
    ap.add_argument("--cg-iters", type=int, default=10, help="CG iterations of the on-the-fly SR steps")
    ap.add_argument("--time-n", type=int, default=256, help="N of the timed SR steps (0: no timing)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed calls per candidate")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here (after every stage)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from benchlib import use_cpu_devices

    use_cpu_devices(args.devices)
    import jax
    from benchlib import large, write_json

    st = large.Settings(chunk=args.chunk, cg_iters=args.cg_iters)
    config = {k: v for k, v in vars(args).items()}
    config["platform"] = jax.devices()[0].platform
    config["device"] = str(jax.devices()[0].device_kind)

    def save(result):
        write_json({"config": config, **result}, args.json)

    result = large.run_suite(
        models=tuple(args.models),
        dtypes=tuple(args.dtypes),
        size=args.size,
        sizes=tuple(args.sizes),
        budgets=tuple(int(b * 2**20) for b in args.budgets_mib),
        time_n=args.time_n,
        repeats=args.repeats,
        st=st,
        n_max=args.n_max,
        impls=tuple(args.impls),
        on_result=save,
    )
    save(result)
    print(f"\n{jax.device_count()} {config['platform']} device(s) ({config['device']}); chunk {st.chunk}")
    print(large.report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
