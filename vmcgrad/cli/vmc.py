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

from . import _checkpoint, _distributed, _interrupt, _output, _systems, _user_problem
from ._args import HelpFormatter, byte_size, chunk_size, non_negative_float, positive_float, positive_int

#: Samples per Metropolis chain are at least this many: chains per device = min(16, samples / devices / this).
_CHAINS_PER_DEVICE = 16
_PLOT_EVERY_S = 10.0
#: The per-step lists of ``log.json``.
_STEP_KEYS = ("energy_mean", "energy_error", "energy_variance", "acceptance", "step_time", "n_samples")
#: The optimisation drivers of ``--driver``.
DRIVERS = {
    "sr": "nk.driver.VMC with SR in parameter space (vmcgrad's QGTOnTheFly products, CG)",
    "minsr": "vmcgrad.netket.VMC_SR: sample-space SR (MinSR), its N x N kernel built in chunked blocks",
}
#: The modules this command imports beyond vmcgrad's own (the ``[cli]`` extra), checked before it starts.
REQUIRES = ("netket", "matplotlib", "tqdm")
#: What a run writes in ``--out``.
FILES = ("log.json", "energy.png", _checkpoint.CHECKPOINT, _checkpoint.PARAMS)
#: Steps between checkpoints by default: the write costs about a millisecond for the default model,
#: a fraction of a percent of the steps it follows.
CHECKPOINT_EVERY = 10


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
        ".py file that returns your own (docs/getting_started.md)",
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
        default=CHECKPOINT_EVERY,
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
        _resume_options(args, parser)
    elif args.memory_budget is not None and "chunk_size" not in _given_options(args, parser):
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


def _resume_options(args, parser) -> None:
    """``--resume DIR``: reads the checkpoint into ``args._checkpoint`` and sets the options from it."""
    given = _given_options(args, parser)
    if "out" in given and Path(given["out"]) != Path(args.resume):
        parser.error(
            f"argument --out: {args.out!r} with --resume {args.resume!r}: a resumed run writes where its "
            "checkpoint is; leave out --out"
        )
    try:
        snap = _checkpoint.read(Path(args.resume), version=_version())
    except _checkpoint.CheckpointError as error:
        parser.error(f"argument --resume: {error}")
    saved = snap["config"]
    changed = _checkpoint.differences(saved, given)
    if changed:
        parser.error(
            "argument --resume: these options change the problem the checkpoint solves: "
            + "; ".join(changed)
            + " (leave them out to use the checkpoint's, or start a new run with another --out)"
        )
    for key, value in saved.items():
        if key not in given and key not in _checkpoint.MAY_CHANGE and hasattr(args, key):
            setattr(args, key, value)
    if "steps" not in given:
        args.steps = saved["steps"]
    done = int(snap["step"])
    if args.steps <= done:
        parser.error(
            f"argument --steps: the checkpoint in {args.resume} is at step {done} of {saved['steps']}; "
            f"give --steps larger than {done} to continue it"
        )
    args.out = args.resume
    args._checkpoint = snap


_UNSET = object()


def _given_options(args, parser) -> dict:
    """The options of this sub-command that the command line gives (by value), defaults left out."""
    import argparse

    argv = list(getattr(args, "_argv", ()))
    start = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))  # the command
    namespace = argparse.Namespace(**{key: _UNSET for key in vars(args)})
    parser.parse_args(argv[start + 1 :], namespace=namespace)
    return {k: v for k, v in vars(namespace).items() if v is not _UNSET and not k.startswith("_")}


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
        "vmcgrad vmc", "stopping after this step (Ctrl-C again to stop at once)", lambda: _keep(kept)
    )
    with interrupts:
        try:
            return _run(args, interrupts, kept, t_start)
        except Exception as error:  # a failure before the recorder existed: a log that says so
            if "recorder" not in kept and not isinstance(error, _checkpoint.CheckpointError):
                mark_log(args, "failed", _describe(error))
            raise


