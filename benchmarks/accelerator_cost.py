r"""What vmcgrad's and NetKet's kernels cost on an accelerator, counted from their compiled programs.

On a GPU or a TPU a program costs about the number of operations it runs one after another. This
script compiles each kernel of the race's problem (``time_to_energy.py``'s: the 4×4 J1–J2 model,
NetKet's ``GCNN`` over the space group, 3 layers × 8 features, P = 16 536, float32 with x64 off) on
this machine, and reads from each compiled program, with :func:`vmcgrad.program_cost`, its ops in
sequence, its FLOPs and bytes (loops weighted by their trip counts) and its modelled time

.. math::

    t = n_{\text{ops}}\, t_{\text{op}} + \text{FLOPs}/\text{peak} + \text{bytes}/\text{bandwidth}

with the constants of a CPU, a GPU (H200) and a TPU (v5e) (``vmcgrad._hlo.cost.PLATFORMS``), with
its compiled temporaries (``memory_analysis().temp_size_in_bytes``). Each comparison sets vmcgrad's
program against NetKet's counterpart and gives the ratio vmcgrad / NetKet of each modelled time:

- the MinSR update (``VMC_SR``'s SR phase: the sample-space kernel and its solve,
  ``time_to_energy.kernel_lowered``: ``vmcgrad.minsr_update`` as ``vmcgrad.netket.VMC_SR`` calls it,
  against NetKet's ``_sr_srt_common(use_ntk=True)``) at N = 256, chunk 64 both; N = 256, vmcgrad's
  ``"auto"`` within 64 MiB against NetKet's chunk 64; N = 256, ``"auto"`` within 1 GiB against NetKet
  unchunked; N = 1024, ``"auto"`` within 1 GiB and within 64 MiB against NetKet's chunk 256;
- the QGT product ``S @ v`` at N = 256, chunk 64: ``vmcgrad.QGT`` (built outside the program, as a
  solve builds it once) against NetKet's ``QGTOnTheFly`` (built inside: its construction is lazy);
  and ``vmcgrad.QGT`` built inside the program too (``qgt-built``: its :math:`\bar O` pass included,
  were a product to read it);
- the gradient at N = 1024, chunk 64: ``vmcgrad.expect_grad`` against NetKet's chunked force
  (``nk.jax.vjp_chunked`` and ``force_to_grad``, ``benchlib._setup.netket_grad``).

The programs are the ones XLA compiles for this machine's platform (``--platform`` picks JAX's): on
a CPU they approximate an accelerator's (fusion decisions differ). Every program is compiled, never
run; the samples are the race's sampler's, the local energies the race's.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/accelerator_cost.py --json rows.jsonl --markdown table.md
    python benchmarks/accelerator_cost.py --smoke            # the 12-site chain, a tiny GCNN: a check

Each program is one JSON line (``--json``, appended as each is compiled, so a stopped run keeps what
it finished); each comparison one more, with the ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

import time_to_energy as tte  # the race's problem, model, drivers and SR kernels (this folder)

MiB = 2**20
PLATFORM_NAMES = ("cpu", "gpu", "tpu")


def comparisons(n: int, n_big: int, chunk: int, chunk_big: int, budget: float, budget_big: float):
    """``(key, label, vmcgrad program, NetKet program)``; a program is ``(kind, name, N, chunk,
    budget MiB)`` with kind ``minsr``, ``qgt`` or ``grad``."""
    vm, nk = "vmcgrad-vmcsr", "netket-vmcsr"
    mib = lambda b: f"{b:g} MiB" if b < 1024 else f"{b / 1024:g} GiB"
    return [
        (
            "minsr-chunk",
            f"MinSR update, N = {n}, chunk {chunk} both",
            ("minsr", vm, n, chunk, budget),
            ("minsr", nk, n, chunk, None),
        ),
        (
            "minsr-auto",
            f"MinSR, N = {n}: vmcgrad auto within {mib(budget)}, NetKet chunk {chunk}",
            ("minsr", vm, n, "auto", budget),
            ("minsr", nk, n, chunk, None),
        ),
        (
            "minsr-auto-big",
            f"MinSR, N = {n}: vmcgrad auto within {mib(budget_big)}, NetKet unchunked",
            ("minsr", vm, n, "auto", budget_big),
            ("minsr", nk, n, None, None),
        ),
        (
            "minsr-n-big",
            f"MinSR, N = {n_big}: vmcgrad auto within {mib(budget_big)}, NetKet chunk {chunk_big}",
            ("minsr", vm, n_big, "auto", budget_big),
            ("minsr", nk, n_big, chunk_big, None),
        ),
        (
            "minsr-n-big-small-budget",
            f"MinSR, N = {n_big}: vmcgrad auto within {mib(budget)}, NetKet chunk {chunk_big}",
            ("minsr", vm, n_big, "auto", budget),
            ("minsr", nk, n_big, chunk_big, None),
        ),
        (
            "qgt",
            f"QGT S·v, N = {n}, chunk {chunk} both",
            ("qgt", "vmcgrad", n, chunk, None),
            ("qgt", "netket", n, chunk, None),
        ),
        (
            "qgt-built",
            f"QGT S·v, N = {n}, chunk {chunk} both, each built in the program",
            ("qgt-built", "vmcgrad", n, chunk, None),
            ("qgt", "netket", n, chunk, None),
        ),
        (
            "grad",
            f"gradient, N = {n_big}, chunk {chunk} both",
            ("grad", "vmcgrad", n_big, chunk, None),
            ("grad", "netket", n_big, chunk, None),
        ),
    ]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", choices=tte.PROBLEMS, default="j1j2")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--n", type=int, default=256, help="the smaller sample count")
    ap.add_argument("--n-big", type=int, default=1024, help="the larger sample count")
    ap.add_argument("--chunk", type=int, default=64, help="the chunk of both at equal chunk")
    ap.add_argument("--chunk-big", type=int, default=256, help="NetKet's chunk at --n-big")
    ap.add_argument("--budget-mib", type=float, default=64.0, help="vmcgrad's smaller budget")
    ap.add_argument("--budget-big-mib", type=float, default=1024.0, help="vmcgrad's larger budget")
    ap.add_argument("--chains", type=int, default=256, help="sampler chains (at most N)")
    ap.add_argument("--only", nargs="+", metavar="KEY", help="comparisons by key (see --list)")
    ap.add_argument("--list", action="store_true", help="print the comparisons' keys and exit")
    ap.add_argument("--platform", default=None, help="JAX platform (jax_platforms); default JAX's")
    ap.add_argument("--json", help="JSON lines: one per program, one per comparison, appended")
    ap.add_argument("--markdown", help="write the table, with the command, to this file")
    ap.add_argument("--smoke", action="store_true", help="the 12-site chain, a 1-layer GCNN, N 32 and 64")
    args = ap.parse_args(argv)
    if args.smoke:
        args.problem, args.layers, args.features = "chain", 1, 4
        args.n, args.n_big, args.chunk, args.chunk_big = 32, 64, 8, 16
        args.budget_mib, args.budget_big_mib, args.chains = 4.0, 64.0, 16
    args.comparisons = comparisons(
        args.n, args.n_big, args.chunk, args.chunk_big, args.budget_mib, args.budget_big_mib
    )
    keys = [c[0] for c in args.comparisons]
    if args.only:
        unknown = sorted(set(args.only) - set(keys))
        if unknown:
            ap.error(f"--only {unknown}: expected keys among {keys}")
        args.comparisons = [c for c in args.comparisons if c[0] in args.only]
    return args


class Kernels:
    """The programs of one problem, each compiled once and costed (memoised by program)."""

    def __init__(self, args):
        self.args = args
        self.race = argparse.Namespace(
            problem=args.problem,
            model="gcnn",
            layers=args.layers,
            features=args.features,
            dtype="float32",
            budget_mib=args.budget_mib,
            chains=args.chains,
            lr=0.005,
            diag_shift=1e-3,
            grow_max=8192,
            grow_window=20,
            sizes={},
        )
        self.hi, self.g, self.H, _ = tte.build_problem(self.race, exact=False)
        self.model = tte.build_model(self.race, self.g)
        self.states: dict[Any, Any] = {}
        self.costs: dict[Any, dict] = {}

    def driver(self, name, n, chunk, budget):
        """The race's driver and state for ``name`` at (N, chunk, budget), built once."""
        key = (name, n, chunk, budget)
        if key not in self.states:
            race = argparse.Namespace(**{**vars(self.race), "sizes": {name: (n, chunk)}})
            race.budget_mib = budget if budget is not None else self.race.budget_mib
            self.states[key] = (race, *tte.build_driver(race, name, 0, self.hi, self.g, self.H, self.model))
        return self.states[key]

    def lowered(self, kind, name, n, chunk, budget):
        import jax
        import jax.numpy as jnp

        if kind == "minsr":
            race, driver, vs = self.driver(name, n, chunk, budget)
            return tte.kernel_lowered(race, name, driver, vs, self.H)
        # the QGT product and the gradient: at the NetKet state's samples and parameters of this N
        _, _, vs = self.driver("netket-vmcsr", n, None, None)
        samples = jax.lax.collapse(vs.samples, 0, vs.samples.ndim - 1)
        w, ms, apply = vs.parameters, vs.model_state, vs.model.apply
        import vmcgrad

        if kind in ("qgt", "qgt-built"):
            v = jax.tree.map(lambda p: jnp.full_like(p, 0.5), w)
            logpsi = tte.log_psi(vs)
            if kind == "qgt-built":  # built and applied in one program, as NetKet's
                built = lambda w, x, v: vmcgrad.QGT(logpsi, w, x, chunk_size=chunk, diag_shift=1e-3) @ v
                return jax.jit(built).lower(w, samples, v)
            if name == "vmcgrad":
                S = vmcgrad.QGT(logpsi, w, samples, chunk_size=chunk, diag_shift=1e-3)
                return jax.jit(lambda S, v: S @ v).lower(S, v)
            from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

            def product(w, x, v):
                return QGTOnTheFly_DefaultConstructor(apply, w, ms, x, chunk_size=chunk, diag_shift=1e-3) @ v

            return jax.jit(product).lower(w, samples, v)
        e = vs.local_estimators(self.H).reshape(-1)
        if name == "vmcgrad":
            logpsi = tte.log_psi(vs)
            return jax.jit(lambda w, x, e: vmcgrad.expect_grad(logpsi, w, x, e, chunk_size=chunk)).lower(
                w, samples, e
            )
        from benchlib import netket_grad

        return jax.jit(lambda w, x, e: netket_grad(apply, w, ms, x, e, chunk)).lower(w, samples, e)

    def cost(self, program) -> dict:
        """The program's counts, temporaries and modelled times, compiled once."""
        if program in self.costs:
            return self.costs[program]
        import vmcgrad

        kind, name, n, chunk, budget = program
        t = time.perf_counter()
        lowered = self.lowered(*program)
        t_lower = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        t_compile = time.perf_counter() - t
        c = vmcgrad.program_cost(compiled)
        row = {
            "kind": kind,
            "program": name,
            "N": n,
            "chunk": chunk,
            "budget_mib": budget,
            "ops": c.ops,
            "gflop": c.flops / 1e9,
            "gbytes": c.bytes / 1e9,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / MiB,
            **{f"{p}_ms": 1e3 * c.time(p) for p in PLATFORM_NAMES},
            "loops": len(c.loops),
            "unknown_trip_loops": len(c.unknown_trip_loops),
            "compiled_on": c.platform,
            "lower_s": t_lower,
            "compile_s": t_compile,
        }
        if kind == "minsr" and name.startswith("vmcgrad"):
            _, driver, _ = self.driver(name, n, chunk, budget)
            row["chunk_size_bwd"] = str(driver.chunk_size_bwd)
        self.costs[program] = row
        return row


