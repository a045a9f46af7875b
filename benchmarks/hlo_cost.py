r"""What saved programs cost: :func:`vmcgrad.program_cost` of optimized HLO texts, one line each.

Each line also gives the program's outermost loops as ``trips×ops per trip`` (``?`` where the
program does not state the trip count). For programs compiled elsewhere (on a device:
``benchmarks/accelerator_cost.py --hlo-dir``), so that they can be costed again here when the model
changes, without the device. With ``--measured``, the milliseconds each program took (in the files'
order) and the modelled time over the measured.

Usage::

    python benchmarks/hlo_cost.py a.hlo.txt b.hlo.txt --platform tpu --measured 157.0 19.9
"""

from __future__ import annotations

import argparse
from pathlib import Path

import vmcgrad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", nargs="+", help="optimized HLO text files (compiled.as_text())")
    ap.add_argument("--platform", default="tpu", help="the constants to model with (cpu, gpu, tpu)")
    ap.add_argument("--measured", nargs="+", type=float, metavar="MS", help="each program's measured ms")
    args = ap.parse_args(argv)
    if args.measured and len(args.measured) != len(args.hlo):
        ap.error(f"--measured: {len(args.measured)} times given for {len(args.hlo)} files; give one per file")
    print(
        "| program | ops | loops | GFLOP | GB | modelled ms |"
        + (" measured ms | modelled / measured |" * bool(args.measured))
    )
    print("|---|---|---|---|---|---|" + "---|---|" * bool(args.measured))
    for k, path in enumerate(args.hlo):
        c = vmcgrad.program_cost(Path(path).read_text(), platform=args.platform)
        ms = 1e3 * c.time(args.platform)
        unknown = "†" if c.unknown_trip_loops else ""
        loops = ", ".join(f"{lp.trip_count or '?'}×{lp.ops_per_trip:,.0f}" for lp in c.loops)
        line = f"| {Path(path).name} | {c.ops:,.0f}{unknown} | {loops} | {c.flops / 1e9:.1f} "
        line += f"| {c.bytes / 1e9:.2f} "
        line += f"| {ms:.1f} |"
        if args.measured:
            line += f" {args.measured[k]:.1f} | {ms / args.measured[k]:.2f} |"
        print(line)


if __name__ == "__main__":
    main()
