r"""What vmcgrad's and NetKet's kernels cost on an accelerator, counted from their compiled programs.

On a GPU or a TPU a program costs about the number of operations it runs one after another. This
script compiles each kernel of the race's problem (``time_to_energy.py``'s: the 4×4 J1–J2 model,
NetKet's ``GCNN`` over the space group, 3 layers × 8 features, P = 16 536, float32 with x64 off) on
this machine, and reads from each compiled program, with :func:`vmcgrad.program_cost`, its ops in
sequence, its FLOPs and bytes (loops weighted by their trip counts) and its modelled time

.. math::

    t = n_{\text{ops}}\, t_{\text{op}} + \text{FLOPs}/\text{peak} + \text{bytes}/\text{bandwidth}

with the constants of a CPU, a GPU (H200) and a TPU (v5e) (``vmcgrad._hlo.cost.PLATFORMS``), with
its compiled temporaries (``memory_analysis().temp_size_in_bytes``), its StableHLO lines
(``lowered.as_text()``) and the seconds it took to lower (vmcgrad's automatic searches included: they
compile candidates) and to compile. Each comparison sets vmcgrad's program against NetKet's
counterpart and gives the ratios vmcgrad / NetKet of each modelled time and of the StableHLO lines:

- the MinSR update (``VMC_SR``'s SR phase: the sample-space kernel and its solve,
  ``time_to_energy.kernel_lowered``: ``vmcgrad.minsr_update`` as ``vmcgrad.netket.VMC_SR`` calls it,
  against NetKet's ``_sr_srt_common(use_ntk=True)``) at N = 256, chunk 64 both (vmcgrad within 1 GiB: at
  a chunk given, its budget bounds the route and the Jacobian batch; within 64 MiB no route fits at
  chunk 64 once the chunk's Jacobians are derived at once, as on an accelerator); N = 256, vmcgrad's
  ``"auto"`` within 64 MiB against NetKet's chunk 64; N = 256, ``"auto"`` within 1 GiB against NetKet
  unchunked; N = 1024, ``"auto"`` within 1 GiB and within 64 MiB against NetKet's chunk 256;
- the QGT product ``S @ v`` at N = 256, chunk 64: ``vmcgrad.QGT`` (built outside the program, as a
  solve builds it once) against NetKet's ``QGTOnTheFly`` (built inside: its construction is lazy);
- the QGT solve, the same operators, by conjugate gradient (``S.solve(b)`` against NetKet's
  ``QGTOnTheFly(...).solve(jax.scipy.sparse.linalg.cg, b)``, both tol 1e-5): the CG loop's trip count
  is not in the program, so its ops count the set-up and one iteration;
- the QGT product with ``vmcgrad.QGT`` built inside the program too (``qgt-built``: as NetKet's, the
  operator and its product in one program);
- the gradient at N = 1024, chunk 64: ``vmcgrad.expect_grad`` against NetKet's chunked force
  (``nk.jax.vjp_chunked`` and ``force_to_grad``, ``benchlib._setup.netket_grad``);
- the chunked primitives at N = 1024, chunk 64: ``vmcgrad.batched_vjp`` against ``nk.jax.vjp_chunked``
  of :math:`\mathrm{Re}\log\psi` with a real cotangent (one pullback each: NetKet's rule for a complex
  output would take two), ``vmcgrad.batched_jvp`` against ``QGTOnTheFly``'s chunked jvp of
  :math:`\log\psi` (``qgt_onthefly_logic._O_jvp``, a ``scanmap`` of ``jax.jvp``).

vmcgrad's choices depend on the platform they are made for (``vmcgrad._hlo.platform.resolve_platform``):
the Jacobian batch of MinSR's kernel (``ntk_modes.jacobian_split``: a sixteenth of a chunk on a CPU,
the whole chunk on an accelerator), ``chunk_size="auto"`` and the QGT's design (the least modelled time
on that platform's constants). ``--cost-platform`` (default ``tpu``) says which: each vmcgrad program
is lowered within ``vmcgrad.cost_platform(p)`` for each platform named, and compiled once per distinct
StableHLO (a program the same for ``gpu`` and ``tpu`` is one row, "priced for tpu, gpu"). So the table
prices the program an accelerator would run, though compiled here: the programs are the ones XLA
compiles for this machine's platform (``--platform`` picks JAX's), and on a CPU they approximate an
accelerator's (fusion decisions differ). Every program is compiled, never run; the samples are the
race's sampler's, the local energies the race's.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/accelerator_cost.py --json rows.jsonl --markdown table.md
    python benchmarks/accelerator_cost.py --cost-platform tpu gpu --json rows.jsonl  # both accelerators
    python benchmarks/accelerator_cost.py --only qgt grad vjp jvp   # some comparisons (--list: keys)
    python benchmarks/accelerator_cost.py --from-rows rows.jsonl --before old.jsonl --markdown table.md
    python benchmarks/accelerator_cost.py --smoke            # the 12-site chain, a tiny GCNN: a check

Each program is one JSON line (``--json``, appended as each is compiled, so a stopped run keeps what
it finished), after one line of the run's command; each comparison one more, with the ratios (a
comparison whose kernel raised, one line of the error, and the run goes on). ``--from-rows`` compiles
nothing: it tabulates recorded rows (with the same sizes and ``--cost-platform``), and ``--before``
sets an earlier run's vmcgrad ops and ratios beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
import time
from typing import Any

import time_to_energy as tte  # the race's problem, model, drivers and SR kernels (this folder)

MiB = 2**20
PLATFORM_NAMES = ("cpu", "gpu", "tpu")


def comparisons(n: int, n_big: int, chunk: int, chunk_big: int, budget: float, budget_big: float):
    """``(key, label, vmcgrad program, NetKet program)``; a program is ``(kind, name, N, chunk,
    budget MiB)`` with kind ``minsr``, ``qgt``, ``qgt-solve``, ``grad``, ``vjp`` or ``jvp``."""
    vm, nk = "vmcgrad-vmcsr", "netket-vmcsr"
    mib = lambda b: f"{b:g} MiB" if b < 1024 else f"{b / 1024:g} GiB"
    return [
        (
            "minsr-chunk",  # the budget at a chunk given: the route's and the Jacobian batch's
            f"MinSR update, N = {n}, chunk {chunk} both (vmcgrad within {mib(budget_big)})",
            ("minsr", vm, n, chunk, budget_big),
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
            "qgt-solve",
            f"QGT solve (CG, tol 1e-5), N = {n}, chunk {chunk} both",
            ("qgt-solve", "vmcgrad", n, chunk, None),
            ("qgt-solve", "netket", n, chunk, None),
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
        (
            "vjp",
            f"vjp of Re log ψ, N = {n_big}, chunk {chunk} both",
            ("vjp", "vmcgrad", n_big, chunk, None),
            ("vjp", "netket", n_big, chunk, None),
        ),
        (
            "jvp",
            f"jvp of log ψ, N = {n_big}, chunk {chunk} both",
            ("jvp", "vmcgrad", n_big, chunk, None),
            ("jvp", "netket", n_big, chunk, None),
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
    ap.add_argument(
        "--cost-platform",
        nargs="+",
        choices=PLATFORM_NAMES,
        default=["tpu"],
        help="the platform(s) vmcgrad's choices are made for (vmcgrad.cost_platform): the program each "
        "would run; a program the same for several is compiled once (default: tpu)",
    )
    ap.add_argument("--json", help="JSON lines: one per program, one per comparison, appended")
    ap.add_argument(
        "--from-rows",
        metavar="JSONL",
        help="compile nothing: the table of the programs recorded in these rows (an earlier --json)",
    )
    ap.add_argument(
        "--before",
        metavar="JSONL",
        help="rows of an earlier run: its vmcgrad ops and its ratios beside the new ones in the table",
    )
    ap.add_argument("--markdown", help="write the table, with the command, to this file")
    ap.add_argument(
        "--run",
        type=int,
        default=0,
        metavar="K",
        help="also run each program K times after a warm-up, on the arguments it was lowered with (on the "
        "device here: the measured milliseconds beside the modelled ones, median as run_ms)",
    )
    ap.add_argument("--hlo-dir", help="write each compiled program's optimized HLO text to this folder")
    ap.add_argument("--smoke", action="store_true", help="the 12-site chain, a 1-layer GCNN, N 32 and 64")
    args = ap.parse_args(argv)
    if args.smoke:
        args.problem, args.layers, args.features = "chain", 1, 4
        args.n, args.n_big, args.chunk, args.chunk_big = 32, 64, 8, 16
        args.budget_mib, args.budget_big_mib, args.chains = 4.0, 64.0, 16
    args.cost_platform = list(dict.fromkeys(args.cost_platform))
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


def is_vmcgrad(program) -> bool:
    return program[1].startswith("vmcgrad")


class Kernels:
    """The programs of one problem, each lowered and compiled once and costed (memoised by program,
    and, for vmcgrad's, by the platform its choices were made for: a program whose StableHLO is the
    one of an earlier platform's is not compiled again)."""

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
        self.by_text: dict[Any, dict] = {}  # (program, StableHLO digest) -> the row compiled
        self.call_args: dict[Any, tuple] = {}  # program -> its compiled program's (args, kwargs)

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

        def lower(fun, *args):  # jitted and lowered; its arguments kept for --run
            self.call_args[(kind, name, n, chunk, budget)] = (args, {})
            return jax.jit(fun).lower(*args)

        if kind == "minsr":
            race, driver, vs = self.driver(name, n, chunk, budget)
            call = []
            lowered = tte.kernel_lowered(race, name, driver, vs, self.H, call=call)
            self.call_args[(kind, name, n, chunk, budget)] = call[0]
            return lowered
        # the other kernels: at the NetKet state's samples and parameters of this N
        _, _, vs = self.driver("netket-vmcsr", n, None, None)
        samples = jax.lax.collapse(vs.samples, 0, vs.samples.ndim - 1)
        w, ms, apply = vs.parameters, vs.model_state, vs.model.apply
        logpsi = tte.log_psi(vs)
        forward = lambda w, ms, x: apply({"params": w, **ms}, x)  # NetKet's forward_fn
        import vmcgrad

        if kind in ("qgt", "qgt-solve", "qgt-built"):
            v = jax.tree.map(lambda p: jnp.full_like(p, 0.5), w)
            if kind == "qgt-built":  # built and applied in one program, as NetKet's
                built = lambda w, x, v: vmcgrad.QGT(logpsi, w, x, chunk_size=chunk, diag_shift=1e-3) @ v
                return lower(built, w, samples, v)
            if name == "vmcgrad":  # S built outside the program, as a solve builds it once
                S = vmcgrad.QGT(logpsi, w, samples, chunk_size=chunk, diag_shift=1e-3)
                if kind == "qgt":
                    return lower(lambda S, v: S @ v, S, v)
                return lower(lambda S, b: S.solve(b, tol=1e-5)[0], S, v)
            from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

            def S_of(w, x):  # lazy: NetKet's QGTOnTheFly is built inside the program
                return QGTOnTheFly_DefaultConstructor(apply, w, ms, x, chunk_size=chunk, diag_shift=1e-3)

            if kind == "qgt":
                return lower(lambda w, x, v: S_of(w, x) @ v, w, samples, v)
            cg = jax.scipy.sparse.linalg.cg  # NetKet's default tol 1e-5, maxiter None (10 × dim)
            return lower(lambda w, x, b: S_of(w, x).solve(cg, b)[0], w, samples, v)
        if kind == "grad":
            e = vs.local_estimators(self.H).reshape(-1)
            if name == "vmcgrad":
                grad = lambda w, x, e: vmcgrad.expect_grad(logpsi, w, x, e, chunk_size=chunk)
                return lower(grad, w, samples, e)
            from benchlib import netket_grad

            return lower(lambda w, x, e: netket_grad(apply, w, ms, x, e, chunk), w, samples, e)
        if kind == "vjp":  # of Re log psi with a real cotangent: one pullback on both sides (R -> R)
            c = jnp.linspace(-1.0, 1.0, samples.shape[0], dtype=jnp.float32)
            if name == "vmcgrad":
                re = lambda w, x: logpsi(w, x).real
                return lower(
                    lambda w, x, c: vmcgrad.batched_vjp(re, w, x, c, chunk_size=chunk), w, samples, c
                )
            import netket.jax as nkjax

            def pullback(w, x, c):
                f = lambda w, ms, x: forward(w, ms, x).real
                kw = dict(chunk_size=chunk, chunk_argnums=2, nondiff_argnums=(1, 2))
                return nkjax.vjp_chunked(f, w, ms, x, **kw)(c)[0]

            return lower(pullback, w, samples, c)
        # "jvp": the per-sample J t of log psi; NetKet's is QGTOnTheFly's chunked jvp (scanmap of jax.jvp)
        t = jax.tree.map(lambda p: jnp.full_like(p, 0.5), w)
        if name == "vmcgrad":
            return lower(
                lambda w, x, t: vmcgrad.batched_jvp(logpsi, w, x, t, chunk_size=chunk), w, samples, t
            )
        from netket.optimizer.qgt.qgt_onthefly_logic import _O_jvp

        return lower(lambda w, x, t: _O_jvp(forward, w, ms, x, t, chunk), w, samples, t)

    def run(self, program, compiled) -> dict:
        """``--run K``: the compiled program run once to warm up, then K times, each to its end
        (``block_until_ready``) on the arguments it was lowered with: the median and every run's
        milliseconds."""
        import jax

        if program not in self.call_args:
            return {}
        args, kwargs = self.call_args[program]
        jax.block_until_ready(compiled(*args, **kwargs))
        times = []
        for _ in range(self.args.run):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args, **kwargs))
            times.append(1e3 * (time.perf_counter() - t))
        return {"run_ms": statistics.median(times), "run_ms_all": times}

    def cost(self, program, platform) -> dict:
        """The program's counts, StableHLO lines, seconds, temporaries and modelled times: lowered
        with vmcgrad's choices made for ``platform`` (NetKet's programs do not depend on it)."""
        key = (program, platform) if is_vmcgrad(program) else program
        if key in self.costs:
            return self.costs[key]
        import vmcgrad

        kind, name, n, chunk, budget = program
        with vmcgrad.cost_platform(platform):
            # the state sampled and its local energies evaluated once before the clock: the seconds
            # are the kernel's tracing and lowering (vmcgrad's automatic searches included)
            state = self.driver(name, n, chunk, budget) if kind == "minsr" else None
            state = state or self.driver("netket-vmcsr", n, None, None)
            state[2].local_estimators(self.H)
            t = time.perf_counter()
            lowered = self.lowered(*program)
        t_lower = time.perf_counter() - t
        text = lowered.as_text()
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        head = {
            "kind": kind,
            "program": name,
            "N": n,
            "chunk": chunk,
            "budget_mib": budget,
            "priced_for": platform if is_vmcgrad(program) else None,
        }
        if is_vmcgrad(program) and kind == "minsr":
            _, driver, _ = self.driver(name, n, chunk, budget)
            head["chunk_size_bwd"] = str(driver.chunk_size_bwd)
        same = self.by_text.get((program, digest))
        if same is not None:  # the program of an earlier platform's choices: not compiled again
            row = {**same, **head, "lower_s": t_lower, "same_program_as": same["priced_for"]}
            self.costs[key] = row
            return row
        t = time.perf_counter()
        compiled = lowered.compile()
        t_compile = time.perf_counter() - t
        c = vmcgrad.program_cost(compiled)
        measured = self.run(program, compiled) if self.args.run else {}
        if self.args.hlo_dir:
            import os

            os.makedirs(self.args.hlo_dir, exist_ok=True)
            stem = "-".join(str(p) for p in (*program, platform if is_vmcgrad(program) else "")).strip("-")
            with open(os.path.join(self.args.hlo_dir, stem.replace(" ", "") + ".hlo.txt"), "w") as f:
                f.write(compiled.as_text())
        row = {
            **head,
            "ops": c.ops,
            "stablehlo_lines": text.count("\n"),
            "stablehlo_sha256": digest,
            "gflop": c.flops / 1e9,
            "gbytes": c.bytes / 1e9,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / MiB,
            **{f"{p}_ms": 1e3 * c.time(p) for p in PLATFORM_NAMES},
            "loops": len(c.loops),
            "unknown_trip_loops": len(c.unknown_trip_loops),
            "compiled_on": c.platform,
            "lower_s": t_lower,
            "compile_s": t_compile,
            **measured,
        }
        self.by_text[(program, digest)] = row
        self.costs[key] = row
        return row