def label(row) -> str:
    chunk = "unchunked" if row["chunk"] is None else f"chunk {row['chunk']}"
    if row["budget_mib"] is not None and row["chunk"] == "auto":
        chunk = f"auto {row['budget_mib']:g} MiB"
    who = "vmcgrad" if row["program"].startswith("vmcgrad") else "NetKet"
    return f"{who} {row['kind']}, N={row['N']}, {chunk}"


def markdown_table(results) -> str:
    """One markdown table: each comparison's two programs, the ratios on vmcgrad's line."""
    head = ["program", "ops", "GFLOP", "temp MiB", "cpu ms", "gpu ms", "tpu ms", "ratio cpu/gpu/tpu"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for comp in results:
        lines.append(f"| **{comp['label']}** |" + " |" * (len(head) - 1))
        for side in ("vmcgrad", "netket"):
            r = comp[side]
            ratio = "/".join(f"{comp['ratio'][p]:.2f}" for p in PLATFORM_NAMES) if side == "vmcgrad" else ""
            cells = [
                label(r),
                f"{r['ops']:,.0f}",
                f"{r['gflop']:.3g}",
                f"{r['temp_mib']:.3g}",
                *(f"{r[f'{p}_ms']:.2f}" for p in PLATFORM_NAMES),
                ratio,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    if args.list:
        for key, text, *_ in args.comparisons:
            print(f"{key}: {text}")
        return
    tte.setup_jax(args.platform, x64=False)
    import jax

    d = jax.devices()[0]
    device = f"{jax.device_count()} x {d.platform} {d.device_kind}"
    t0 = time.perf_counter()
    kernels = Kernels(args)
    print(f"{device}; problem and model in {time.perf_counter() - t0:.1f} s", flush=True)
    results = []

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for key, text, ours, theirs in args.comparisons:
        pair = {}
        for side, program in (("vmcgrad", ours), ("netket", theirs)):
            fresh = program not in kernels.costs
            pair[side] = kernels.cost(program)
            if fresh:
                emit({"row": "program", "device": device, **pair[side]})
        ratio = {p: pair["vmcgrad"][f"{p}_ms"] / pair["netket"][f"{p}_ms"] for p in PLATFORM_NAMES}
        results.append({"key": key, "label": text, **pair, "ratio": ratio})
        emit({"row": "comparison", "key": key, "label": text, "ratio": ratio})
    md = markdown_table(results)
    print(md)
    if args.markdown:
        command = "python benchmarks/accelerator_cost.py " + " ".join(map(shlex.quote, sys.argv[1:]))
        with open(args.markdown, "w") as f:
            f.write(f"# Modelled accelerator cost, vmcgrad against NetKet\n\nDevice: {device}.\n\n")
            f.write(f"```\nPYTHONPATH=. {command}\n```\n\n{md}\n")


if __name__ == "__main__":
    main()
