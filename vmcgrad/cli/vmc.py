"""``vmcgrad vmc``: a ground-state search with NetKet's sampler and driver and vmcgrad's gradients and SR.

``--driver auto`` (the default) takes sample-space SR (:class:`vmcgrad.netket.VMC_SR`, MinSR) where
the parameters outnumber the samples, and parameter-space SR otherwise (:func:`choose_driver`). A
parameter-space step is NetKet's ``nk.driver.VMC`` with an ``nk.optimizer.SR`` preconditioner: sample, then

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
import time
from pathlib import Path

import vmcgrad

from .. import __version__
from . import (
    _checkpoint,
    _interrupt,
    _output,
    _phases,
    _report,
    _run_folder,
    _systems,
    _user_problem,
)
from ._vmc_options import _CHAINS_PER_DEVICE, DRIVERS, FILES, MIN_SAMPLES, choose_driver
from ._vmc_options import REQUIRES as REQUIRES  # the command's interface (vmcgrad.cli.main)
from ._vmc_options import check as check  # the command's interface (vmcgrad.cli.main)


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
    n = len(log["energy_mean"])
    kept = f"{path} keeps the {n} {'step' if n == 1 else 'steps'} run"
    return kept + _report.resume_hint(Path(args.out))


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
    taken, why = choose_driver(
        args.driver, int(vstate.n_parameters), n_samples, args.grow_samples is not None
    )
    if snap is not None:  # the driver the run was started with
        taken = snap["info"].get("driver_taken", taken)
    driver, route, route_choice = None, None, None
    if taken == "minsr":  # its route, before anything is sampled: a budget no route fits stops here
        kernel = args.chunk_size if snap is None else snap["info"]["chunk_size"]["kernel"]
        # building it resolves the state's automatic gradient chunk: a budget no chunk fits stops here,
        # with a budget that holds the route too
        build = lambda: _driver(args, taken, system, vstate, {"kernel": kernel}, "-")
        route_at = lambda b: _phases.need_at(lambda: _minsr_at(args, system, vstate, kernel, n_samples, b))
        driver = _phases.chunks_or_exit(args, build, then=route_at)
        route = _phases.route_or_exit(args, driver, n_samples, MIN_SAMPLES)
        route_choice = _phases.route_choice(driver, n_samples)
    if snap is None:  # before anything is sampled: a budget no chunk fits stops here
        chunks, qgt_design = _phases.chunks_or_exit(
            args,
            lambda: _chunk_sizes(args.chunk_size, vstate, args.memory_budget, taken),
            then=lambda b: _phases.need_at(lambda: _chunk_sizes(args.chunk_size, vstate, b, taken)),
        )
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
        "samples_given": args.samples,
        "n_chains": n_chains,
        "n_devices": n_devices,
        "n_processes": jax.process_count(),
        "chunk_size": chunks,
        "qgt_design": qgt_design,
        "driver": DRIVERS[taken],
        "driver_taken": taken,
        "driver_reason": why,
        "route": route,
        "route_choice": route_choice,
        "memory_budget": args.memory_budget,
        "exact_energy_source": exact_source,
        "infinite_temperature_energy": e_inf,
        "versions": {
            "vmcgrad": _version(),
            "netket": nk.__version__,
            "jax": jax.__version__,
            "flax": _flax_version(),
        },
        "resumed_at": [] if snap is None else [*snap["info"].get("resumed_at", []), int(snap["step"])],
    }
    if main:
        _report.print_header(args, info, exact, exact_source)

    if driver is None:
        driver = _driver(args, taken, system, vstate, chunks, qgt_design)

    if snap is not None:
        if main:
            print(f"resuming from step {snap['step']} of {args.out}/{_checkpoint.CHECKPOINT}")
        driver = _checkpoint.restore(driver, snap, Path(args.out) / _checkpoint.CHECKPOINT)
        vstate = driver.state

    out = Path(args.out)
    if main:
        _output.remove_stale_temporaries(out, FILES)
        driver_record = {"option": args.driver, "name": taken, "reason": why, "description": info["driver"]}
        run_record = _run_folder.record(args, system, model, vstate, info, driver_record)
        _output.write_json_atomic(out / _run_folder.RUN_FILE, run_record)
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
        kernel_chunk=chunks.get("kernel"),
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
    last = _report._plural(recorder.n_final, "step")
    if recorder.relative_error is not None:
        print(
            f"final energy {recorder.final_energy:.6f} (mean of the last {last}), "
            f"exact {exact:.6f}, relative error {recorder.relative_error:.2e}"
        )
    elif n:
        print(
            f"final energy {recorder.final_energy:.6f} ± {recorder.final_energy_error:.6f}, variance "
            f"{recorder.final_variance:.6f} (means of the last {last}), " + _report.v_score_text(recorder)
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
        written = (
            f"wrote the checkpoint of step {recorder.n_checkpoint} ({out / _checkpoint.CHECKPOINT})"
            if recorder.n_checkpoint
            else "no checkpoint yet"
        )
        print(
            f"interrupted after {n} of {_report._plural(args.steps, 'step')}; {written}, kept "
            f"{out / 'log.json'} and {out / 'energy.png'}; continue with `vmcgrad vmc --resume {out}`"
            + (f" (from step {recorder.n_checkpoint})" if recorder.n_checkpoint else " (from the start)")
        )
        return 130
    print(
        f"wrote {out / _run_folder.RUN_FILE}, {out / 'log.json'}, {out / 'energy.png'}, "
        f"{out / _checkpoint.CHECKPOINT} and {out / _checkpoint.PARAMS} in {wall:.1f} s; "
        f"load it with vmcgrad.cli.load_run({str(out)!r})"
    )
    return 0


def _driver(args, taken: str, system, vstate, chunks: dict, qgt_design: str):
    """The optimisation driver ``taken`` (:func:`choose_driver`): NetKet's VMC with SR on vmcgrad's QGT
    products, or vmcgrad's ``VMC_SR`` (MinSR) with its kernel chunk from the budget. NetKet's warning
    that SR has fewer samples than parameters is left out: the header's driver line says it."""
    import contextlib
    import io
    import warnings

    import netket as nk

    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    import vmcgrad.netket as vnk

    optimizer = nk.optimizer.Sgd(learning_rate=args.lr)
    if taken == "sr":
        # at "auto" the solve keeps every chunk's linearisation where the budget holds them
        # (QGTOperator.kept_solve); the products run at the chunk chosen for the design
        auto = {"chunk_size": "auto", "memory_budget": args.memory_budget}
        qgt = vnk.QGTOnTheFly(
            **(auto if args.chunk_size == "auto" else {"chunk_size": chunks["qgt"]}), design=qgt_design
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", nk.errors.InsufficientSamplesForSRWarning)
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


def _minsr_at(args, system, vstate, kernel, n: int, budget: int) -> None:
    """Builds the MinSR driver at ``budget`` bytes per device (the state's budget too, restored after)
    and checks its route at ``n`` samples: the checks a budget suggested for the gradient must pass
    (:func:`_phases.chunks_or_exit`'s ``then``). Compile only."""
    import copy

    trial = copy.copy(args)
    trial.memory_budget = budget
    saved, vstate.vmcgrad_memory_budget = vstate.vmcgrad_memory_budget, budget
    try:
        _driver(trial, "minsr", system, vstate, {"kernel": kernel}, "-").route_at(n)
    finally:
        vstate.vmcgrad_memory_budget = saved


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
    neither does the choice; it is made on zeros laid out as the samples (:func:`_phases.stand_in_samples`),
    before anything is sampled, so that a budget no chunk fits stops the run before its first
    sampling, and the choice leaves the sampler's chains where they are.

    Raises:
        MemoryError: (with ``need``, the bytes at one sample per chunk) when no chunk fits the budget.
    """
    if chunk_size != "auto":
        if driver == "minsr":
            return {"gradient": chunk_size, "kernel": chunk_size}, "-"
        return {"gradient": chunk_size, "qgt": chunk_size}, "fused"
    import jax

    logpsi = _phases.log_psi(vstate)
    samples = _phases.stand_in_samples(vstate, vstate.n_samples)
    budget = {"memory_budget": memory_budget}
    gradient = vmcgrad.auto_chunk_size(logpsi, vstate.parameters, samples, estimator="expect_grad", **budget)
    if driver == "minsr":  # the kernel's blocks: chosen by vmcgrad.minsr_update at each N, in the budget
        return {"gradient": gradient, "kernel": "auto"}, "-"
    qgt = vmcgrad.QGT(logpsi, vstate.parameters, samples, chunk_size="auto", **budget)  # builds O-bar once
    # the product the run's CG iterates with, on the flat representation: its chunk is chosen at the
    # call within the budget (traced here, compiled, not run), so one that no chunk fits stops here
    rep = jax.ShapeDtypeStruct((qgt.dim,), qgt.views.rep_dtype)
    jax.eval_shape(lambda v: qgt @ v, rep)
    if qgt.kept_solve is None:
        # and the solve nk.optimizer.SR runs, NetKet's CG on the operator, at its own chunk within the
        # budget (its vectors besides the products): one that no chunk fits stops here too
        # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
        from vmcgrad.netket._qgt import QGTOnTheFlyT, _solve

        lhs = QGTOnTheFlyT(diag_shift=0.0, qgt=qgt)
        solver = jax.tree_util.Partial(jax.scipy.sparse.linalg.cg)
        jax.eval_shape(lambda g: _solve(lhs, solver, g, x0=g), vstate.parameters)
    return {"gradient": gradient, "qgt": qgt.chunk_size, "qgt_solve": qgt.kept_solve}, qgt.design


def _flax_version() -> str:
    """flax's version, read from its installed metadata (the package holds no flax import but its
    serialization's: tests/test_benchmarks_public_api.py)."""
    from importlib.metadata import version

    return version("flax")


def _version() -> str:

    return __version__
