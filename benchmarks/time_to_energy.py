r"""Time to a ground-state energy at a memory budget: vmcgrad's SR and MinSR against NetKet's best routes.

A user runs vmcgrad for a ground state, not for a kernel. This race gives every contender the same
problem, the same sampler, the same wall-clock limit and the same seeds, and records the energy against
wall time (compilation included: it is part of a user's run).

**Problems** (``--problem``; the exact energy by Lanczos, or from the table for 6×6):

- ``j1j2``: the 4×4 J1–J2 model at J2 = 0.5, periodic, total Sz = 0 (frustrated; E0 = −33.8317 in
  NetKet's Pauli units);
- ``heisenberg6``: the 6×6 Heisenberg model, periodic, total Sz = 0 (E0 = −97.757568);
- ``chain``: the 12-site J1–J2 chain at J2 = 0.5 (an easy problem, and the smoke run's).

**Models** (``--model``): NetKet's ``GCNN`` over the lattice's space group (``--layers``,
``--features``; 3 × 8 on the 4×4 lattice: P = 16 536), or the benchmarks' ViT
(:class:`benchlib.ViT`); real parameters, complex log ψ.

**Contenders** (``--contenders``; each at its own N and chunk, given as ``NAME=N[:CHUNK]`` with
``--n``; chunk ``auto`` means vmcgrad's choice at ``--budget-mib``):

- ``netket-sr-cg``: ``nk.driver.VMC`` + ``nk.optimizer.SR(QGTOnTheFly, jax.scipy CG)`` on NetKet's
  ``MCState(chunk_size=c)``;
- ``netket-vmcsr`` / ``netket-vmcsr-otf``: ``nk.driver.VMC_SR(use_ntk=True, on_the_fly=False/True,
  chunk_size_bwd=c)``;
- ``vmcgrad-sr``: ``nk.driver.VMC`` + ``vmcgrad.netket.SR`` on ``vmcgrad.netket.MCState``;
- ``vmcgrad-vmcsr``: ``vmcgrad.netket.VMC_SR(use_ntk=True, chunk_size_bwd=c)``;
- ``vmcgrad-vmcsr-grow``: the same, starting at N and raising it with
  ``grow_samples=vmcgrad.netket.GrowSamples(max_samples=--grow-max, window=--grow-window)`` within the
  budget (each step's N is in the trace; the table's N is the first, then the last where it grew).

Each (contender, seed) runs in a process of its own (so its peak RSS is its own), for ``--minutes``;
with ``--parallel K``, K of them at once, each pinned to a CPU core of its own: K consecutive runs of
the serial order (a seed's contenders, then the next seed's in reverse) start together, so contenders
side by side share the machine's background load.
Every step records the wall time since the process began building the model and driver (the exact
energy, a reference, is computed before: once per race), the energy and its error, and three
phases: sampling, ``expect_and_grad`` / local energies (the gradient included for VMC), and the
preconditioner (SR: QGT and solve; ``VMC_SR``: the sample-space kernel and its solve).
The SR kernel's compiled bytes are measured on the contender's own (N, chunk) for the ``VMC_SR``
contenders (compile only). The report gives, per contender and seed: N, chunk, steps, the time to reach
each relative-error target (the running mean of ``--window`` steps below the target), the best running
mean, the final relative error (the mean of the last ``--window`` steps with its standard error), the
median phase times, the kernel's compiled bytes and the peak RSS; and a plot of the relative error
against wall time.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/time_to_energy.py --problem j1j2 --budget-mib 64 --minutes 30 --seeds 0 1 \
        --n netket-vmcsr=256:64 netket-vmcsr-otf=256:64 netket-sr-cg=1024:64 vmcgrad-sr=1024:auto \
        vmcgrad-vmcsr=1024:auto --out tte-j1j2-64mib
    python benchmarks/time_to_energy.py --smoke --out /tmp/tte-smoke      # under a minute: a check

**On an accelerator** (``benchmarks/device.sh``'s ``race`` step runs a short form): ``--platform cuda``
makes a worker fail rather than fall back to the CPU, ``--chains`` gives the sampler more chains than
the CPU's 16, ``--dtype float32`` runs with x64 off (a TPU emulates float64, and its float64 solves
raise), and each row also records the device and its allocator's peak bytes
(``jax.devices()[0].memory_stats()["peak_bytes_in_use"]``; none on the CPU, where the peak RSS is the
figure). A contender that fails is reported and the others still run; the table, the results and the
plot are rewritten after each run, so a race stopped by a time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CONTENDERS = (
    "netket-sr-cg",
    "netket-vmcsr",
    "netket-vmcsr-otf",
    "vmcgrad-sr",
    "vmcgrad-vmcsr",
    "vmcgrad-vmcsr-grow",
)
PROBLEMS = ("j1j2", "heisenberg6", "chain")
TARGETS = (1e-2, 5e-3, 2e-3)
MiB = 2**20
E0_6x6 = -97.757568  # -2.715488 per site in NetKet's Pauli units (exact diagonalisation, literature)
DEFAULT_N = {
    "netket-sr-cg": "1024:64",
    "netket-vmcsr": "256:64",
    "netket-vmcsr-otf": "256:64",
    "vmcgrad-sr": "1024:auto",
    "vmcgrad-vmcsr": "1024:auto",
    "vmcgrad-vmcsr-grow": "256:auto",
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", choices=PROBLEMS, default="j1j2")
    ap.add_argument("--model", choices=("gcnn", "vit"), default="gcnn")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--budget-mib", type=float, default=64.0, help="memory budget per device")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock limit per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--n", nargs="*", default=[], metavar="NAME=N[:CHUNK]", help="per contender")
    ap.add_argument("--diag-shift", type=float, default=1e-3)
    ap.add_argument(
        "--grow-max",
        type=int,
        default=8192,
        help="vmcgrad-vmcsr-grow: GrowSamples(max_samples=...), also capped by the budget",
    )
    ap.add_argument("--grow-window", type=int, default=20, help="vmcgrad-vmcsr-grow: GrowSamples(window=...)")
    ap.add_argument("--lr", type=float, default=0.005, help="SGD learning rate of every contender")
    ap.add_argument("--window", type=int, default=10, help="steps of the running mean")
    ap.add_argument("--out", default="time-to-energy", help="folder: results.json, table.md, energy.png")
    ap.add_argument(
        "--platform",
        default=None,
        help="JAX platform of the workers (jax_platforms: cpu, cuda, tpu, ...); default JAX's own choice",
    )
    ap.add_argument("--chains", type=int, default=16, help="sampler chains: min(N, CHAINS) per contender")
    ap.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at once, each pinned to a CPU core of its own (os.sched_setaffinity); K consecutive "
        "runs start together, so contenders side by side share the machine's load",
    )
    ap.add_argument("--smoke", action="store_true", help="chain, tiny GCNN, 2 contenders, 12 s each")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one run, in a process of its own
    ap.add_argument("--e0", type=float, help=argparse.SUPPRESS)  # the exact energy, once known
    ap.add_argument("--pin-core", type=int, help=argparse.SUPPRESS)  # the worker's CPU core
    args = ap.parse_args(argv)
    if args.chains <= 0:
        ap.error(f"--chains {args.chains}: expected a positive number of sampler chains")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.worker:  # a run pinned to its core: the race, not the run, holds the cores
        args.parallel = 1
    if args.parallel < 1 or (args.parallel > 1 and args.parallel > len(cores)):
        ap.error(
            f"--parallel {args.parallel}: expected 1, or at most the {len(cores)} CPU cores this process "
            "may run on (each run gets a core of its own)"
        )
    args.cores = cores[: args.parallel] if args.parallel > 1 else None
    if args.smoke:
        args.problem, args.layers, args.features, args.minutes, args.seeds = "chain", 2, 4, 0.2, [0]
        if args.contenders == list(CONTENDERS):
            args.contenders = ["netket-vmcsr", "vmcgrad-vmcsr"]
        args.n = args.n or ["netket-vmcsr=64:32", "vmcgrad-vmcsr=128:auto"]
        args.budget_mib = min(args.budget_mib, 16.0)
    sizes = dict(DEFAULT_N)
    for item in args.n:
        name, sep, value = item.partition("=")
        if not sep or name not in CONTENDERS:
            ap.error(f"--n {item!r}: expected NAME=N[:CHUNK] with NAME one of {', '.join(CONTENDERS)}")
        sizes[name] = value
    args.sizes = {}
    for name, value in sizes.items():
        n, _, chunk = value.partition(":")
        try:
            n = int(n)
            chunk = None if chunk in ("", "none") else ("auto" if chunk == "auto" else int(chunk))
        except ValueError:
            ap.error(f"--n {name}={value!r}: N must be an int and CHUNK an int, 'auto' or 'none'")
        if n <= 0 or (isinstance(chunk, int) and chunk <= 0):
            ap.error(f"--n {name}={value!r}: N and CHUNK must be positive")
        if chunk == "auto" and not name.startswith("vmcgrad"):
            ap.error(f"--n {name}={value!r}: chunk 'auto' is vmcgrad's; give NetKet's contenders a number")
        args.sizes[name] = (n, chunk)
    return args


# --- the problem -------------------------------------------------------------------------------


def build_problem(args, exact=True):
    """``(hilbert, graph, hamiltonian, exact_energy)`` of ``args.problem`` (the energy None when not
    ``exact``: Lanczos is skipped)."""
    import netket as nk

    if args.problem == "chain":
        g = nk.graph.Chain(12, pbc=True)
        g2 = nk.graph.Graph(edges=[(i, (i + 2) % 12, 1) for i in range(12)] + [(*e, 0) for e in g.edges()])
        graph, J = g2, [1.0, 0.5]
    elif args.problem == "j1j2":
        g = nk.graph.Square(4)
        graph = nk.graph.Square(4, max_neighbor_order=2)
        J = [1.0, 0.5]
    else:
        g = graph = nk.graph.Square(6)
        J = [1.0]
    hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
    # Marshall's sign rule on the nearest-neighbour bonds (NetKet's J1-J2 tutorial): a unitary change
    # of basis, so the same spectrum (E0 below), and a ground state whose signs a GCNN reaches.
    # Without it every contender settled at a relative error of 0.65 on j1j2 (E ~ -11.9, its variance
    # ~0.5), and at 0.67 on the chain.
    H = nk.operator.Heisenberg(hi, graph, J=J, sign_rule=[True] + [False] * (len(J) - 1))
    if not exact:
        e0 = None
    elif args.problem == "heisenberg6":
        e0 = E0_6x6
    else:
        e0 = float(nk.exact.lanczos_ed(H, k=1)[0])
    return hi, g, H, e0


def build_model(args, g):
    import jax.numpy as jnp
    import netket as nk

    dt = jnp.dtype(args.dtype)
    if args.model == "gcnn":
        features = (args.features,) * args.layers
        return nk.models.GCNN(symmetries=g, layers=args.layers, features=features, param_dtype=dt)
    from benchlib import ViT

    L = math.isqrt(g.n_nodes)
    return ViT(L=L, param_dtype=dt)


def mib_or_default(mib: float | None) -> int | None:
    """A budget in MiB as bytes, or None (vmcgrad's default budget: half the device's free memory
    where it reports it, else 2 GiB)."""
    return None if mib is None else int(mib * MiB)


def build_driver(args, name, seed, hi, g, H, model):
    """The driver of contender ``name`` at its (N, chunk), and its state."""
    import jax
    import netket as nk
    import optax

    import vmcgrad.netket as vnk

    n, chunk = args.sizes[name]
    budget = mib_or_default(args.budget_mib)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=min(n, args.chains), d_max=2)
    common = dict(n_samples=n, n_discard_per_chain=4, seed=seed, sampler_seed=seed + 1000)
    opt = optax.sgd(args.lr)
    if name.startswith("vmcgrad"):
        vs = vnk.MCState(sampler, model, chunk_size=chunk, memory_budget=budget, **common)
    else:
        vs = nk.vqs.MCState(sampler, model, chunk_size=chunk, **common)
    if name in ("netket-sr-cg", "vmcgrad-sr"):
        if name == "netket-sr-cg":
            sr = nk.optimizer.SR(
                qgt=nk.optimizer.qgt.QGTOnTheFly,
                solver=jax.scipy.sparse.linalg.cg,
                diag_shift=args.diag_shift,
            )
        else:
            sr = vnk.SR(diag_shift=args.diag_shift)
        return nk.driver.VMC(H, opt, variational_state=vs, preconditioner=sr), vs
    kw = dict(diag_shift=args.diag_shift, variational_state=vs, use_ntk=True)
    if name == "vmcgrad-vmcsr":
        return vnk.VMC_SR(H, opt, chunk_size_bwd=chunk, memory_budget=budget, **kw), vs
    if name == "vmcgrad-vmcsr-grow":
        grow = vnk.GrowSamples(max_samples=args.grow_max, window=args.grow_window)
        return vnk.VMC_SR(H, opt, chunk_size_bwd=chunk, memory_budget=budget, grow_samples=grow, **kw), vs
    return nk.driver.VMC_SR(H, opt, chunk_size_bwd=chunk, on_the_fly=name.endswith("otf"), **kw), vs


def log_psi(vs):
    """The state's log-amplitude as vmcgrad takes it (:func:`benchlib.log_psi`, vmcgrad.netket's own)
    of ``vs.model.apply``: for the flax models here the module NetKet applies, on a batch of samples
    the function NetKet's kernels call (``MCState``'s apply function adds only the scalar output of a
    single sample)."""
    import benchlib

    return benchlib.log_psi(vs.model.apply, vs.model_state)


def kernel_bytes(args, name, driver, vs, H):
    """Per-device compiled bytes of the SR phase at the contender's N, for the Hamiltonian ``H`` the
    driver optimises: the sample-space kernel and its solve (``VMC_SR``), or the QGT's CG solve of the
    gradient, as the driver's preconditioner builds the QGT (``VMC`` + ``SR``); None for a contender
    without one. Compile only."""
    import vmcgrad

    lowered = kernel_lowered(args, name, driver, vs, H)
    return None if lowered is None else vmcgrad.program_bytes(lowered.compile())


def kernel_lowered(args, name, driver, vs, H, call=None):
    """The lowered (not compiled) program of :func:`kernel_bytes`, or None. With ``call`` (a list),
    the compiled program's dynamic arguments ``(args, kwargs)`` are appended to it: what runs it."""
    import jax
    import netket as nk

    import vmcgrad

    if name in ("netket-sr-cg", "vmcgrad-sr"):
        sr = getattr(driver.preconditioner, "timed", driver.preconditioner)
        qgt = sr.lhs_constructor(vs, 0)  # NetKet's QGTOnTheFly, or vmcgrad's at the state's budget
        _, grad = vs.expect_and_grad(H)
        if call is not None:
            call.append(((qgt, grad), {}))
        return jax.jit(lambda q, g: q.solve(sr.solver, g)[0]).lower(qgt, grad)
    samples = jax.lax.collapse(vs.samples, 0, vs.samples.ndim - 1)
    e = vs.local_estimators(H).reshape(-1)
    mode = str(driver.mode)
    if name.startswith("vmcgrad-vmcsr"):  # (-grow: at the N it ended with)
        logpsi = log_psi(vs)

        def update(w, x, e):
            return vmcgrad.minsr_update(
                logpsi,
                w,
                x,
                e,
                diag_shift=args.diag_shift,
                mode=mode,
                chunk_size=driver.chunk_size_bwd,
                memory_budget=mib_or_default(args.budget_mib),
            )[0]

        lowered = jax.jit(update).lower(vs.parameters, samples, e)
        dynamic = (vs.parameters, samples, e), {}
    elif name.startswith("netket-vmcsr"):
        from netket._src.ngd.sr_srt_common import _sr_srt_common
        from netket._src.ngd.srt_onthefly import srt_onthefly

        kernel = (srt_onthefly if name.endswith("otf") else _sr_srt_common).__wrapped__
        kw = dict(
            diag_shift=args.diag_shift,
            solver_fn=nk.optimizer.solver.cholesky_with_fallback,
            mode=mode,
            chunk_size=driver.chunk_size_bwd,
        )
        if not name.endswith("otf"):
            kw["use_ntk"] = True
        # the kernels take NetKet's log_psi(variables, x): the flax module's apply
        lowered = kernel.lower(vs.model.apply, e, vs.parameters, vs.model_state, samples, **kw)
        dynamic = (e, vs.parameters, vs.model_state, samples), {"diag_shift": args.diag_shift}
    else:
        return None
    if call is not None:
        call.append(dynamic)
    return lowered


