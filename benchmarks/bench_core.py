"""Core benchmark: vmcgrad.batched_vjp vs nk.jax.vjp_chunked vs unchunked jax.vjp on NetKet's RBM.

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_core.py --devices 1          # one process, one device count
    python benchmarks/bench_core.py --devices 1 4        # one subprocess per count, tables merged
    python benchmarks/bench_core.py --devices 4 --repeats 5 --json rows.json

The device count is fixed per process, so it is set here (``jax_num_cpu_devices`` and NetKet's
``NETKET_EXPERIMENTAL_SHARDING_CPU``) before JAX or NetKet is imported. Bars (issue 2): time
<= 1.05x NetKet and <= 1.1x jax.vjp; temp memory <= NetKet's.
"""

from __future__ import annotations

import argparse
import statistics
import sys

BARS = {"netket": (1.05, 1.0), "jax.vjp": (1.1, None)}  # baseline -> (time bar, memory bar)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1], help="fake CPU device count(s)")
    ap.add_argument("--L", type=int, default=64, help="spins (RBM with alpha=1)")
    ap.add_argument("--n-samples", type=int, default=16384)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed calls per candidate")
    ap.add_argument("--dtypes", nargs="+", default=["float64", "complex128"], help="RBM param_dtype(s)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no tables (used for the per-count subprocesses)")
    return ap.parse_args()


def ratios(rows: list[dict]) -> str:
    """vmcgrad / baseline for time (medians; also fastest calls) and temp memory, with the bars."""
    from benchlib import Column, table

    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["devices"], r["dtype"]), {})[r["name"]] = r
    lines = []
    for (devices, dtype), g in groups.items():
        me = g["vmcgrad"]
        for base, (t_bar, m_bar) in BARS.items():
            t = me["median_s"] / g[base]["median_s"]
            m = me["temp_bytes"] / g[base]["temp_bytes"]
            c = statistics.median(me["cpu_s"]) / statistics.median(g[base]["cpu_s"])
            lines.append(
                {
                    "devices": devices,
                    "dtype": dtype,
                    "vs": base,
                    "time": t,
                    "bar": t_bar,
                    "ok": "ok" if t <= t_bar else "MISS",
                    "mem": m,
                    "mem bar": m_bar,
                    "mem ok": None if m_bar is None else ("ok" if m <= m_bar else "MISS"),
                    "t(min)": min(me["times_s"]) / min(g[base]["times_s"]),
                    "cpu": c,
                    "cpu ok": "ok" if c <= t_bar else "MISS",
                    "mem diff B": me["temp_bytes"] - g[base]["temp_bytes"],
                }
            )
    number = {"time": ".3f", "bar": ".2f", "mem": ".3f", "mem bar": ".2f", "t(min)": ".3f", "cpu": ".3f"}
    text = {"dtype", "vs"}
    columns = [
        Column(k, k, number.get(k, "+d" if k == "mem diff B" else ""), "<" if k in text else ">")
        for k in lines[0]
    ]
    return table(lines, columns)


def run_one(args: argparse.Namespace) -> list[dict]:
    (n,) = args.devices
    from benchlib import use_cpu_devices

    use_cpu_devices(n)

    from benchlib.core import run

    rows = run(
        L=args.L,
        n_samples=args.n_samples,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
        param_dtypes=tuple(args.dtypes),
    )
    extra = {"L": args.L, "N": args.n_samples, "chunk": args.chunk_size}
    return [{**r.as_dict(), **extra} for r in rows]


def main() -> None:
    args = parse()
    from benchlib import format_table, rows_for_device_counts, write_json

    argv = ["--L", str(args.L), "--n-samples", str(args.n_samples), "--chunk-size", str(args.chunk_size)]
    argv += ["--repeats", str(args.repeats), "--dtypes", *args.dtypes]
    rows = rows_for_device_counts(__file__, args.devices, lambda: run_one(args), argv)

    write_json(rows, args.json)
    if args.quiet:
        return
    r0 = rows[0]
    print(f"\nNetKet RBM(alpha=1), L={r0['L']}, N={r0['N']}, chunk={r0['chunk']}, repeats={args.repeats}")
    print(format_table(rows, baseline="netket", setting=("devices", "dtype")))
    print()
    print("vmcgrad / baseline (time: median per call; mem: compiled temp bytes per device;")
    print("t(min): fastest call / fastest call; cpu: median process CPU time per call, against the time bar;")
    print("mem diff B: vmcgrad's temp bytes minus the baseline's)")
    print(ratios(rows))


if __name__ == "__main__":
    sys.exit(main())