KIND_NAMES = {
    "minsr": "MinSR update",
    "qgt": "QGT S·v",
    "qgt-solve": "QGT solve",
    "qgt-built": "QGT S·v built in the program",
    "grad": "gradient",
    "vjp": "vjp",
    "jvp": "jvp",
}


def label(row) -> str:
    chunk = "unchunked" if row["chunk"] is None else f"chunk {row['chunk']}"
    if row["budget_mib"] is not None and row["chunk"] == "auto":
        chunk = f"auto {row['budget_mib']:g} MiB"
    who = "vmcgrad" if row["program"].startswith("vmcgrad") else "NetKet"
    return f"{who} {KIND_NAMES[row['kind']]}, N={row['N']}, {chunk}"


def ratios(ours: dict, theirs: dict) -> dict:
    """vmcgrad / NetKet: each platform's modelled time, the ops, the StableHLO lines, the temp bytes."""
    out = {p: ours[f"{p}_ms"] / theirs[f"{p}_ms"] for p in PLATFORM_NAMES}
    if "run_ms" in ours and "run_ms" in theirs:
        out["run"] = ours["run_ms"] / theirs["run_ms"]
    for k in ("ops", "stablehlo_lines", "temp_mib"):
        out[k] = ours[k] / theirs[k]
    return out


