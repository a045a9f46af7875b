"""``vmcgrad vmc``'s options: its parser, the checks of its arguments before anything starts, and
the choice of ``--driver auto``."""

from __future__ import annotations

from pathlib import Path

from . import _checkpoint, _distributed, _output, _report, _resume, _run_folder, _systems, _user_problem
from ._args import HelpFormatter, byte_size, chunk_size, non_negative_float, positive_float, positive_int

#: Samples per Metropolis chain are at least this many: chains per device = min(16, samples / devices / this).
_CHAINS_PER_DEVICE = 16
#: The fewest samples a step may have: NetKet's error of the mean (``nk.stats.statistics``) is NaN
#: below its block size, 32 samples in all (tests/test_cli_messages.py checks it against NetKet).
MIN_SAMPLES = 32
#: The optimisation drivers of ``--driver`` (``auto`` picks one of the other two: :func:`choose_driver`).
DRIVERS = {
    "auto": "minsr where the parameters outnumber the samples (NetKet's rule of thumb, as its VMC_SR "
    "chooses: P > N), sr otherwise",
    "sr": "nk.driver.VMC with SR in parameter space (vmcgrad's QGTOnTheFly products, CG)",
    "minsr": "vmcgrad.netket.VMC_SR: sample-space SR (MinSR); its route (the N x N kernel in chunked "
    "blocks, the P x P matrix, or matrix-free CG) the fastest that fits the memory budget",
}
#: The modules this command imports beyond vmcgrad's own (the ``[cli]`` extra), checked before it starts.
REQUIRES = ("netket", "matplotlib", "tqdm")
#: What a run writes in ``--out``.
FILES = (_run_folder.RUN_FILE, "log.json", "energy.png", _checkpoint.CHECKPOINT, _checkpoint.PARAMS)


def add_parser(commands, command) -> None:
    """Adds the ``vmc`` sub-command and its options to ``commands`` (an argparse sub-parsers object)."""
    """Adds the ``vmc`` sub-command and its options to ``commands`` (an argparse sub-parsers object);
    ``command`` is the module that runs it (:mod:`vmcgrad.cli.vmc`)."""
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
        default="auto",
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
        help="with --driver minsr or auto (which then takes minsr): double the samples whenever the "
        "energy settles to its error bar over 20 steps, up to MAX and to what --memory-budget holds "
        "(vmcgrad.netket.GrowSamples)",
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
        help="output directory (run.json, log.json, energy.png, checkpoint.mpack, params.mpack); "
        "vmcgrad.cli.load_run(DIR) loads it back as a NetKet state",
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
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the log lines of the libraries under a multi-process run (JAX's distributed client, "
        "Gloo) in the terminal; otherwise process 0 writes them to DIR/third_party.log",
    )
    _distributed.add_arguments(p)
    p.set_defaults(_command=command, _parser=p)  # the module that runs it: vmcgrad.cli.vmc


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
    if args.samples < MIN_SAMPLES:
        parser.error(
            f"argument --samples: must be at least {MIN_SAMPLES}; got {args.samples}, for which NetKet's "
            f"error of the mean is nan (it needs {MIN_SAMPLES} samples, its block size). "
            f"Fix: --samples {MIN_SAMPLES} or more"
        )
    if args.grow_samples is not None and args.driver == "sr":
        parser.error(
            "argument --grow-samples: needs --driver minsr or auto (sample-space SR holds N within a "
            "budget); got --driver sr"
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


def choose_driver(option: str, n_parameters: int, n_samples: int, grow: bool = False) -> tuple[str, str]:
    """The driver a run takes for ``--driver option`` and why: ``auto`` takes sample-space SR
    (``minsr``) where the parameters outnumber the samples, as NetKet's ``VMC_SR`` chooses its kernel,
    and with ``--grow-samples``; parameter-space SR (``sr``) otherwise. A forced driver is kept, and the
    reason says when ``auto`` would take the other.

    Examples:
        >>> choose_driver("auto", 2120, 1024)[0], choose_driver("auto", 80, 256)[0]
        ('minsr', 'sr')
    """
    p, n = n_parameters, n_samples
    more = p > n
    relation = f"{p} parameters {'>' if more else '<='} {n} samples"
    if option == "auto":
        if grow:
            return (
                "minsr",
                "--driver auto with --grow-samples: sample-space SR, which holds N within a budget",
            )
        if more:
            return "minsr", f"--driver auto: {relation}, so sample-space SR (NetKet's rule of thumb: P > N)"
        return "sr", f"--driver auto: {relation}, so parameter-space SR (NetKet's rule of thumb: P <= N)"
    if option == "sr" and not more:
        return "sr", f"--driver sr as given ({relation})"
    if option == "sr":
        return "sr", (
            f"--driver sr as given, with {relation}: the P x P system is under-determined here; "
            "--driver auto takes minsr (sample-space SR), as NetKet recommends"
        )
    if more:
        return "minsr", f"--driver minsr as given ({relation})"
    return "minsr", f"--driver minsr as given ({relation}: --driver auto would take sr, parameter-space SR)"
