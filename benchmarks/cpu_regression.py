r"""Old against new on this CPU: the same benchmark commands, interleaved, in fresh processes.

A non-regression check between two commits: for each case (a benchmark command, below), the command
runs in a fresh Python process once on each side per pair, the pairs in ABBA order (old, new; new,
old; ...) so that a machine growing busier or quieter weighs on both sides alike. Each side runs its
own checkout's script (``PYTHONPATH`` and working directory its own tree), so the measured program is
the same user-facing call on both sides, as each commit's vmcgrad serves it. The old side is a git
worktree of ``--old REV``, made on first use (``--old-dir``, by default next to this checkout); the
new side is this checkout's working tree (or ``--new REV``, another worktree).

Cases (``--cases``):

- ``kernels``: ``benchmarks/run.py`` (the suite: ``batched_vjp``, the VMC gradient, the QGT product
  and 50-iteration solve; its VMC + SR step too where ``--suite-args`` adds ``vmc_step`` to
  ``--only``) at ``--suite-args``; per benchmark, setting and candidate, the median wall time and the
  median process CPU time over the suite's interleaved repeats (metric ``... cpu``);
- ``step-f64``, ``step-f32``: ``benchmarks/step_regime.py`` (the race's driver step, the J1-J2 GCNN of
  ``time_to_energy.py``) for ``--step-runs`` at ``--budget-mib``: per run the first step (compilation
  included), the median of the ``--steps`` steps after it and its phases (sampling, local energies,
  SR), in wall seconds, and the first and median step in process CPU seconds (``..._cpu_s``:
  :data:`STEP_CHILD`).

Every process appends one JSON line to ``OUT/runs.jsonl`` (case, side, commit, pair, the load
average before and after, the wall time, the exit status, the rows it measured), so a stopped check
keeps the processes that finished; ``OUT/table.md`` is written from all the lines at the end (or with
``--table-only``): per metric, each side's median of the processes with their min-max, the ratio
new/old of the medians, and, for the step cases, each side's vmcgrad/NetKet ratio in the same runs.
A ratio above ``1 + --threshold`` is flagged ``SLOWER`` (re-run the case before calling it a
regression: the flag says only that this run's medians differ by more).

Usage (from a checkout, no PYTHONPATH needed: each side gets its own)::

    python benchmarks/cpu_regression.py --old 4f9f422 --pairs 3 --cases step-f64 kernels \
        --out benchmarks/results/cpu-non-regression-47
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: ``run.py``'s arguments by default: its four benchmarks at one setting (a few minutes a process on a
#: shared 2-core machine; the suite's defaults, two N and two chunks, take 8 minutes or more).
SUITE_ARGS = "--only core grad qgt --L 32 --samples 1024 --chunk-sizes 128 --repeats 3 --devices 2"

#: The race's driver step at N = 256: NetKet's VMC_SR (the yardstick) and vmcgrad's at chunk 64 and
#: at the automatic chunk within the budget.
STEP_RUNS = ("netket-vmcsr=256:64", "vmcgrad-vmcsr=256:64", "vmcgrad-vmcsr=256:auto")

CASES = ("kernels", "step-f64", "step-f32")

#: A step case's process: the side's own ``step_regime.py``, with each timed step's process CPU time
#: (all threads: ``time.process_time``) recorded beside its wall time, in the JSON list at
#: ``$CPU_REGRESSION_CPU`` (rewritten after every step). On a machine shared with other users' compiles
#: the wall time of a step swings with their load; the CPU time it takes swings much less. The timed
#: program is untouched: ``time_to_energy.timed_step`` (the same on both sides) is wrapped, not changed.
STEP_CHILD = """
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import step_regime
import time_to_energy as tte
real, cpu = tte.timed_step, []
def timed_step(*a, **k):
    c = time.process_time()
    out = real(*a, **k)
    cpu.append(time.process_time() - c)
    with open(os.environ["CPU_REGRESSION_CPU"], "w") as f:
        json.dump(cpu, f)
    return out
tte.timed_step = timed_step
step_regime.main(sys.argv[1:])
"""


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, metavar="REV", help="the commit before (made a worktree)")
    ap.add_argument("--old-dir", default=None, help="its worktree (default: <checkout>-old-<REV>)")
    ap.add_argument("--new", default=None, metavar="REV", help="a commit after (default: this tree)")
    ap.add_argument("--new-dir", default=None, help="its worktree (default: <checkout>-new-<REV>)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=["step-f64", "kernels"])
    ap.add_argument("--pairs", type=int, default=3, help="processes per side and case (medians over them)")
    ap.add_argument("--suite-args", default=SUITE_ARGS, help="benchmarks/run.py's arguments (kernels)")
    ap.add_argument("--step-runs", nargs="+", default=list(STEP_RUNS), metavar="NAME=N:CHUNK")
    ap.add_argument("--steps", type=int, default=3, help="step_regime.py --steps: steps after the first")
    ap.add_argument("--budget-mib", type=float, default=64.0)
    ap.add_argument("--threshold", type=float, default=0.05, help="new/old above 1 + this is flagged")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--out", default="cpu-regression", help="the folder of runs.jsonl and table.md")
    ap.add_argument("--table-only", action="store_true", help="table.md from OUT/runs.jsonl, run nothing")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (for the table's command line)
    if args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: expected at least 1")
    return args


def git(*a: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def worktree(rev: str, path: str | None, tag: str) -> tuple[Path, str]:
    """A detached worktree of ``rev`` at ``path`` (made when missing; one at another commit is an
    error rather than moved); returns it and its full commit."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    where = Path(path) if path else ROOT.parent / f"{ROOT.name}-{tag}-{commit[:7]}"
    if not where.exists():
        git("worktree", "add", "--detach", str(where), commit)
    have = git("rev-parse", "HEAD", cwd=where)
    if have != commit:
        raise SystemExit(f"{where} is at {have[:7]}, not {rev} ({commit[:7]}); give another --{tag}-dir")
    return where, commit