def markdown_table(results, platforms, before=None) -> str:
    """One markdown table: each comparison's programs, the ratios on vmcgrad's lines (one line per
    platform priced for, unless the programs are the same); with ``before`` (:func:`before_of`), an
    earlier run's vmcgrad ops and ratios beside them."""
    head = [
        "program",
        "priced for",
        "ops",
        *(["ops before"] if before else []),
        "StableHLO lines",
        "lower s",
        "compile s",
        "GFLOP",
        "temp MiB",
        "cpu ms",
        "gpu ms",
        "tpu ms",
        "ratio cpu/gpu/tpu",
        *(["ratio before"] if before else []),
        "ratio lines",
    ]
    # --run: the measured milliseconds and ratio beside the modelled ones
    measured = any("run_ms" in r for c in results for r in [*c["vmcgrad"].values(), c.get("netket", {})])
    head += ["run ms", "ratio run"] if measured else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cells(r, who, ratio, key=None):
        loops = "†" if r["unknown_trip_loops"] else ""
        then = None if before is None or ratio is None else before(key, r)
        return [
            label(r),
            who,
            f"{r['ops']:,.0f}{loops}",
            *([] if before is None else ["" if then is None else f"{then[0]:,.0f}"]),
            f"{r['stablehlo_lines']:,}",
            f"{r['lower_s']:.1f}",
            f"{r['compile_s']:.1f}" if "same_program_as" not in r else "–",
            f"{r['gflop']:.3g}",
            f"{r['temp_mib']:.3g}",
            *(f"{r[f'{p}_ms']:.2f}" for p in PLATFORM_NAMES),
            "" if ratio is None else "/".join(f"{ratio[p]:.2f}" for p in PLATFORM_NAMES),
            *(
                []
                if before is None
                else ["" if then is None else "/".join(f"{then[1][p]:.2f}" for p in PLATFORM_NAMES)]
            ),
            "" if ratio is None else f"{ratio['stablehlo_lines']:.2f}",
            *(
                [
                    f"{r['run_ms']:.2f}" if "run_ms" in r else "",
                    f"{ratio['run']:.2f}" if ratio and "run" in ratio else "",
                ]
                if measured
                else []
            ),
        ]

    for comp in results:
        lines.append(f"| **{comp['label']}** |" + " |" * (len(head) - 1))
        for p, message in comp.get("error", {}).items():
            lines.append(f"| failed, priced for {p}: {message} |" + " |" * (len(head) - 1))
        for p in platforms:
            r = comp["vmcgrad"].get(p)
            if r is None or "same_program_as" in r:
                continue  # the row of the platform it repeats says so
            same = [q for q in platforms if comp["vmcgrad"].get(q, {}).get("same_program_as") == p]
            cell = cells(r, ", ".join([p, *same]), comp["ratio"][p], comp["key"])
            lines.append("| " + " | ".join(cell) + " |")
        if "netket" in comp:
            lines.append("| " + " | ".join(cells(comp["netket"], "", None)) + " |")
    return "\n".join(lines)


