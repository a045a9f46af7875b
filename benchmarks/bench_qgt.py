"""QGT benchmark: vmcgrad.QGT (S @ v and a 50-iteration CG solve) vs NetKet's QGTOnTheFly, RBM real f64.

Usage::

    python benchmarks/bench_qgt.py --devices 1          # one process, one device count
    python benchmarks/bench_qgt.py --devices 1 4        # one subprocess per count, tables merged
    python benchmarks/bench_qgt.py --devices 1 --repeats 7 --json rows.json

The device count is fixed per process, so it is set here (``jax_num_cpu_devices`` and NetKet's
``NETKET_EXPERIMENTAL_SHARDING_CPU``) before JAX or NetKet is imported. Bars (issue 3): S @ v time
<= 0.8x NetKet (goal 0.6x); 50-iteration solve goal <= 0.5x; temp memory flat in N and <= NetKet's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

BARS = {"qgt_matvec": (0.8, 0.6), "qgt_solve50": (None, 0.5)}  # bench -> (bar, goal) on vmcgrad/netket


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1], help="fake CPU device count(s)")
    ap.add_argument("--L", type=int, default=48, help="spins (RBM with alpha=1)")
    ap.add_argument("--n-samples", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed calls per candidate")
    ap.add_argument("--memory-n", type=int, nargs="+", default=[8192, 32768], help="N for the memory rows")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no tables (used for the per-count subprocesses)")
    return ap.parse_args()


def run_one(args: argparse.Namespace) -> list[dict]:
    (n,) = args.devices
    import statistics

    from vmcgrad.bench import use_cpu_devices

    use_cpu_devices(n)

    from vmcgrad.bench.qgt import run, temp_memory

    cpu: dict = {}
    rows = run(
        L=args.L, n_samples=args.n_samples, chunk_size=args.chunk_size, repeats=args.repeats, cpu_times=cpu
    )
    extra = {"L": args.L, "chunk": args.chunk_size}
    out = []
    for r in rows:
        times = cpu.get((r.bench, n, r.name), [])
        out.append({**r.as_dict(), **extra, "cpu_times_s": times, "cpu_median_s": statistics.median(times)})
    for m in temp_memory(L=args.L, n_samples=tuple(args.memory_n), chunk_size=args.chunk_size):
        out.append({"bench": "qgt_memory", "devices": n, **m, **extra})
    return out


def run_many(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.devices:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--devices", str(n), "--json", f.name, "--L", str(args.L)]
            cmd += ["--n-samples", str(args.n_samples), "--chunk-size", str(args.chunk_size)]
            cmd += ["--repeats", str(args.repeats), "--memory-n", *map(str, args.memory_n), "--quiet"]
            subprocess.run(cmd, check=True)
            with open(f.name) as fh:
                rows += json.load(fh)
    return rows


def table(rows: list[dict]) -> str:
    from vmcgrad.bench import Row, format_table

    objs = [
        Row(
            r["bench"],
            {"devices": r["devices"], "N": r["N"]},
            r["name"],
            r["times_s"],
            r["temp_bytes"],
            r["collectives_in_loops"],
            r["collectives_outside"],
        )
        for r in rows
        if r["bench"] != "qgt_memory"
    ]
    return format_table(objs, baseline="netket")


def ratios(rows: list[dict]) -> str:
    lines = [
        f"{'devices':>7} {'bench':<13}{'impl':<15}{'time':>7}{'cpu':>7}{'bar':>6}{'goal':>6}{'':>6}{'mem':>7}"
    ]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["bench"] != "qgt_memory":
            groups.setdefault((r["devices"], r["bench"]), {})[r["name"]] = r
    for (devices, bench), g in groups.items():
        base = g["netket"]
        for name, me in g.items():
            if name == "netket":
                continue
            t = me["median_s"] / base["median_s"]
            c = me["cpu_median_s"] / base["cpu_median_s"]
            m = me["temp_bytes"] / base["temp_bytes"]
            bar, goal = BARS[bench]
            ok = "goal" if t <= goal else ("ok" if bar is None or t <= bar else "MISS")
            bar_s = f"{bar:>6.2f}" if bar else "-".rjust(6)
            lines.append(
                f"{devices:>7} {bench:<13}{name:<15}{t:>7.3f}{c:>7.3f}{bar_s}{goal:>6.2f}{ok:>6}{m:>7.3f}"
            )
    mem = [r for r in rows if r["bench"] == "qgt_memory"]
    if mem:
        lines.append("")
        lines.append("temp memory of S @ v (compiled), MiB:")
        for r in mem:
            lines.append(
                f"  devices={r['devices']} N={r['N']:<7} {r['name']:<9}{r['temp_bytes'] / 2**20:>9.2f}"
            )
    return "\n".join(lines)


def main() -> None:
    args = parse()
    rows = run_one(args) if len(args.devices) == 1 else run_many(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.quiet:
        return
    print(f"\nNetKet RBM(alpha=1, float64), L={args.L}, N={args.n_samples}, chunk={args.chunk_size}")
    print(table(rows))
    print()
    print("vmcgrad / netket (time: wall median per call; cpu: process CPU time median; mem: compiled temp")
    print("bytes per device; ok/goal/MISS judged on wall time)")
    print(ratios(rows))


if __name__ == "__main__":
    main()