def setup_jax(platform, x64):
    """JAX for one worker: ``platform`` (None: JAX's choice), one CPU device, NetKet imported, and
    ``jax_enable_x64`` set to ``x64``.

    ``--dtype float32`` runs with x64 off, so that local energies and the solve are single precision
    too: on a TPU float64 is emulated, slowly, and float64 solves raise. The CPU device count only
    shapes the CPU backend: on an accelerator NetKet's mesh is ``jax.devices()``, the accelerator's
    devices.
    """
    import jax
    from benchlib import use_cpu_devices

    if platform:
        jax.config.update("jax_platforms", platform)
    os.environ["NETKET_ENABLE_X64"] = "1" if x64 else "0"
    try:
        use_cpu_devices(1)  # float64 on, NetKet imported
    except AttributeError:  # a JAX without the jax_num_cpu_devices option: its default is one device
        import netket  # noqa: F401
    jax.config.update("jax_enable_x64", x64)


def device_peak_bytes():
    """The first device's allocator peak in bytes (``memory_stats()["peak_bytes_in_use"]``), or None
    where the device keeps no such statistics (the CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # not implemented on this platform or JAX version
        return None
    peak = (stats or {}).get("peak_bytes_in_use")
    return int(peak) if peak is not None else None


def worker(args, name, seed, trace_path):
    """One run: steps until ``args.minutes`` have passed (at least one, however long the set-up took);
    a JSON line per step into ``trace_path``."""
    import resource

    import jax

    setup_jax(args.platform, x64=args.dtype == "float64")

    # The exact energy is the race's reference, not part of a user's run: the clock starts after it
    # (Lanczos took 3.5 s on the 4x4 J1-J2 model here, 148 s on a TPU machine's host), and the race
    # computes it once (the first run's trace gives it to the others, ``--e0``).
    hi, g, H, e0 = build_problem(args, exact=args.e0 is None)
    e0 = args.e0 if args.e0 is not None else e0
    start = time.perf_counter()
    model = build_model(args, g)
    driver, vs = build_driver(args, name, seed, hi, g, H, model)
    phases, is_vmc = instrument(driver, vs)
    limit = args.minutes * 60
    with open(trace_path, "w") as f:
        d = jax.devices()[0]
        device = f"{jax.device_count()} x {d.platform} {d.device_kind}"
        head = {
            "e0": e0,
            "n_params": vs.n_parameters,
            "n": vs.n_samples,
            "device": device,
            "x64": bool(jax.config.jax_enable_x64),
        }
        f.write(json.dumps(head) + "\n")
        n_steps = 0
        while n_steps < 1 or time.perf_counter() - start < limit:  # at least one step, then the limit
            n = vs.n_samples  # this step's N (VMC_SR's grow_samples may raise it for the next step)
            loss, total = timed_step(driver, vs, phases, is_vmc)
            row = {
                "t": time.perf_counter() - start,
                "step_s": total,
                "E": float(loss.mean.real),
                "E_err": float(loss.error_of_mean),
                "var": float(loss.variance),
                "n": int(n),
                **{f"{k}_s": v for k, v in phases.items()},
            }
            f.write(json.dumps(row) + "\n")
            f.flush()
            n_steps += 1
        try:
            kb = kernel_bytes(args, name, driver, vs, H)
        except Exception as err:  # a kernel that cannot be lowered apart: say why, keep the run
            kb = f"{type(err).__name__}: {str(err)[:100]}"
        chunk = getattr(driver, "chunk_size_bwd", None) or getattr(vs, "vmcgrad_chunk_size", vs.chunk_size)
        if chunk == "auto":  # the gradient pass's chunk at the state's budget, as the state chooses it
            import vmcgrad

            flat = jax.lax.collapse(vs.samples, 0, vs.samples.ndim - 1)
            budget = getattr(vs, "vmcgrad_memory_budget", None)
            chunk = (
                f"auto ({vmcgrad.auto_chunk_size(log_psi(vs), vs.parameters, flat, memory_budget=budget)})"
            )
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        tail = {"kernel_bytes": kb, "peak_rss": peak, "device_peak": device_peak_bytes(), "chunk": str(chunk)}
        f.write(json.dumps(tail) + "\n")


def instrument(driver, vs):
    """``(phases, is_vmc)``: the state's sampling and local energies (``VMC_SR``) or
    ``expect_and_grad`` and the preconditioner (``VMC`` + SR) wrapped so that each call adds its
    seconds to ``phases`` (``"sample"``, ``"local"``, ``"sr"``), for :func:`timed_step`."""
    import jax
    import netket as nk

    phases = {"sample": 0.0, "local": 0.0, "sr": 0.0}

    def timed(phase, fun):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = jax.block_until_ready(fun(*a, **kw))
            phases[phase] += time.perf_counter() - t
            return out

        wrapper.timed = fun  # kernel_bytes lowers the driver's own preconditioner
        return wrapper

    vs.sample = timed("sample", vs.sample)
    is_vmc = isinstance(driver, nk.driver.VMC)
    if is_vmc:  # VMC: expect_and_grad, then the preconditioner
        vs.expect_and_grad = timed("local", vs.expect_and_grad)
        driver.preconditioner = timed("sr", driver.preconditioner)
    else:  # VMC_SR: local energies, then the kernel and solve (the rest of the update)
        vs.local_estimators = timed("local", vs.local_estimators)
    return phases, is_vmc


def timed_step(driver, vs, phases, is_vmc):
    """One step of NetKet's ``driver.run`` loop on a driver :func:`instrument` wrapped: ``(loss,
    seconds)``, and ``phases`` set to this step's (the SR phase of ``VMC_SR`` is the step less the
    other two).

    The step count ``driver.run`` would also advance (no public setter) is left at 0: it feeds only
    schedules of diag_shift, proj_reg and momentum (constants here; the optimiser counts its own
    steps) and the step label of vmcgrad's ``VMC_SR.grown``, which the race does not read."""
    import jax

    for k in phases:
        phases[k] = 0.0
    t = time.perf_counter()
    driver.reset_step()
    if not is_vmc:  # VMC_SR reads the samples inside local_estimators: sample them first
        vs.samples  # noqa: B018
    loss, dp = driver.compute_loss_and_update()
    jax.block_until_ready(dp)
    total = time.perf_counter() - t
    if is_vmc:  # VMC resets and samples inside expect_and_grad
        phases["local"] -= phases["sample"]
    else:
        phases["sr"] = total - phases["sample"] - phases["local"]
    driver.update_parameters(dp)
    return loss, total


