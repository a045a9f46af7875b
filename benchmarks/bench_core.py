"""Core benchmark: vmcgrad.batched_vjp vs nk.jax.vjp_chunked vs unchunked jax.vjp on NetKet's RBM.

Usage::

    python benchmarks/bench_core.py --devices 1          # one process, one device count
    python benchmarks/bench_core.py --devices 1 4        # one subprocess per count, tables merged
    python benchmarks/bench_core.py --devices 4 --repeats 5 --json rows.json

The device count is fixed per process, so it is set here (``jax_num_cpu_devices`` and NetKet's
``NETKET_EXPERIMENTAL_SHARDING_CPU``) before JAX or NetKet is imported. Bars (issue 2): time
<= 1.05x NetKet and <= 1.1x jax.vjp; temp memory <= NetKet's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

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
    lines = [
        f"{'devices':>7} {'dtype':<11}{'vs':<9}{'time':>7}{'bar':>6}{'':>6}{'mem':>7}{'bar':>6}{'':>6}"
        f"{'t(min)':>8}{'cpu':>7}{'':>6}{'mem diff B':>12}"
    ]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["devices"], r["dtype"]), {})[r["name"]] = r
    for (devices, dtype), g in groups.items():
        me = g["vmcgrad"]
        for base, (t_bar, m_bar) in BARS.items():
            t = me["median_s"] / g[base]["median_s"]
            m = me["temp_bytes"] / g[base]["temp_bytes"]
            t_ok = "ok" if t <= t_bar else "MISS"
            m_s, m_ok = (f"{m_bar:>6.2f}", "ok" if m <= m_bar else "MISS") if m_bar else ("-".rjust(6), "")
            t_min = min(me["times_s"]) / min(g[base]["times_s"])
            c = statistics.median(me["cpu_s"]) / statistics.median(g[base]["cpu_s"])
            lines.append(
                f"{devices:>7} {dtype:<11}{base:<9}{t:>7.3f}{t_bar:>6.2f}{t_ok:>6}{m:>7.3f}{m_s}{m_ok:>6}"
                f"{t_min:>8.3f}{c:>7.3f}{'ok' if c <= t_bar else 'MISS':>6}"
                f"{me['temp_bytes'] - g[base]['temp_bytes']:>+12d}"
            )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    from vmcgrad.bench import Row, format_table

    objs = []
    for r in rows:
        setting = {k: r[k] for k in ("devices", "dtype")}
        objs.append(
            Row(
                r["bench"],
                setting,
                r["name"],
                r["times_s"],
                r["temp_bytes"],
                r["collectives_in_loops"],
                r["collectives_outside"],
            )
        )
    return format_table(objs, baseline="netket")


def run_one(args: argparse.Namespace) -> list[dict]:
    (n,) = args.devices
    from vmcgrad.bench import use_cpu_devices

    use_cpu_devices(n)

    from vmcgrad.bench.core import run

    cpu: dict = {}
    rows = run(
        L=args.L,
        n_samples=args.n_samples,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
        param_dtypes=tuple(args.dtypes),
        cpu_times=cpu,
    )
    extra = {"L": args.L, "N": args.n_samples, "chunk": args.chunk_size}
    return [
        {**r.as_dict(), **extra, "cpu_s": cpu[(r.setting["devices"], r.setting["dtype"], r.name)]}
        for r in rows
    ]


def run_many(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.devices:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--devices", str(n), "--json", f.name, "--L", str(args.L)]
            cmd += ["--n-samples", str(args.n_samples), "--chunk-size", str(args.chunk_size)]
            cmd += ["--repeats", str(args.repeats), "--dtypes", *args.dtypes, "--quiet"]
            subprocess.run(cmd, check=True)
            with open(f.name) as fh:
                rows += json.load(fh)
    return rows


def main() -> None:
    args = parse()
    rows = run_one(args) if len(args.devices) == 1 else run_many(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.quiet:
        return
    r0 = rows[0]
    print(f"\nNetKet RBM(alpha=1), L={r0['L']}, N={r0['N']}, chunk={r0['chunk']}, repeats={args.repeats}")
    print(table(rows))
    print()
    print("vmcgrad / baseline (time: median per call; mem: compiled temp bytes per device;")
    print("t(min): fastest call / fastest call; cpu: median process CPU time per call, against the time bar;")
    print("mem diff B: vmcgrad's temp bytes minus the baseline's)")
    print(ratios(rows))


if __name__ == "__main__":
    main()