def program_key(row) -> tuple:
    """A program row's key: ``(kind, name, N, chunk, budget MiB)``, as :func:`comparisons` writes it."""
    return (row["kind"], row["program"], row["N"], row["chunk"], row["budget_mib"])


def read_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def before_of(path):
    """``(key, row) -> (ops, ratio) | None`` of an earlier run's rows: the ratios of the comparison of
    that key (priced for the row's platform where the run recorded one), the ops of vmcgrad's program
    of the same key, else (at a chunk given, whose budget may have changed) of the same kind, N and
    chunk."""
    rows = read_rows(path)
    ratios, ops = {}, {}
    for r in rows:
        if r["row"] == "comparison":
            ratios.setdefault((r["key"], r.get("priced_for")), r["ratio"])
            ratios.setdefault((r["key"], None), r["ratio"])
        elif r["row"] == "program" and r["program"].startswith("vmcgrad"):
            for k in (program_key(r), program_key(r)[:4]):
                ops.setdefault((k, r.get("priced_for")), r["ops"])
                ops.setdefault((k, None), r["ops"])

    def then(key, row):
        ratio = ratios.get((key, row["priced_for"]), ratios.get((key, None)))
        if ratio is None:
            return None
        k, k4 = program_key(row), program_key(row)[:4]
        n = ops.get((k, row["priced_for"]), ops.get((k, None)))
        if n is None and isinstance(row["chunk"], int):
            n = ops.get((k4, row["priced_for"]), ops.get((k4, None)))
        return (float("nan") if n is None else n), ratio

    return then


