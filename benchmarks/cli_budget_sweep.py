"""``vmcgrad vmc --memory-budget B`` on every built-in system and model: does each run either finish or
stop (exit 2, before sampling) with a budget or sample count that fits?

The goal of issue 48: where any route fits the budget, the run finishes; where none does, it exits with
status 2 before sampling, and its message names ``--memory-budget`` and/or ``--samples`` with values
that work. For each system × model × budget this runs ``python -m vmcgrad vmc`` with ``--driver auto``,
then the driver auto did not take (``sr`` or ``minsr``: their routes differ), each in its own ``--out``
folder, one at a time, under a timeout. Each run's record (one JSON line) holds its exit status, wall
time, the driver and route taken, the chunks, the header's lines and, for an exit 2, whether it came
before sampling and the suggested ``--memory-budget``/``--samples``. ``--verify`` then re-runs every
exit 2 with each suggestion and records whether it finishes. The records are appended to
``OUT/runs.jsonl`` (a rerun skips the runs already there) and summed up in ``OUT/table.md``. Figures:
docs/performance.md ("``vmcgrad vmc`` at a budget on the built-in systems").

    nice -n 5 python benchmarks/cli_budget_sweep.py --out /tmp/budget-sweep --verify
    python benchmarks/cli_budget_sweep.py --budgets 256 --systems heisenberg2d j1j2 --models gcnn
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("heisenberg1d", "heisenberg2d", "ising1d", "j1j2")  # vmcgrad/cli/_systems.py
MODELS = ("rbm", "rbm-phase", "mlp", "rbm-symm", "gcnn")
OTHER = {"sr": "minsr", "minsr": "sr"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="vmcgrad-budget-sweep", help="folder of runs.jsonl and table.md")
    p.add_argument("--budgets", type=float, nargs="+", default=[16, 64, 256], help="MiB per device")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--no-other", action="store_true", help="--driver auto only")
    p.add_argument("--verify", action="store_true", help="re-run each exit 2 with its suggestions")
    p.add_argument("--verify-only", action="store_true", help="--verify on the runs recorded, no new grid")
    p.add_argument("--table-only", action="store_true", help="rewrite table.md from runs.jsonl")
    return p.parse_args(argv)


def vmc(system, model, budget_mib, driver, steps, timeout, samples=None, budget_text=None) -> dict:
    """One ``python -m vmcgrad vmc`` run into a fresh temp folder; its record."""
    budget_text = budget_text or f"{budget_mib:g}MiB"
    with tempfile.TemporaryDirectory(prefix="vmc-sweep-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "vmcgrad", "vmc", "--system", system, "--model", model]
        cmd += ["--memory-budget", budget_text, "--driver", driver, "--steps", str(steps), "--out", str(out)]
        if samples is not None:
            cmd += ["--samples", str(samples)]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            rc, stdout, stderr = None, _text(expired.stdout), _text(expired.stderr)
        wall = time.perf_counter() - start
        log = _json(out / "log.json")
        run = _json(out / "run.json")
    info = (log or {}).get("info") or {}
    sampled = bool((log or {}).get("energy_mean")) or "step 1/" in stdout
    message = next((line for line in reversed(stderr.splitlines()) if "error" in line.lower()), None)
    budget = re.search(r"--memory-budget (\d+(?:\.\d+)?)\s*([KMG]i?B)?", message or "")
    fewer = re.search(r"--samples (\d+)", message or "")
    return {
        "system": system,
        "model": model,
        "budget_mib": budget_mib,
        "driver": driver,
        "samples": samples,
        "cmd": " ".join(cmd[1:]).replace(str(out), "OUT"),
        "rc": rc,
        "timed_out": rc is None,
        "wall_s": round(wall, 2),
        "traceback": "Traceback (most recent call last)" in stderr,
        "header": [
            line for line in stdout.splitlines() if line.startswith(("vmcgrad vmc:", "driver ", "route "))
        ],
        "driver_taken": info.get("driver_taken") or _header_driver(stdout),
        "route": info.get("route"),
        "step_routes": sorted(set(r for r in (log or {}).get("route", []) if r)),
        "chunk_size": info.get("chunk_size"),
        "qgt_design": info.get("qgt_design"),
        "n_parameters": info.get("n_parameters") or _header_parameters(stdout),
        "n_samples": info.get("n_samples"),
        "temp_bytes": ((log or {}).get("temp_bytes") or [None])[-1],
        "step_time": (log or {}).get("step_time"),
        "status": (log or {}).get("status"),
        "log_error": (log or {}).get("error"),
        "run_json": run is not None,
        "sampled": sampled,
        "exit2_before_sampling": rc == 2 and not sampled,
        "message": message,
        "names_budget": bool(message and "--memory-budget" in message),
        "suggested_budget": None if budget is None else budget.group(1) + (budget.group(2) or ""),
        "suggested_samples": None if fewer is None else int(fewer.group(1)),
        "stderr_tail": stderr[-3000:] if rc not in (0, 2) else None,
        "commit": os.environ.get("SWEEP_COMMIT") or _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _commit() -> str:
    """The vmcgrad checkout's commit, with ``+`` when its working tree differs from it."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "vmcgrad"], capture_output=True, text=True).stdout
    return head.strip() + ("+" if dirty.strip() else "")


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _header_driver(stdout: str):
    found = re.search(r"^driver (\w+):", stdout, re.M)
    return found.group(1) if found else None