def _describe(error: BaseException) -> str:
    """``"TypeName: first line of the message"``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


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
            **{key: [] for key in _STEP_KEYS},
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


def _keep(kept: dict) -> str | None:
    """On a second Ctrl-C: the log as it stands, with the status "interrupted"."""
    recorder = kept.get("recorder")
    if recorder is None or not recorder.main:
        return None
    recorder.finish("interrupted")
    recorder.write()
    if recorder.log_error is not None:
        return str(recorder.log_error)
    return f"kept {recorder.out / 'log.json'} ({len(recorder.records)} steps)"


def _run(args, interrupts: _interrupt.Interrupts, kept: dict, t_start: float) -> int:
    import jax
    import netket as nk

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
        "memory_budget": args.memory_budget,
        "exact_energy_source": exact_source,
        "infinite_temperature_energy": e_inf,
        "versions": {"vmcgrad": _version(), "netket": nk.__version__, "jax": jax.__version__},
        "resumed_at": [] if snap is None else [*snap["info"].get("resumed_at", []), int(snap["step"])],
    }
    if main:
        _print_header(args, info, exact, exact_source)

    driver = _driver(args, system, vstate, chunks, qgt_design)

    if snap is not None:
        if main:
            print(f"resuming from step {snap['step']} of {args.out}/{_checkpoint.CHECKPOINT}")
        _checkpoint.restore(driver, snap, Path(args.out) / _checkpoint.CHECKPOINT)

    out = Path(args.out)
    if main:
        _output.remove_stale_temporaries(out, FILES)
    recorder = _Recorder(
        out,
        config_of(args),
        info,
        exact,
        args.steps,
        interrupts,
        main=main,
        driver=driver,
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
                callback=[recorder, _after_step(recorder)],
                show_progress=False,
            )
            status = "finished"
    except _StopRequested:
        if recorder.time_up:
            status = "time limit"
    except Exception as error:  # not an interrupt: the log says what failed
        status, recorder.error = "failed", _describe(error)
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
            + _v_score_text(recorder)
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

    import vmcgrad.netket as vnk

    optimizer = nk.optimizer.Sgd(learning_rate=args.lr)
    if args.driver == "sr":
        qgt = vnk.QGTOnTheFly(chunk_size=chunks["qgt"], design=qgt_design)
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

    import vmcgrad

    apply, model_state = vstate.model.apply, vstate.model_state
    logpsi = jax.tree_util.Partial(lambda ms, w, x: apply({"params": w, **ms}, x), model_state)
    samples = jax.jit(lambda s: s.reshape(-1, s.shape[-1]))(vstate.samples)
    budget = {"memory_budget": memory_budget}
    gradient = vmcgrad.auto_chunk_size(logpsi, vstate.parameters, samples, estimator="expect_grad", **budget)
    if driver == "minsr":  # the kernel's blocks: chosen by vmcgrad.minsr_update at each N, in the budget
        return {"gradient": gradient, "kernel": "auto"}, "-"
    qgt = vmcgrad.QGT(logpsi, vstate.parameters, samples, chunk_size="auto", **budget)  # builds O-bar once
    return {"gradient": gradient, "qgt": qgt.chunk_size}, qgt.design


def _print_header(args, info: dict, exact: float | None, exact_source: str | None) -> None:
    n = info["n_processes"]
    processes = f" in {n} processes" if n > 1 else ""
    chunks = info["chunk_size"]
    other = "qgt" if "qgt" in chunks else "kernel"
    chunk = (
        str(chunks["gradient"])
        if chunks["gradient"] == chunks[other]
        else (f"{chunks['gradient']} (gradient), {chunks[other]} ({other})")
    )
    if args.chunk_size == "auto":
        chunk = f"auto: {chunk}"
    print(
        f"vmcgrad vmc: {info['description']}; "
        f"{args.model} with {info['n_parameters']} parameters; {info['n_samples']} samples in "
        f"{info['n_chains']} chains on {info['n_devices']} device(s){processes}, chunk size "
        f"{chunk}; {args.driver.upper() if args.driver == 'sr' else 'MinSR'} diag_shift {args.diag_shift}, "
        f"lr {args.lr}, {args.steps} steps"
    )
    if args.driver == "minsr":
        budget = "" if args.memory_budget is None else f" within {args.memory_budget} bytes per device"
        grow = (
            ""
            if args.grow_samples is None
            else f"; samples grow up to {args.grow_samples} as the energy settles"
        )
        print(f"driver minsr: {DRIVERS['minsr']}{budget}{grow}")
    elif args.chunk_size == "auto":
        print(
            f"chunk size auto: picked {chunks['gradient']} for the gradient and {chunks['qgt']} "
            f"({info['qgt_design']} design) for the QGT products (the largest powers of two whose "
            "compiled programs fit the memory budget; the QGT's design is the faster one within it)"
        )
    if exact is None:
        why = (
            "not given by the system factory"
            if _systems.is_user_system(args.system)
            else f"not in the table; Lanczos only up to {_systems.LANCZOS_MAX_SITES} spins"
        )
        e_inf = info["infinite_temperature_energy"]
        basis = (
            f"E_inf = Tr H / dim = {e_inf['value']:.6f} ({e_inf['source']})"
            if e_inf["value"] is not None
            else f"E_inf = Tr H / dim {e_inf['source']}"
        )
        print(f"exact energy: unknown ({why}); the run reports the V-score, {basis}")
    else:
        print(f"exact energy: {exact:.10f} ({exact_source})")
    sys.stdout.flush()


def _v_score_text(recorder) -> str:
    """``V-score ...`` for the final line, or why there is none."""
    if recorder.v_score is None:
        return "V-score unknown (Tr H / dim unknown)"
    return f"V-score {recorder.v_score:.3e} (N Var E / (E - E_inf)^2, E_inf {recorder.e_infinity:.6f})"


class _StopRequested(Exception):
    """Raised by the driver callback after a step when Ctrl-C asked the run to stop."""


def _version() -> str:
    from .. import __version__

    return __version__


class _Recorder:
    """NetKet driver callback: keeps the per-step statistics, rewrites the log, updates bar and plot.

    A file that cannot be written (full disk, ...) stops the run after the step, on every process;
    the error is kept (:attr:`log_error`, :attr:`plot_error`) and reported by :meth:`failure`.
    """

    def __init__(
        self,
        out: Path,
        config: dict,
        info: dict,
        exact: float | None,
        steps: int,
        interrupts: _interrupt.Interrupts,
        *,
        main: bool = True,
        driver=None,
        checkpoint_every: int = CHECKPOINT_EVERY,
        records: list[tuple] = (),
        deadline: float | None = None,
    ):
        self.out, self.config, self.info, self.exact = out, config, info, exact
        self.interrupts = interrupts
        self.main = main  # False on processes other than 0: no files, no progress bar
        self.driver, self.checkpoint_every, self.steps = driver, checkpoint_every, steps
        # One tuple per completed step (mean, error, variance, acceptance, seconds), appended at once,
        # so that an interrupt never leaves the lists of different lengths; a resumed run starts with
        # those of its checkpoint.
        self.records: list[tuple] = list(records)
        self.n_checkpoint = len(self.records)  # the step of the last checkpoint written (or resumed)
        self.checkpoint_error: _output.OutputError | None = None
        self.deadline = deadline  # time.perf_counter() after which the run stops (--minutes)
        self.time_up = False
        self.status = "running"
        self.error: str | None = None  # an unexpected exception, as "TypeName: message"
        self.final_energy = self.relative_error = None
        self.final_energy_error = self.final_variance = self.v_score = None
        e_inf = (info or {}).get("infinite_temperature_energy") or {}
        self.e_infinity = e_inf.get("value")  # Tr H / dim, when the V-score is reported
        self.n_final = 0
        self.n_logged = 0  # steps in the last log.json that was written
        self.log_error: _output.OutputError | None = None
        self.plot_error: _output.OutputError | None = None
        self.bar = _progress_bar(steps, disable=not main, initial=len(self.records))
        self.t_last = time.perf_counter()
        self.t_plot = self.t_last

    @property
    def failed(self) -> bool:
        return self.log_error is not None or self.plot_error is not None or self.checkpoint_error is not None

    def failure(self) -> str:
        """One line: what could not be written, why, and what the log keeps."""
        log = self.out / "log.json"
        if self.log_error is not None:
            return f"{self.log_error}; run stopped, {log} keeps the {self.n_logged} steps written before"
        if self.checkpoint_error is not None:
            return (
                f"{self.checkpoint_error}; run stopped, {self.out / _checkpoint.CHECKPOINT} keeps step "
                f"{self.n_checkpoint} and {log} the {self.n_logged} steps written before"
            )
        stopped = "" if self.status == "finished" else "run stopped, "
        return f"{self.plot_error}; {stopped}{log} has all {self.n_logged} steps run"

    def __call__(self, step, log_data, driver) -> bool:
        import numpy as np

        stats = log_data["Energy"]
        acceptance = getattr(driver.state.sampler_state, "acceptance", None)
        now = time.perf_counter()
        record = (
            float(np.real(stats.mean)),
            float(stats.error_of_mean),
            float(stats.variance),
            None if acceptance is None else float(acceptance),
            now - self.t_last,
            int(log_data.get("n_samples", driver.state.n_samples)),  # the N this step sampled
        )
        self.records.append(record)
        self.write()
        mean, error, variance, acc, dt, _ = record
        acc_s = "-" if acc is None else f"{acc:.0%}"
        self.bar.set_description_str(
            f"E = {mean:.5f} ± {error:.5f}, var {variance:.4f}, acc {acc_s}, {dt * 1e3:.0f} ms/step",
            refresh=False,
        )
        self.bar.update(1)
        if time.perf_counter() - self.t_plot > _PLOT_EVERY_S:
            self.plot()
        return True

    def after_step(self) -> None:
        """After the step's parameter update (NetKet's ``on_step_end``): the checkpoint every
        ``checkpoint_every`` steps, at the last step and when any process stops the run; then the stop.
        """
        n = len(self.records)
        if n % self.checkpoint_every == 0 or n == self.steps:
            self.checkpoint()
        stop, failed = self._stop_everywhere()  # the same decisions on every process
        if stop:
            if self.n_checkpoint != n and not failed:  # (a full disk: the last checkpoint stays)
                self.checkpoint()  # the state of the last step run, for --resume
            raise _StopRequested
        self.t_last = time.perf_counter()  # the plot and the checkpoint are not counted in the next step

    def checkpoint(self) -> None:
        """Writes the checkpoint of the steps completed (collective: every process takes the snapshot,
        process 0 writes it); a failure is kept, not raised, and the previous checkpoint stays whole."""
        if self.driver is None:
            return
        n = len(self.records)
        snap = _checkpoint.snapshot(
            self.driver,
            step=n,
            records=self.records,
            config=self.config,
            info=self.info,
            extra=_checkpoint.driver_state(self.driver),
        )
        if not self.main:
            self.n_checkpoint = n
            return
        if self.checkpoint_error is not None:
            return
        try:
            _checkpoint.write(self.out, snap)
        except _output.OutputError as error:
            self.checkpoint_error = error
        else:
            self.n_checkpoint = n

    def _stop_everywhere(self) -> tuple[bool, bool]:
        """Whether any process was asked to stop (all processes must leave after the same step), and
        whether a file could not be written on any."""
        import jax

        time_up = self.deadline is not None and time.perf_counter() > self.deadline
        flags = (self.interrupts.requested or self.failed or time_up, self.failed, time_up)
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            gathered = multihost_utils.process_allgather(np.array(flags, dtype=np.int32))
            flags = tuple(bool(np.any(gathered[..., i])) for i in range(3))
        self.time_up = flags[2] and not flags[1] and not self.interrupts.requested
        return flags[0], flags[1]

    def log(self) -> dict:
        columns = list(zip(*self.records)) if self.records else [()] * len(_STEP_KEYS)
        return {
            **{key: list(column) for key, column in zip(_STEP_KEYS, columns)},
            "exact_energy": self.exact,
            "final_energy": self.final_energy,
            "relative_error": self.relative_error,
            "final_energy_error": self.final_energy_error,
            "final_variance": self.final_variance,
            "v_score": self.v_score,
            "status": self.status,
            "error": self.error,
            "config": self.config,
            "info": self.info,
        }

    def write(self) -> None:
        """Rewrites ``log.json`` (strict JSON, atomically); a failure is kept, not raised."""
        if not self.main or self.log_error is not None:
            return
        log = self.log()
        try:
            _output.write_json_atomic(self.out / "log.json", log)
        except _output.OutputError as error:
            self.log_error = error
        else:
            self.n_logged = len(log["energy_mean"])

    def plot(self) -> None:
        """Redraws ``energy.png`` (atomically); a failure is kept, not raised."""
        if not self.main or self.plot_error is not None:
            return
        try:
            _output.plot_energy(self.log(), self.out / "energy.png")
        except _output.OutputError as error:
            self.plot_error = error
        self.t_plot = time.perf_counter()

    def finish(self, status: str) -> None:
        """The status, and over the last tenth of the steps: the mean energy, its error (the steps'
        errors combined as independent), the mean variance, and the relative error to the exact energy
        or, without one, the V-score."""
        self.status = status
        records = list(self.records)
        if records:
            self.n_final = n = max(1, len(records) // 10)
            last = records[-n:]
            self.final_energy = sum(r[0] for r in last) / n
            self.final_energy_error = math.sqrt(sum(r[1] ** 2 for r in last)) / n
            self.final_variance = sum(r[2] for r in last) / n
            if self.exact is not None:
                self.relative_error = abs(self.final_energy - self.exact) / abs(self.exact)
            elif self.e_infinity is not None:
                self.v_score = _systems.v_score(
                    self.info["n_sites"], self.final_energy, self.final_variance, self.e_infinity
                )

    def close(self, status: str) -> None:
        """Final figures and files."""
        self.bar.close()
        self.finish(status)
        self.write()
        self.plot()


def _after_step(recorder: _Recorder):
    """A NetKet callback calling ``recorder.after_step()`` once a step's parameters are updated (a
    legacy callback, such as the recorder itself, runs before the update)."""
    import netket as nk
    from netket.utils import struct

    class AfterStep(nk.callbacks.AbstractCallback, mutable=True):
        _recorder: _Recorder = struct.field(pytree_node=False, serialize=False)

        def __init__(self, recorder):
            self._recorder = recorder

        def on_step_end(self, step, log_data, driver):
            self._recorder.after_step()

    return AfterStep(recorder)


def _progress_bar(steps: int, disable: bool = False, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(
        total=steps,
        initial=initial,
        unit="step",
        file=sys.stderr,
        mininterval=0.2,
        dynamic_ncols=True,
        bar_format="step {n_fmt}/{total_fmt} |{bar:12}| {desc} [{elapsed}<{remaining}]",
        disable=disable,
    )
