"""``vmcgrad vmc``: a ground-state search with NetKet's sampler and driver and vmcgrad's gradients and SR.

One step is NetKet's ``nk.driver.VMC`` with an ``nk.optimizer.SR`` preconditioner: sample, then

.. math::

    F = \\frac{1}{N}\\sum_i O_i^* (E_{loc}(\\sigma_i) - \\bar E), \\qquad
    (S + \\epsilon)\\,\\delta\\theta = F, \\qquad \\theta \\leftarrow \\theta - \\eta\\,\\delta\\theta,

with the force :math:`F` from :class:`vmcgrad.netket.MCState` and the products :math:`S v` from
:class:`vmcgrad.netket.QGTOnTheFly` (chunked, sharded over the devices, one reduction each).
After every step ``DIR/log.json`` is rewritten atomically (strict JSON: a NaN, such as the error of
the mean of too few samples per chain, is written as null and listed under ``"nonfinite"``), so an
interrupted run keeps every completed step; ``DIR/energy.png`` follows every few seconds and at the end.
``DIR`` is locked for the run (a second run into it exits with status 2 at once). The first Ctrl-C stops
after the step in progress; a second one ends the process at once, even during a compilation, keeping
the log (:mod:`._interrupt`). A file that cannot be written (full disk, ...) stops the run after the
step with a one-line error and status 1; the log then holds every step written before.
With ``--chunk-size auto`` the chunks (and the QGT product's design) are picked once, before the first
step, and printed.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import vmcgrad

from .. import __version__
from . import (
    _checkpoint,
    _distributed,
    _interrupt,
    _output,
    _phases,
    _report,
    _resume,
    _systems,
    _user_problem,
)
from ._args import HelpFormatter, byte_size, chunk_size, non_negative_float, positive_float, positive_int

#: Samples per Metropolis chain are at least this many: chains per device = min(16, samples / devices / this).
_CHAINS_PER_DEVICE = 16
#: The optimisation drivers of ``--driver``.
DRIVERS = {
    "sr": "nk.driver.VMC with SR in parameter space (vmcgrad's QGTOnTheFly products, CG)",
    "minsr": "vmcgrad.netket.VMC_SR: sample-space SR (MinSR), by the fastest route that fits the budget",
}
#: The modules this command imports beyond vmcgrad's own (the ``[cli]`` extra), checked before it starts.
REQUIRES = ("netket", "matplotlib", "tqdm")
#: What a run writes in ``--out``.
FILES = ("log.json", "energy.png", _checkpoint.CHECKPOINT, _checkpoint.PARAMS)


def add_parser(commands) -> None:
    """Adds the ``vmc`` sub-command and its options to ``commands`` (an argparse sub-parsers object)."""
    p = commands.add_parser(
        "vmc",
        help="find a ground state with VMC + SR (NetKet sampler and driver, vmcgrad gradients)",
        description=(
            "Ground-state search with NetKet's Metropolis sampler and VMC driver, SR preconditioning, and "
            "vmcgrad's chunked, sharded gradients and QGT products. The defaults run the Heisenberg chain "
            "L=16 to within 1e-3 of the exact energy in well under 90 s on two CPU cores."
        ),
        epilog=_systems.defaults_help(),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--system",
        type=_user_problem.option_type(_systems.SYSTEMS, "system"),
        default="heisenberg1d",
        metavar="SYSTEM",
        help=f"lattice model: {', '.join(_systems.SYSTEMS)}, or MODULE:FACTORY, a function in a module or "
        ".py file that returns your own (docs/cli.md)",
    )
    p.add_argument(
        "--L",
        type=positive_int,
        default=_systems.PER_SYSTEM,
        help="linear size: sites of a chain, side of a square",
    )
    p.add_argument(
        "--model",
        type=_user_problem.option_type(_systems.MODELS, "model"),
        default=_systems.PER_SYSTEM,
        metavar="MODEL",
        help=f"network for log ψ: {', '.join(_systems.MODELS)}, or MODULE:FACTORY, a function that "
        "returns your own flax module",
    )
    p.add_argument(
        "--samples", type=positive_int, default=_systems.PER_SYSTEM, help="Monte Carlo samples per step"
    )
    p.add_argument(
        "--chunk-size",
        type=chunk_size,
        default=_systems.PER_SYSTEM,
        help="samples per chunk in the gradient and QGT loops: a positive integer (no divisibility) or auto",
    )
    p.add_argument("--steps", type=positive_int, default=120, help="optimisation steps")
    p.add_argument(
        "--driver",
        choices=tuple(DRIVERS),
        default="sr",
        help="; ".join(f"{k}: {v}" for k, v in DRIVERS.items()),
    )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        default=None,
        metavar="BYTES",
        help="bytes per device (e.g. 64MiB): every chunk is chosen to fit it (--chunk-size is then auto)",
    )
    p.add_argument(
        "--grow-samples",
        type=positive_int,
        default=None,
        metavar="MAX",
        help="with --driver minsr: double the samples whenever the energy settles to its error bar over 20 "
        "steps, up to MAX and to what --memory-budget holds (vmcgrad.netket.GrowSamples)",
    )
    p.add_argument(
        "--minutes",
        type=positive_float,
        default=None,
        help="stop after the step that passes this many minutes of the run (a checkpoint is written)",
    )
    p.add_argument(
        "--lr", type=positive_float, default=_systems.PER_SYSTEM, help="learning rate (SGD on the SR update)"
    )
    p.add_argument(
        "--diag-shift", type=non_negative_float, default=_systems.PER_SYSTEM, help="SR diagonal shift"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the parameters and the sampler")
    p.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="fake this many CPU devices to try sharding (per process with --coordinator); None: JAX's own",
    )
    p.add_argument(
        "--out",
        default="vmcgrad-run",
        metavar="DIR",
        help="output directory (log.json, energy.png, checkpoint.mpack, params.mpack)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=_report.CHECKPOINT_EVERY,
        metavar="K",
        help="write DIR/checkpoint.mpack (the whole state) and DIR/params.mpack every K steps and at the end",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run whose checkpoint is in DIR (its options are used; --steps may be raised)",
    )
    _distributed.add_arguments(p)
    p.set_defaults(_command=sys.modules[__name__], _parser=p)


def check(args, parser) -> None:
    """Checks the options that depend on each other or on the file system; creates nothing.

    With ``--resume DIR`` the checkpoint in ``DIR`` is read and checked, and the options not given on
    the command line are taken from it; one given that changes the problem is refused, with the list.
    """
    if args.resume is not None:
        _resume.resume_options(args, parser)
    elif args.memory_budget is not None and "chunk_size" not in _resume.given_options(args, parser):
        args.chunk_size = "auto"  # a budget alone chooses every chunk
    _systems.fill_defaults(args)
    if args.grow_samples is not None and args.driver != "minsr":
        parser.error(
            "argument --grow-samples: needs --driver minsr (sample-space SR holds N within a budget)"
        )
    problem = _systems.size_problem(args.system, args.L)
    if problem:
        parser.error(f"argument --L: {problem}")
    _distributed.check(args, parser)
    if not args.process_id:  # only process 0 writes (the others may not even see the same disk)
        problem = _output.problem_with_out_dir(Path(args.out), FILES)
        if problem:
            parser.error(f"argument --out: {problem}")
        checkpoint = Path(args.out) / _checkpoint.CHECKPOINT
        if args.resume is None and checkpoint.exists():
            parser.error(
                f"argument --out: {args.out} holds the checkpoint of another run; continue it with "
                f"`--resume {args.out}`, choose another --out, or delete {checkpoint} to start over"
            )


def config_of(args) -> dict:
    """The options of this run, as given (private argparse defaults left out)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def out_dir(args) -> Path | None:
    """The directory this process writes (and locks): ``--out`` on process 0, None on the others."""
    return None if args.process_id else Path(args.out)


