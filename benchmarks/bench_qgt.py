"""QGT benchmark: vmcgrad.QGT (S @ v and a 50-iteration CG solve) vs NetKet's QGTOnTheFly, RBM real f64.

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_qgt.py --devices 1          # one process, one device count
    python benchmarks/bench_qgt.py --devices 1 4        # one subprocess per count, tables merged
    python benchmarks/bench_qgt.py --devices 1 --repeats 7 --json rows.json
    python benchmarks/bench_qgt.py --devices 1 --only equal-memory   # the issue 18 rows alone

The device count is fixed per process, so it is set here (``jax_num_cpu_devices`` and NetKet's
``NETKET_EXPERIMENTAL_SHARDING_CPU``) before JAX or NetKet is imported. Bars (issue 3): S @ v time
<= 0.8x NetKet (goal 0.6x); 50-iteration solve goal <= 0.5x; temp memory flat in N and <= NetKet's.

The ``*_eqmem`` rows (issue 18) compare at equal compiled memory: NetKet at ``--chunk-size`` against
``vmcgrad.QGT(chunk_size="auto", memory_budget=B)``, B NetKet's temp bytes plus vmcgrad's arguments
and outputs (``benchlib.qgt.equal_memory``); the picked design and chunk are in the row's name, next
to each design forced at its own largest fitting chunk. Bars: S @ v <= 0.75x, 50-iteration CG <= 0.6x.
"""

from __future__ import annotations

import argparse
import statistics

# bench -> (time bar, time goal, temp-memory bar) on vmcgrad/netket at the same chunk size (issue 13)
BARS = {
    "qgt_matvec": (0.75, 0.6, 1.1),
    "qgt_solve50": (0.6, 0.5, None),
    # at equal compiled memory (issue 18): time bars only, memory <= 1.0 by construction
    "qgt_matvec_eqmem": (0.75, 0.6, 1.0),
    "qgt_solve50_eqmem": (0.6, 0.5, None),
}
PARTS = ("same-chunk", "equal-memory", "memory")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1], help="fake CPU device count(s)")
    ap.add_argument("--L", type=int, default=48, help="spins (RBM with alpha=1)")
    ap.add_argument("--n-samples", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed calls per candidate")
    ap.add_argument("--memory-n", type=int, nargs="+", default=[8192, 32768], help="N for the memory rows")
    ap.add_argument(
        "--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default all)"
    )
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no tables (used for the per-count subprocesses)")
    return ap.parse_args()


def run_one(args: argparse.Namespace) -> list[dict]:
    (n,) = args.devices
    from benchlib import use_cpu_devices

    use_cpu_devices(n)

    from benchlib.qgt import equal_memory, run, temp_memory

    sizes = {"L": args.L, "n_samples": args.n_samples, "chunk_size": args.chunk_size, "repeats": args.repeats}
    rows = run(**sizes) if "same-chunk" in args.only else []
    if "equal-memory" in args.only:
        rows += equal_memory(**sizes)
    extra = {"L": args.L, "chunk": args.chunk_size}
    out = []
    for r in rows:
        cpu = r.cpu_times
        out.append({**r.as_dict(), **extra, "cpu_times_s": cpu, "cpu_median_s": statistics.median(cpu)})
    if "memory" not in args.only:
        return out
    for m in temp_memory(L=args.L, n_samples=tuple(args.memory_n), chunk_size=args.chunk_size):
        out.append({"bench": "qgt_memory", "devices": n, **m, **extra})
    return out


def ratios(rows: list[dict]) -> str:
    """vmcgrad / netket per bench (wall and CPU time, temp memory) with the bars, then the memory rows."""
    from benchlib import Column, table

    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["bench"] != "qgt_memory":
            groups.setdefault((r["devices"], r["bench"]), {})[r["name"]] = r
    lines = []
    for (devices, bench), g in groups.items():
        base = g["netket"]
        for name, me in g.items():
            if name == "netket":
                continue
            t = me["median_s"] / base["median_s"]
            bar, goal, mem_bar = BARS[bench]
            mem = me["temp_bytes"] / base["temp_bytes"]
            lines.append(
                {
                    "devices": devices,
                    "bench": bench,
                    "impl": name,
                    "time": t,
                    "cpu": me["cpu_median_s"] / base["cpu_median_s"],
                    "bar": bar,
                    "goal": goal,
                    "ok": "goal" if t <= goal else ("ok" if bar is None or t <= bar else "MISS"),
                    "mem": mem,
                    "mem_bar": mem_bar,
                    "mem_ok": "-" if mem_bar is None else ("ok" if mem <= mem_bar else "MISS"),
                }
            )
    fmt = {"time": ".3f", "cpu": ".3f", "bar": ".2f", "goal": ".2f", "mem": ".3f", "mem_bar": ".2f"}
    text = [
        table(lines, [Column(k, k, fmt.get(k, ""), "<" if k in ("bench", "impl") else ">") for k in lines[0]])
    ]
    mem = [r for r in rows if r["bench"] == "qgt_memory"]
    if mem:
        text.append("\ntemp memory of S @ v (compiled), MiB:")
        text.append(
            table(
                mem,
                [
                    Column("devices", "devices"),
                    Column("N", "N"),
                    Column("impl", "name", align="<"),
                    Column("MiB", lambda r: r["temp_bytes"] / 2**20, ".2f"),
                ],
            )
        )
    return "\n".join(text)


def main() -> None:
    args = parse()
    from benchlib import format_table, rows_for_device_counts, write_json

    argv = ["--L", str(args.L), "--n-samples", str(args.n_samples), "--chunk-size", str(args.chunk_size)]
    argv += ["--repeats", str(args.repeats), "--memory-n", *map(str, args.memory_n), "--only", *args.only]
    rows = rows_for_device_counts(__file__, args.devices, lambda: run_one(args), argv)

    write_json(rows, args.json)
    if args.quiet:
        return
    print(f"\nNetKet RBM(alpha=1, float64), L={args.L}, N={args.n_samples}, chunk={args.chunk_size}")
    print(
        format_table(
            [r for r in rows if r["bench"] != "qgt_memory"], baseline="netket", setting=("devices", "N")
        )
    )
    print()
    print("vmcgrad / netket (time: wall median per call; cpu: process CPU time median; mem: compiled temp")
    print("bytes per device; ok/goal/MISS judged on wall time)")
    print(ratios(rows))


if __name__ == "__main__":
    main()