def main(argv=None):
    args = parse(argv)
    if args.list:
        for key, text, *_ in args.comparisons:
            print(f"{key}: {text}")
        return
    if args.from_rows:  # the table of recorded programs: nothing compiled
        kernels = Recorded(read_rows(args.from_rows))
        device, clear = kernels.device, lambda: None
    else:
        tte.setup_jax(args.platform, x64=False)
        import jax

        d = jax.devices()[0]
        device = f"{jax.device_count()} x {d.platform} {d.device_kind}"
        t0 = time.perf_counter()
        kernels = Kernels(args)
        clear = jax.clear_caches
        print(f"{device}; problem and model in {time.perf_counter() - t0:.1f} s", flush=True)

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.json and not args.from_rows:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    command = "PYTHONPATH=. python benchmarks/accelerator_cost.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    if args.from_rows:
        recorded = kernels.command or "(not recorded)"
    else:
        recorded = command
        emit({"row": "run", "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    results = {
        key: {"key": key, "label": text, "vmcgrad": {}, "ratio": {}} for key, text, *_ in args.comparisons
    }
    for i, platform in enumerate(args.cost_platform):
        if i:  # no trace of the previous platform's choices reused from JAX's caches
            clear()
        for key, text, ours, theirs in args.comparisons:
            res = results[key]
            try:
                for program in (theirs, ours):  # NetKet's first: a run stopped in vmcgrad's search keeps it
                    fresh = (program, platform) not in kernels.costs and program not in kernels.costs
                    row = kernels.cost(program, platform)
                    if fresh:
                        emit({"row": "program", "device": device, **row})
            except Exception as err:  # a failing kernel is a row of the table, not the end of the run
                message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                res.setdefault("error", {})[platform] = message
                emit({"row": "error", "key": key, "label": text, "priced_for": platform, "error": message})
                continue
            res["vmcgrad"][platform] = kernels.cost(ours, platform)
            res["netket"] = kernels.cost(theirs, platform)
            res["ratio"][platform] = ratios(res["vmcgrad"][platform], res["netket"])
            emit(
                {
                    "row": "comparison",
                    "key": key,
                    "label": text,
                    "priced_for": platform,
                    "ratio": res["ratio"][platform],
                }
            )
    before = before_of(args.before) if args.before else None
    md = markdown_table(list(results.values()), args.cost_platform, before)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# Modelled accelerator cost, vmcgrad against NetKet\n\nDevice: {device}.\n\n")
            if args.from_rows:
                f.write(f"The programs compiled by\n\n```\n{recorded}\n```\n\ntabulated by\n\n")
            f.write(f"```\n{command}\n```\n\n{md}\n\n{NOTES}\n")
            if args.before:
                f.write(
                    '\n"ops before", "ratio before": vmcgrad\'s ops and the ratios of the same comparison '
                )
                f.write(f"in `{args.before}`.\n")


class Recorded:
    """The programs of an earlier run's rows (``--from-rows``), served as :class:`Kernels` serves them."""

    def __init__(self, rows):
        programs = [r for r in rows if r["row"] == "program"]
        if not programs:
            raise SystemExit("--from-rows: no program rows in the file")
        self.device = programs[0]["device"]
        self.command = next((r["command"] for r in rows if r["row"] == "run"), None)
        self.costs = {}
        for r in programs:
            row = {k: v for k, v in r.items() if k not in ("row", "device")}
            vm = r["program"].startswith("vmcgrad")
            self.costs[(program_key(r), r["priced_for"]) if vm else program_key(r)] = row

    def cost(self, program, platform) -> dict:
        key = (program, platform) if is_vmcgrad(program) else program
        if key not in self.costs:
            raise KeyError(
                f"not in the rows: {program}" + (f" priced for {platform}" if is_vmcgrad(program) else "")
            )
        return self.costs[key]


NOTES = """\
"priced for": the platform vmcgrad's choices (the Jacobian batch, `chunk_size="auto"`, the QGT's design)
were made for (`vmcgrad.cost_platform`); several names: the same program for each. NetKet's programs do
not depend on it. "lower s" includes vmcgrad's automatic searches (they compile candidates); "ratio" is
vmcgrad / NetKet of the modelled times on the cpu / gpu / tpu constants, "ratio lines" of the StableHLO
lines. †: the program has a loop of unknown trip count (CG), counted once: setup and one iteration."""


if __name__ == "__main__":
    main()