def _header_parameters(stdout: str):
    found = re.search(r"with (\d+) parameters", stdout)
    return int(found.group(1)) if found else None


def verdict(r: dict) -> str:
    """``ok`` (finished), ``exit 2`` (refused before sampling, naming a fix), else what went wrong."""
    if r["timed_out"]:
        return "TIMEOUT"
    if r.get("verify_of") and r["rc"] != 0:
        return f"FAIL: the suggestion does not run (rc {r['rc']})"
    if r["rc"] == 0:
        return "ok" if r["status"] == "finished" else f"rc 0 but status {r['status']}"
    if r["rc"] == 2:
        if not r["exit2_before_sampling"]:
            return "FAIL: exit 2 after sampling"
        if not (r["suggested_budget"] or r["suggested_samples"]):
            return "FAIL: exit 2 without a budget or samples"
        return "exit 2"
    return f"FAIL: rc {r['rc']}"


def key(r: dict) -> tuple:
    return (r["system"], r["model"], r["budget_mib"], r["driver"], r.get("samples"), r.get("verify_of"))


def markdown_table(records: list[dict]) -> str:
    lines = [
        "| system | model | P | budget | --driver | taken | route | chunks (gradient/qgt or kernel) "
        "| rc | wall s | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        chunks = r["chunk_size"] or {}
        chunk = "/".join(str(chunks[k]) for k in ("gradient", "qgt", "kernel") if k in chunks) or "-"
        route = r["route"] or ("qgt-cg" if r["driver_taken"] == "sr" and r["rc"] == 0 else "-")
        what = verdict(r)
        if r.get("verify_of"):
            what += f" (retry of {r['verify_of']})"
        elif r["rc"] == 2:
            fix = [f"--memory-budget {r['suggested_budget']}"] if r["suggested_budget"] else []
            fix += [f"--samples {r['suggested_samples']}"] if r["suggested_samples"] else []
            what += ": " + ", ".join(fix)
        budget = r.get("budget_text") or f"{r['budget_mib']:g} MiB"
        samples = f" N={r['samples']}" if r.get("samples") else ""
        lines.append(
            f"| {r['system']} | {r['model']} | {r['n_parameters'] or '-'} | {budget}{samples} | "
            f"{r['driver']} | {r['driver_taken'] or '-'} | {route} | {chunk} | {r['rc']} | "
            f"{r['wall_s']:.0f} | {what} |"
        )
    fails = sum(verdict(r).startswith(("FAIL", "TIMEOUT", "rc 0")) for r in records)
    lines.append("")
    lines.append(
        f"{len(records)} runs, {fails} failures, {sum(r['wall_s'] for r in records) / 60:.1f} minutes"
    )
    return "\n".join(lines) + "\n"


def verify(records: list[dict], done: dict, record, args) -> None:
    """Re-runs each exit 2 with each suggestion it made (its budget; its samples at the same budget)."""
    for r in list(records):
        if r["rc"] != 2 or r.get("verify_of") or not r["exit2_before_sampling"]:
            continue
        origin = f"{r['budget_mib']:g} MiB {r['driver']}: "
        tries = []
        if r["suggested_budget"]:
            tries.append({"budget_text": r["suggested_budget"], "samples": r.get("samples")})
        if r["suggested_samples"]:
            tries.append({"budget_text": f"{r['budget_mib']:g}MiB", "samples": r["suggested_samples"]})
        for t in tries:
            k = (
                r["system"],
                r["model"],
                r["budget_mib"],
                r["driver"],
                t["samples"],
                origin + t["budget_text"],
            )
            if k in done:
                continue
            v = vmc(
                r["system"],
                r["model"],
                r["budget_mib"],
                r["driver"],
                args.steps,
                args.timeout,
                samples=t["samples"],
                budget_text=t["budget_text"],
            )
            v["budget_text"] = t["budget_text"]
            v["verify_of"] = origin + t["budget_text"]
            record(v)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {key(r): r for r in records}

    def record(r: dict) -> None:
        records.append(r)
        done[key(r)] = r
        with path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        (out / "table.md").write_text(markdown_table(records))
        print(f"{key(r)}: {verdict(r)} in {r['wall_s']:.0f} s", flush=True)

    if not (args.table_only or args.verify_only):
        for budget in args.budgets:
            for system in args.systems:
                for model in args.models:
                    auto = done.get((system, model, budget, "auto", None, None))
                    if auto is None:
                        auto = vmc(system, model, budget, "auto", args.steps, args.timeout)
                        record(auto)
                    if not args.no_other and auto["driver_taken"] in OTHER:
                        other = OTHER[auto["driver_taken"]]
                        if (system, model, budget, other, None, None) not in done:
                            record(vmc(system, model, budget, other, args.steps, args.timeout))
    if not args.table_only and (args.verify or args.verify_only):
        verify(records, done, record, args)
    (out / "table.md").write_text(markdown_table(records))
    print(markdown_table(records))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
