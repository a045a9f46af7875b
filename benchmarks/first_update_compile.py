"""Time to the first update: ``vmcgrad.netket.VMC_SR(chunk_size_bwd="auto")`` against NetKet's ``VMC_SR``.

Usage (with vmcgrad installed, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/first_update_compile.py                    # 3 interleaved pairs, the table
    python benchmarks/first_update_compile.py --repeats 1 --budget-mib 8 --json /tmp/first.json
    git worktree add /tmp/old REV && python benchmarks/first_update_compile.py \\
        --contenders netket vmcgrad@/tmp/old vmcgrad@.   # a change against REV, interleaved

The problem: the 12-site J1-J2 chain (J2 = 0.5, total Sz = 0), NetKet's ``GCNN`` (``--layers``
layers of ``--features`` features), float64, N = ``--n-samples``, one CPU device. Each contender
runs in a fresh process (so no cache of an earlier run helps it), in turns: NetKet's
``VMC_SR(use_ntk=True)`` at ``chunk_size_bwd=--chunk`` and vmcgrad's at ``chunk_size_bwd="auto"``
with ``memory_budget=--budget-mib``; both on a NetKet ``MCState`` at chunk ``--chunk`` (the same
local energies). The samples are drawn before the clock starts (the sampler's compile is not
timed); ``first`` is the wall time of the first ``driver.run(1)`` (local energies, the route and
chunk search, the update's compile and run), ``second`` of the next one (run only). Per process
every XLA compile is counted by JAX's name for it, with its backend seconds (``jax.monitoring``),
and the trace and lowering seconds. Bar (issue 47): vmcgrad's ``first`` at most 1.5x NetKet's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

BAR = 1.5


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-samples", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128, help="NetKet's chunk_size_bwd and the state's chunk")
    ap.add_argument("--budget-mib", type=float, default=64.0, help="vmcgrad's memory_budget")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contenders", nargs="+", default=["netket", "vmcgrad"])
    ap.add_argument("--worker", choices=["netket", "vmcgrad"], help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


def worker(args) -> dict:
    import jax

    events: dict = collections.defaultdict(lambda: collections.Counter())
    counts: collections.Counter = collections.Counter()

    def listen(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
        short = event.rsplit("/", 1)[-1]
        events[short][fun_name] += duration
        if short == "backend_compile_duration":
            counts[fun_name] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import netket as nk
    import optax

    import vmcgrad.netket as vnk

    g = nk.graph.Chain(12, pbc=True)
    g2 = nk.graph.Graph(edges=[(i, (i + 2) % 12, 1) for i in range(12)] + [(*e, 0) for e in g.edges()])
    hi = nk.hilbert.Spin(0.5, 12, total_sz=0)
    H = nk.operator.Heisenberg(hi, g2, J=[1.0, 0.5], sign_rule=[True, False])
    model = nk.models.GCNN(
        symmetries=g, layers=args.layers, features=(args.features,) * args.layers, param_dtype=jnp.float64
    )
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=32, d_max=2)
    vs = nk.vqs.MCState(
        sampler, model, n_samples=args.n_samples, chunk_size=args.chunk, seed=0, sampler_seed=1
    )
    kw = dict(diag_shift=1e-3, variational_state=vs, use_ntk=True)
    if args.worker == "netket":
        driver = nk.driver.VMC_SR(H, optax.sgd(0.01), chunk_size_bwd=args.chunk, **kw)
    else:
        driver = vnk.VMC_SR(
            H, optax.sgd(0.01), chunk_size_bwd="auto", memory_budget=int(args.budget_mib * 2**20), **kw
        )
    jax.block_until_ready(vs.samples)  # the sampler compiled and run before the clock
    before = {k: collections.Counter(v) for k, v in events.items()}
    counts.clear()
    start = time.perf_counter()
    driver.run(1, show_progress=False)
    jax.block_until_ready(vs.parameters)
    first = time.perf_counter() - start
    compiled = dict(counts)
    spent = {k: {f: s - before.get(k, {}).get(f, 0.0) for f, s in v.items()} for k, v in events.items()}
    start = time.perf_counter()
    driver.run(1, show_progress=False)
    jax.block_until_ready(vs.parameters)
    second = time.perf_counter() - start
    row = dict(
        contender=args.worker,
        first=first,
        second=second,
        compiles=sum(compiled.values()),
        by_name=compiled,
        seconds={k: {f: round(s, 3) for f, s in v.items() if s > 0} for k, v in spent.items()},
    )
    if args.worker == "vmcgrad":
        row["route"] = driver.route
    return row


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    rows = []
    base = [sys.executable, __file__, "--n-samples", str(args.n_samples), "--chunk", str(args.chunk)]
    base += ["--budget-mib", str(args.budget_mib), "--layers", str(args.layers)]
    base += ["--features", str(args.features)]
    for rep in range(args.repeats):
        for who in args.contenders:
            name, _, path = who.partition("@")  # "vmcgrad@/tmp/old": the vmcgrad of that checkout
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}
            if path:
                env["PYTHONPATH"] = path
            cmd = [*base, "--worker", name]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["repeat"], row["contender"] = rep, who
            rows.append(row)
            backend = row["seconds"].get("backend_compile_duration", {})
            top = sorted(backend.items(), key=lambda kv: -kv[1])[:4]
            print(
                f"{who:20s} first {row['first']:6.2f} s  second {row['second']:6.3f} s  compiles "
                f"{row['compiles']:3d} ({sum(backend.values()):5.1f} s backend) {row.get('route', '')}  "
                + ", ".join(f"{n} {s:.1f}s x{row['by_name'].get(n, 0)}" for n, s in top),
                flush=True,
            )
    medians = {w: statistics.median(r["first"] for r in rows if r["contender"] == w) for w in args.contenders}
    print("median first update (s):", {w: round(t, 2) for w, t in medians.items()})
    for who, t in medians.items():
        if who != "netket" and "netket" in medians:
            print(f"{who} / netket = {t / medians['netket']:.2f} (bar {BAR})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