def run(args) -> int:
    """Runs the optimisation; returns the exit status (0, or 130 when interrupted).

    Raises:
        _output.OutputError: when a file of ``--out`` could not be written (after stopping the run;
            ``log.json`` then keeps every step written before).
    """
    t_start = time.perf_counter()
    kept: dict = {}  # the recorder, once there is one: what a second Ctrl-C writes before leaving
    interrupts = _interrupt.Interrupts(
        "vmcgrad vmc", "stopping after this step (Ctrl-C again to stop at once)", lambda: _report.keep(kept)
    )
    with interrupts:
        try:
            return _run(args, interrupts, kept, t_start)
        except Exception as error:  # a failure before the recorder existed: a log that says so
            if "recorder" not in kept and not isinstance(error, _checkpoint.CheckpointError):
                mark_log(args, "failed", _report.describe(error))
            raise


def mark_log(args, status: str, error: str | None) -> str | None:
    """Sets ``status`` (and ``error``) in ``--out/log.json``, keeping the steps it holds, or writes a log
    without steps when there is none; for a process that cannot (JAX aborted it) or a run that failed
    before its first log. Process 0 only (the others write nothing).

    Returns:
        A note for the user: what the log keeps, or why it could not be written; None on other processes.
    """
    if args.process_id:
        return None
    path = Path(args.out) / "log.json"
    log = None
    try:
        log = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if not isinstance(log, dict) or not isinstance(log.get("energy_mean"), list):
        log = {
            **{key: [] for key in _report.STEP_KEYS},
            **{key: None for key in ("exact_energy", "final_energy", "relative_error")},
            "config": config_of(args),
            "info": None,
        }
    log.update(status=status, error=error)
    try:
        _output.write_json_atomic(path, log)
    except _output.OutputError as failure:
        return str(failure)
    return f"{path} keeps the {len(log['energy_mean'])} steps run"


