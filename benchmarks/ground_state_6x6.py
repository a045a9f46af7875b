"""The 6×6 periodic Heisenberg model with ``vmcgrad vmc``: the relative error reached and the wall time.

Not part of CI. Runs ``vmcgrad vmc --system heisenberg2d --L 6`` in a subprocess (a symmetric ansatz,
SR with :class:`vmcgrad.netket.QGTOnTheFly`), stops it after ``--minutes`` of wall time with SIGINT (the
command finishes the step in progress and keeps its log), then prints the energy reached against the
exact-diagonalisation value of the literature, :math:`E_0/N = -0.678872` in S·S units
(:math:`-97.757568` in NetKet's Pauli units), and writes ``OUT/result.json``.

Example (the figures in docs/performance.md)::

    nice -n 10 python benchmarks/ground_state_6x6.py --minutes 30 --out ground-state-6x6
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchlib import write_json

ROOT = Path(__file__).resolve().parents[1]
E0 = 4 * 36 * -0.678872  # NetKet (Pauli) units, 6×6 periodic square lattice
GOAL = 2e-3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="rbm-symm", choices=("rbm-symm", "gcnn"))
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--chunk-size", default="512")
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--diag-shift", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time limit of the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="ground-state-6x6")
    args = ap.parse_args(argv)

    out = Path(args.out)
    command = [
        sys.executable, "-m", "vmcgrad", "vmc", "--system", "heisenberg2d", "--L", "6",
        "--model", args.model, "--samples", str(args.samples), "--chunk-size", args.chunk_size,
        "--lr", str(args.lr), "--diag-shift", str(args.diag_shift), "--steps", str(args.steps),
        "--seed", str(args.seed), "--out", str(out / "run"),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    print(" ".join(command[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env)
    try:
        proc.wait(timeout=60 * args.minutes)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # stop after the step in progress; the log is kept
        proc.wait()
    wall = time.perf_counter() - t0

    log = json.loads((out / "run" / "log.json").read_text())
    energies = log["energy_mean"]
    n = len(energies)
    final = log["final_energy"]  # mean of the last tenth of the steps
    rel = abs(final - E0) / abs(E0)
    result = {
        "command": " ".join(command[1:]),
        "model": args.model,
        "n_parameters": log["info"]["n_parameters"],
        "steps": n,
        "status": log["status"],
        "wall_s": wall,
        "step_time_median_s": sorted(log["step_time"])[n // 2] if n else None,
        "final_energy": final,
        "exact_energy": E0,
        "relative_error": rel,
        "goal": GOAL,
        "reached": rel <= GOAL,
    }
    write_json(result, out / "result.json")
    print(
        f"6×6 Heisenberg, {args.model} ({result['n_parameters']} parameters): "
        f"{n} steps in {wall / 60:.1f} min, "
        f"final energy {final:.5f} (last tenth), exact {E0:.6f}, relative error {rel:.2e} "
        f"(goal {GOAL:.0e}: {'reached' if result['reached'] else 'not reached'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