def order(pair: int) -> tuple[str, str]:
    """The sides of pair ``pair`` in the order they run: ABBA (old, new; new, old; ...), so that a
    load rising or falling through the check slows both sides alike.

    Examples:
        >>> [order(p) for p in range(3)]
        [('old', 'new'), ('new', 'old'), ('old', 'new')]
    """
    return ("old", "new") if pair % 2 == 0 else ("new", "old")


def command(case: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    if case == "kernels":
        return ["benchmarks/run.py", *args.suite_args.split(), "--out", str(tmp)]
    dtype = {"step-f64": "float64", "step-f32": "float32"}[case]
    return [
        "-c",
        STEP_CHILD,
        *("--dtype", dtype, "--budget-mib", str(args.budget_mib), "--steps", str(args.steps)),
        *("--runs", *args.step_runs, "--json", str(tmp / "rows.jsonl")),
    ]


def metrics(case: str, tmp: Path, steps_per_run: int) -> list[dict]:
    """The rows one process measured: ``{"metric": key, "s": seconds, ...}``; wall seconds, and
    process CPU seconds where the key says ``cpu``."""
    rows = []
    if case == "kernels":
        path = tmp / "bench.json"
        if not path.exists():
            return rows
        for r in json.loads(path.read_text())["rows"]:
            setting = ",".join(
                f"{k}={v}"
                for k, v in r.items()
                if k not in {"bench", "name", "median_s", "times_s", "cpu_s", "temp_bytes", "devices", "L"}
                and not k.startswith("collectives")
            )
            rows.append({"metric": f"{r['bench']} [{setting}] {r['name']}", "s": r["median_s"]})
            if r.get("cpu_s"):  # the process CPU time of each timed call
                rows.append(
                    {
                        "metric": f"{r['bench']} [{setting}] {r['name']} cpu",
                        "s": statistics.median(r["cpu_s"]),
                    }
                )
        return rows
    path, cpu_path = tmp / "rows.jsonl", tmp / "cpu.json"
    if not path.exists():
        return rows
    cpu = json.loads(cpu_path.read_text()) if cpu_path.exists() else []
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line)
        for key in ("median_step_s", "first_step_s", "median_sample_s", "median_local_s", "median_sr_s"):
            if key in r:
                rows.append({"metric": f"{r['run']} {key}", "s": r[key], "chunk": r.get("chunk_size_bwd")})
        steps = cpu[i * (1 + steps_per_run) : (i + 1) * (1 + steps_per_run)]
        if len(steps) == 1 + steps_per_run:  # the run's first step, then the timed ones
            rows.append({"metric": f"{r['run']} first_step_cpu_s", "s": steps[0]})
            rows.append({"metric": f"{r['run']} median_step_cpu_s", "s": statistics.median(steps[1:])})
    return rows


def run_one(case: str, side: str, tree: Path, commit: str, pair: int, args, out: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"cpu-regression-{side}-") as tmp:
        argv = [sys.executable, *command(case, args, Path(tmp))]
        env = dict(os.environ, PYTHONPATH=str(tree), CPU_REGRESSION_CPU=str(Path(tmp) / "cpu.json"))
        load0, t0 = os.getloadavg(), time.perf_counter()
        try:
            p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-2000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stdout or "")[-2000:]
        line = {
            "case": case,
            "side": side,
            "commit": commit,
            "pair": pair,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_before": load0,
            "load_after": os.getloadavg(),
            "wall_s": time.perf_counter() - t0,
            "rc": rc,
            "command": " ".join(argv[1:]),
            "check": f"python benchmarks/cpu_regression.py {shlex.join(args.argv)}",
            "rows": metrics(case, Path(tmp), args.steps),
        }
        if rc != 0:
            line["output_tail"] = tail
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def summary(lines: list[dict], threshold: float) -> list[dict]:
    """Per case and metric: each side's values (one per process), median and min-max, new/old."""
    values: dict[tuple, dict[str, list[float]]] = {}
    for ln in lines:
        for r in ln["rows"]:
            values.setdefault((ln["case"], r["metric"]), {"old": [], "new": []})[ln["side"]].append(r["s"])
    out = []
    for (case, metric), v in values.items():
        if not (v["old"] and v["new"]):
            continue
        old, new = statistics.median(v["old"]), statistics.median(v["new"])
        out.append(
            {
                "case": case,
                "metric": metric,
                "old": old,
                "new": new,
                "old_range": (min(v["old"]), max(v["old"])),
                "new_range": (min(v["new"]), max(v["new"])),
                "n": (len(v["old"]), len(v["new"])),
                "ratio": new / old,
                "slower": new / old > 1 + threshold,
            }
        )
    return out