# --- the race ----------------------------------------------------------------------------------


def run_one(args, name, seed, out: Path, core: int | None = None) -> Path:
    trace = out / f"trace-{name}-seed{seed}.jsonl"
    argv = [sys.argv[0], *[a for a in sys.argv[1:] if a != "--smoke"], "--worker", f"{name},{seed},{trace}"]
    if args.smoke:
        argv.append("--smoke")
    if args.e0 is not None:
        argv += ["--e0", repr(args.e0)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    timeout = args.minutes * 60 + 600  # the last step and the kernel's compile may run past the limit
    if core is not None:  # the worker pins itself before JAX starts (XLA sizes its pool by it)
        argv += ["--pin-core", str(core)]
    proc = subprocess.run([sys.executable, *argv], env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"time_to_energy: {name} seed {seed} failed (exit status {proc.returncode}):\n"
            + proc.stderr[-3000:]
        )
    if args.e0 is None:  # the next runs take the exact energy from this one
        args.e0 = json.loads(trace.read_text().splitlines()[0])["e0"]
    return trace


def summarise(name, seed, trace: Path, window: int) -> dict:
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    head, steps, tail = lines[0], lines[1:-1], lines[-1]
    e0 = head["e0"]
    rel = [abs((s["E"] - e0) / e0) if math.isfinite(s["E"]) else math.inf for s in steps]
    running = [statistics.fmean(rel[max(0, i - window + 1) : i + 1]) for i in range(len(rel))]
    last = [s["E"] for s in steps[-window:]]
    final = abs((statistics.fmean(last) - e0) / e0) if last else None
    if not all(math.isfinite(x) for x in last):  # diverged: no error bar, an infinite error
        final, final_err = math.inf, None
    else:
        final_err = statistics.stdev(last) / math.sqrt(len(last)) / abs(e0) if len(last) > 1 else None
    reach = {}
    for target in TARGETS:
        ok = (s["t"] for i, (s, r) in enumerate(zip(steps, running)) if i >= window - 1 and r <= target)
        hit = next(ok, None)
        reach[f"t_{target:g}"] = hit
    med = lambda k: statistics.median(s[k] for s in steps) if steps else None
    return {
        "contender": name,
        "seed": seed,
        "N": head["n"]
        if not steps or steps[-1].get("n", head["n"]) == head["n"]
        else f"{head['n']}→{steps[-1]['n']}",
        "P": head["n_params"],
        "chunk": tail.get("chunk"),
        "steps": len(steps),
        "first_step_s": steps[0]["t"] if steps else None,
        **reach,
        "best_rel": min(running) if running else None,
        "final_rel": final,
        "final_rel_err": final_err,
        "step_s": med("step_s"),
        "sample_s": med("sample_s"),
        "local_s": med("local_s"),
        "sr_s": med("sr_s"),
        "kernel_mib": tail["kernel_bytes"] / MiB if isinstance(tail["kernel_bytes"], int) else None,
        "kernel_error": tail["kernel_bytes"] if isinstance(tail["kernel_bytes"], str) else None,
        "peak_rss_mib": tail["peak_rss"] / MiB,
        "device": head.get("device"),
        "device_peak_mib": tail["device_peak"] / MiB if tail.get("device_peak") is not None else None,
        "curve": [(s["t"], r) for s, r in zip(steps, running)],
    }


def race_table(rows) -> str:
    """The race's table (:func:`benchlib.table`): one line per (contender, seed); the device's
    allocator peak only where an accelerator reports one."""
    from benchlib import Column, table

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    columns = [
        Column("contender", "contender", align="<"),
        Column("seed", "seed"),
        Column("N", "N"),
        Column("chunk", "chunk"),
        Column("steps", "steps"),
        *(Column(f"t→{t:g} (s)", f"t_{t:g}", ".0f") for t in TARGETS),
        Column("best rel", "best_rel", ".2e"),
        Column("final rel ± err", lambda r: f"{f(r['final_rel'], '.2e')} ± {f(r['final_rel_err'], '.1e')}"),
        Column("step (s)", "step_s", ".2f"),
        Column(
            "sample / local / SR (s)",
            lambda r: " / ".join(f(r[k], ".2f") for k in ("sample_s", "local_s", "sr_s")),
        ),
        Column("kernel MiB", "kernel_mib", ".1f"),
        Column("peak RSS MiB", "peak_rss_mib", ".0f"),
    ]
    if any(r.get("device_peak_mib") is not None for r in rows):  # an accelerator's allocator
        columns.append(Column("device peak MiB", "device_peak_mib", ".0f"))
    return table(rows, columns)


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from benchlib import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {c: f"C{i}" for i, c in enumerate(CONTENDERS)}
    for r in rows:
        if r["curve"]:
            t, e = zip(*r["curve"])
            ax.plot(
                [x / 60 for x in t],
                e,
                color=colours[r["contender"]],
                ls="-" if r["seed"] % 2 == 0 else "--",
                label=f"{r['contender']} N={r['N']} seed {r['seed']}",
            )
    ax.set(xlabel="wall time (min)", ylabel="relative error (running mean)", yscale="log", title=title)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def write_report(args, rows, failures, out: Path) -> str:
    """Writes table.md, results.json and energy.png of the runs so far into ``out``; returns the table."""
    from benchlib import write_json

    rows = sorted(rows, key=lambda r: (CONTENDERS.index(r["contender"]), r["seed"]))
    title = f"{args.problem} {args.model}, {args.budget_mib:g} MiB per device, {args.minutes:g} min"
    devices = sorted({r["device"] for r in rows if r.get("device")})
    text = (
        f"{title}"
        + (f", device: {'; '.join(devices)}" if devices else "")
        + f"\n\n```\n{race_table(rows)}\n```\n"
    )
    if failures:
        text += "\nfailed: " + "; ".join(f"{name} seed {seed}" for name, seed, _ in failures) + "\n"
    (out / "table.md").write_text(text)
    config = {k: v for k, v in vars(args).items() if k != "sizes"}
    failed = [{"contender": name, "seed": seed, "error": error} for name, seed, error in failures]
    write_json({"config": config, "rows": rows, "failed": failed}, out / "results.json")
    plot(rows, out / "energy.png", title)
    return text


def main(argv=None):
    args = parse(argv)
    if args.worker:
        if args.pin_core is not None:
            os.sched_setaffinity(0, {args.pin_core})
        name, seed, trace = args.worker.split(",", 2)
        worker(args, name, int(seed), trace)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, failures = [], []
    jobs = [  # alternate who runs first
        (name, seed)
        for i, seed in enumerate(args.seeds)
        for name in (args.contenders if i % 2 == 0 else args.contenders[::-1])
    ]

    lock = threading.Lock()

    def one(job, core=None):
        name, seed = job
        print(f"time_to_energy: {name} seed {seed} N={args.sizes[name][0]} ...", flush=True)
        try:
            row = summarise(name, seed, run_one(args, name, seed, out, core), args.window)
        except (RuntimeError, subprocess.TimeoutExpired) as err:  # report it; the others still run
            print(err, flush=True)
            failures.append((name, seed, str(err)[-3000:]))
            return
        with lock:  # runs side by side finish apart, but one may finish while another reports
            rows.append(row)
            print(race_table([row]), flush=True)
            write_report(args, rows, failures, out)  # a race stopped later keeps this run

    if args.cores is None:
        for job in jobs:
            one(job)
    else:  # len(cores) runs at once, a core each; the next batch starts when the whole batch is done
        from concurrent.futures import ThreadPoolExecutor

        k = len(args.cores)
        with ThreadPoolExecutor(k) as pool:
            for b in range(0, len(jobs), k):
                list(pool.map(one, jobs[b : b + k], args.cores))
    text = write_report(args, rows, failures, out)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
