"""The bisect's probe: one fresh process per commit given, its first step's CPU seconds.

``python probe_first.py COMMIT,COMMIT,... RUN,RUN`` (run from anywhere): each commit's checkout (the
worktrees this check made: /work/h2-old for 4f9f422, this checkout for HEAD, /tmp/h2-bisect-COMMIT
else) runs ``step_regime.py --steps 1 --runs RUN ...`` through ``cpu_regression.run_one`` (the step
case's child, CPU seconds per step), one JSON line each in ``runs.jsonl`` beside this file, ``side``
the commit as given.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, "/work/h2/benchmarks")
import cpu_regression as cr

TREES = {"4f9f422": Path("/work/h2-old"), "HEAD": Path("/work/h2")}

commits, runs = sys.argv[1].split(","), sys.argv[2].split(",")
out = Path(__file__).resolve().parent
args = argparse.Namespace(step_runs=runs, steps=1, budget_mib=64.0, timeout=1200.0, argv=["(probe_first.py)"])
for c in commits:
    tree = TREES.get(c, Path(f"/tmp/h2-bisect-{c}"))
    line = cr.run_one("step-f64", c, tree, cr.git("rev-parse", "HEAD", cwd=tree), 0, args, out)
    first = [(r["metric"], round(r["s"], 2)) for r in line["rows"] if "first" in r["metric"]]
    print(c, line["rc"], round(line["wall_s"]), first, flush=True)