def _run(args, interrupts: _interrupt.Interrupts, kept: dict, t_start: float) -> int:
    import jax
    import netket as nk

    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    import vmcgrad.netket as vnk

    # Under the distributed runtime every process runs the same steps on global arrays; process 0 alone
    # prints, shows the progress and writes the files.
    main = jax.process_index() == 0
    system, model = _user_problem.system_and_model(args)  # a user's that does not fit: one line, exit 2
    n_devices = jax.device_count()  # all processes' devices
    per_device = max(1, min(_CHAINS_PER_DEVICE, args.samples // n_devices))
    n_chains = per_device * n_devices
    n_samples = math.ceil(args.samples / n_chains) * n_chains  # what NetKet would round to
    vstate = vnk.MCState(
        system.make_sampler(n_chains),
        model,
        n_samples=n_samples,
        n_discard_per_chain=8,
        chunk_size=None if args.chunk_size == "auto" else args.chunk_size,
        memory_budget=args.memory_budget,
        seed=args.seed,
        sampler_seed=args.seed + 1,
    )
    snap = getattr(args, "_checkpoint", None)
    driver, route = None, None
    if args.driver == "minsr":  # its route, before anything is sampled: a budget no route fits stops here
        kernel = args.chunk_size if snap is None else snap["info"]["chunk_size"]["kernel"]
        driver = _driver(args, system, vstate, {"kernel": kernel}, "-")
        route = _phases.route_or_exit(args, driver, n_samples)
    if snap is None:
        chunks, qgt_design = _chunk_sizes(args.chunk_size, vstate, args.memory_budget, args.driver)
    else:  # the chunks the run was started with (auto's pick could differ now, and change the numbers)
        chunks, qgt_design = snap["info"]["chunk_size"], snap["info"]["qgt_design"]
    vstate.vmcgrad_chunk_size = chunks["gradient"]
    exact, exact_source = _systems.exact_energy(args.system, args.L, system) if main else (None, None)
    e_inf = None  # without an exact energy the run reports the V-score, which needs Tr H / dim
    if main and exact is None:
        value, error, source = _systems.infinite_temperature_energy(system.hilbert, system.hamiltonian)
        e_inf = {"value": value, "error": error, "source": source}

    info = {
        "description": system.description,
        "n_sites": system.n_sites,
        "n_parameters": int(vstate.n_parameters),
        "n_samples": n_samples,
        "n_chains": n_chains,
        "n_devices": n_devices,
        "n_processes": jax.process_count(),
        "chunk_size": chunks,
        "qgt_design": qgt_design,
        "driver": DRIVERS[args.driver],
        "route": route,
        "memory_budget": args.memory_budget,
        "exact_energy_source": exact_source,
        "infinite_temperature_energy": e_inf,
        "versions": {"vmcgrad": _version(), "netket": nk.__version__, "jax": jax.__version__},
        "resumed_at": [] if snap is None else [*snap["info"].get("resumed_at", []), int(snap["step"])],
    }
    if main:
        _report.print_header(args, info, exact, exact_source)

    if driver is None:
        driver = _driver(args, system, vstate, chunks, qgt_design)

    if snap is not None:
        if main:
            print(f"resuming from step {snap['step']} of {args.out}/{_checkpoint.CHECKPOINT}")
        _checkpoint.restore(driver, snap, Path(args.out) / _checkpoint.CHECKPOINT)

    out = Path(args.out)
    if main:
        _output.remove_stale_temporaries(out, FILES)
    recorder = _report.Recorder(
        out,
        config_of(args),
        info,
        exact,
        args.steps,
        interrupts,
        main=main,
        driver=driver,
        phases=_phases.PhaseBytes(vstate, chunks, qgt_design, args.memory_budget, args.diag_shift),
        checkpoint_every=args.checkpoint_every,
        records=[] if snap is None else snap["records"][: int(snap["step"])],
        deadline=None if args.minutes is None else t_start + 60 * args.minutes,
    )
    kept["recorder"] = recorder
    recorder.write()
    status = "interrupted"
    try:
        if not (interrupts.requested or recorder.failed):  # Ctrl-C (or a full disk) during the set-up
            driver.run(
                args.steps - len(recorder.records),
                callback=[recorder, _report.after_step(recorder)],
                show_progress=False,
            )
            status = "finished"
    except _report.StopRequested:
        if recorder.time_up:
            status = "time limit"
    except Exception as error:  # not an interrupt: the log says what failed
        status, recorder.error = "failed", _report.describe(error)
        raise
    finally:
        recorder.close("failed" if recorder.failed else status)
    n = len(recorder.records)
    if not main:  # the same energies as process 0: they come from global, replicated arrays
        if n:
            print(
                f"process {jax.process_index()} of {jax.process_count()}: {status} after {n} steps, "
                f"final energy {recorder.final_energy!r}; process 0 wrote the log"
            )
        return 130 if status == "interrupted" else 0
    if recorder.relative_error is not None:
        print(
            f"final energy {recorder.final_energy:.6f} (mean of the last {recorder.n_final} steps), "
            f"exact {exact:.6f}, relative error {recorder.relative_error:.2e}"
        )
    elif n:
        print(
            f"final energy {recorder.final_energy:.6f} ± {recorder.final_energy_error:.6f}, variance "
            f"{recorder.final_variance:.6f} (means of the last {recorder.n_final} steps), "
            + _report.v_score_text(recorder)
        )
    if recorder.failed:
        raise _output.OutputError(recorder.failure())
    wall = time.perf_counter() - t_start
    if status == "time limit":
        print(
            f"stopped at the --minutes {args.minutes:g} limit after {n} of {args.steps} steps; kept "
            f"{out / 'log.json'} and {out / _checkpoint.CHECKPOINT}; continue with "
            f"`vmcgrad vmc --resume {out}`"
        )
        return 0
    if status == "interrupted":
        print(
            f"interrupted after {n} of {args.steps} steps; kept {out / 'log.json'} and {out / 'energy.png'}; "
            f"continue with `vmcgrad vmc --resume {out}` (from step {recorder.n_checkpoint})"
        )
        return 130
    print(
        f"wrote {out / 'log.json'}, {out / 'energy.png'}, {out / _checkpoint.CHECKPOINT} and "
        f"{out / _checkpoint.PARAMS} in {wall:.1f} s"
    )
    return 0


def _driver(args, system, vstate, chunks: dict, qgt_design: str):
    """The optimisation driver of ``--driver``: NetKet's VMC with SR on vmcgrad's QGT products, or
    vmcgrad's ``VMC_SR`` (MinSR) with its kernel chunk from the budget."""
    import contextlib
    import io

    import netket as nk

    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    import vmcgrad.netket as vnk

    optimizer = nk.optimizer.Sgd(learning_rate=args.lr)
    if args.driver == "sr":
        # at "auto" the solve keeps every chunk's linearisation where the budget holds them
        # (QGTOperator.kept_solve); the products run at the chunk chosen for the design
        auto = {"chunk_size": "auto", "memory_budget": args.memory_budget}
        qgt = vnk.QGTOnTheFly(
            **(auto if args.chunk_size == "auto" else {"chunk_size": chunks["qgt"]}), design=qgt_design
        )
        return nk.driver.VMC(
            system.hamiltonian,
            optimizer,
            variational_state=vstate,
            preconditioner=nk.optimizer.SR(qgt=qgt, diag_shift=args.diag_shift),
        )
    grow = None if args.grow_samples is None else vnk.GrowSamples(max_samples=args.grow_samples)
    with contextlib.redirect_stdout(io.StringIO()):  # NetKet's notes on its own automatic choices
        return vnk.VMC_SR(
            system.hamiltonian,
            optimizer,
            diag_shift=args.diag_shift,
            variational_state=vstate,
            use_ntk=True,
            on_the_fly=False,
            chunk_size_bwd=chunks["kernel"],
            memory_budget=args.memory_budget,
            grow_samples=grow,
        )


def _chunk_sizes(
    chunk_size: int | str, vstate, memory_budget: int | None = None, driver: str = "sr"
) -> tuple[dict[str, int | str], str]:
    """The chunk of the gradient and of the QGT products, and the QGT product's design:
    ``--chunk-size`` and ``"fused"`` (:func:`vmcgrad.QGT`'s design at a given chunk), or for ``auto``
    the largest power of two whose compiled program fits the memory budget, for each of the two
    programs (:func:`vmcgrad.auto_chunk_size` with ``estimator="expect_grad"``; for the QGT the
    ``chunk_size`` and ``design`` of ``vmcgrad.QGT(..., chunk_size="auto")``, which picks the pair
    that is fastest within the budget), on this state's parameters and samples as they are sharded.
    The run's QGT is built with this chunk and design. The shapes do not change during the run, so
    neither does the choice."""
    if chunk_size != "auto":
        if driver == "minsr":
            return {"gradient": chunk_size, "kernel": chunk_size}, "-"
        return {"gradient": chunk_size, "qgt": chunk_size}, "fused"
    import jax

    logpsi = _phases.log_psi(vstate)
    samples = jax.jit(lambda s: s.reshape(-1, s.shape[-1]))(vstate.samples)
    budget = {"memory_budget": memory_budget}
    gradient = vmcgrad.auto_chunk_size(logpsi, vstate.parameters, samples, estimator="expect_grad", **budget)
    if driver == "minsr":  # the kernel's blocks: chosen by vmcgrad.minsr_update at each N, in the budget
        return {"gradient": gradient, "kernel": "auto"}, "-"
    qgt = vmcgrad.QGT(logpsi, vstate.parameters, samples, chunk_size="auto", **budget)  # builds O-bar once
    return {"gradient": gradient, "qgt": qgt.chunk_size, "qgt_solve": qgt.kept_solve}, qgt.design


def _version() -> str:

    return __version__