def netket_ratios(entries: list[dict]) -> dict[tuple, float]:
    """(case, metric, side) -> a vmcgrad metric's median over NetKet's same metric, on the same side
    (NetKet's code is the same on both sides: its ratio takes out most of what the machine's load
    did to a side). A step metric ``RUN KEY`` is paired with ``netket-...``'s ``KEY``; a kernel
    metric ``BENCH [SETTING] NAME[ cpu]`` with ``BENCH [SETTING] netket[ cpu]``."""
    by_metric = {(e["case"], e["metric"]): e for e in entries}
    base = {}
    for e in entries:
        run, _, key = e["metric"].partition(" ")
        if run.startswith("netket") and e["case"] != "kernels":
            base[e["case"], key] = e
    out = {}
    for e in entries:
        if e["case"] == "kernels":
            head, _, name = e["metric"].partition("] ")
            cpu = " cpu" if name.endswith(" cpu") else ""
            b, ours = by_metric.get((e["case"], f"{head}] netket{cpu}")), name.startswith("vmcgrad")
        else:
            run, _, key = e["metric"].partition(" ")
            b, ours = base.get((e["case"], key)), run.startswith("vmcgrad")
        if ours and b:
            for side in ("old", "new"):
                out[e["case"], e["metric"], side] = e[side] / b[side]
    return out


def report(lines: list[dict], args) -> str:
    entries = summary(lines, args.threshold)
    nk = netket_ratios(entries)
    commits = {ln["side"]: ln["commit"][:7] for ln in lines}
    loads = [ln["load_before"][0] for ln in lines] + [ln["load_after"][0] for ln in lines]
    failed = [f"{ln['case']} {ln['side']} pair {ln['pair']}: rc {ln['rc']}" for ln in lines if ln["rc"] != 0]
    dates = sorted(ln["date"] for ln in lines)
    head = [
        f"# CPU non-regression: {commits.get('old')} (old) against {commits.get('new')} (new)",
        "",
        *(f"- command: `{c}`" for c in dict.fromkeys(ln["check"] for ln in lines if "check" in ln)),
        f"- dates: {dates[0]} to {dates[-1]}" if dates else "- dates: none",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; 1-minute load average around the "
        f"processes {min(loads):.2f}-{max(loads):.2f} (shared with other users' compiles)"
        if loads
        else "",
        f"- processes: {len(lines)}, in ABBA pairs; each cell: median of the processes [min-max], seconds",
        f"- flagged SLOWER: new/old > {1 + args.threshold:.2f}",
    ]
    if failed:
        head.append(f"- failed processes: {'; '.join(failed)}")
    body = []
    for case in dict.fromkeys(e["case"] for e in entries):
        body += ["", f"## {case}", ""]
        show_nk = any(k[0] == case for k in nk)
        cols = ["metric", "old s", "new s", "new/old"]
        cols += ["old/NetKet", "new/NetKet", "new/old of /NetKet"] if show_nk else []
        body += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for e in (e for e in entries if e["case"] == case):
            cells = [
                e["metric"],
                f"{e['old']:.4g} [{e['old_range'][0]:.4g}-{e['old_range'][1]:.4g}]",
                f"{e['new']:.4g} [{e['new_range'][0]:.4g}-{e['new_range'][1]:.4g}]",
                f"{e['ratio']:.3f}" + (" SLOWER" if e["slower"] else ""),
            ]
            if show_nk:
                r = [nk.get((case, e["metric"], s)) for s in ("old", "new")]
                cells += [f"{x:.3f}" if x else "-" for x in r]
                cells.append(f"{r[1] / r[0]:.3f}" if all(r) else "-")
            body.append("| " + " | ".join(cells) + " |")
    return "\n".join(head + body) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        old, old_commit = worktree(args.old, args.old_dir, "old")
        if args.new:
            new, new_commit = worktree(args.new, args.new_dir, "new")
        else:
            dirty = "+dirty" if git("status", "--porcelain") else ""
            new, new_commit = ROOT, git("rev-parse", "HEAD") + dirty
        sides = {"old": (old, old_commit), "new": (new, new_commit)}
        for case in args.cases:
            for pair in range(args.pairs):
                for side in order(pair):
                    line = run_one(case, side, *sides[side], pair, args, out)
                    print(
                        f"{case} pair {pair} {side}: rc {line['rc']}, {line['wall_s']:.0f} s, "
                        f"{len(line['rows'])} rows, load {line['load_before'][0]:.2f}",
                        flush=True,
                    )
    path = out / "runs.jsonl"
    lines = [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []
    text = report(lines, args)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
