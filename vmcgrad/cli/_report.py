"""What a ``vmcgrad vmc`` run reports: the per-step log, the plot, the progress bar and the final line.

:class:`Recorder` is the NetKet driver callback that keeps the per-step statistics and rewrites
``DIR/log.json`` atomically after every step, ``DIR/energy.png`` every few seconds, and takes the
checkpoint once the step's parameters are updated (:func:`after_step`).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from . import _checkpoint, _interrupt, _output, _phases, _systems

#: Steps between checkpoints by default: the write costs about a millisecond for the default model,
#: a fraction of a percent of the steps it follows.
CHECKPOINT_EVERY = 10
PLOT_EVERY_S = 10.0
#: The per-step lists of ``log.json``: the statistics, the step's wall time and N, the route its
#: preconditioner took, the compiled temp bytes per device of its phases (:mod:`._phases`) and the
#: time the MinSR route's rule modelled for the route (None for ``--driver sr``). New keys go last
#: (a checkpoint's older records are padded with None).
STEP_KEYS = (
    "energy_mean",
    "energy_error",
    "energy_variance",
    "acceptance",
    "step_time",
    "n_samples",
    "route",
    "temp_bytes",
    "route_modelled_time",
)
#: What each route of ``--driver minsr`` solves (:mod:`vmcgrad._sr.ntk.routes`), for the header.
ROUTES = {
    "dense": "the N x N kernel, built in chunked blocks, and its Cholesky factor",
    "parameter": "the P x P matrix (fewer parameters than samples) and its Cholesky factor",
    "cg": "matrix-free conjugate gradient on the N x N kernel, Nystrom-preconditioned",
}


def print_header(args, info: dict, exact: float | None, exact_source: str | None) -> None:
    """The run's first lines: the problem, model, samples, devices, chunks and driver, and the exact
    energy or why there is none."""
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
    if chunks.get("kernel") == "auto":  # the kernel's blocks: chosen by vmcgrad.minsr_update at each N
        chunk = f"{chunks['gradient']} (gradient), kernel blocks chosen within the budget at each N"
    taken = info["driver_taken"]
    devices = _plural(info["n_devices"], "device")
    print(
        f"vmcgrad vmc: {info['description']}; "
        f"{args.model} with {info['n_parameters']} parameters; {info['n_samples']} samples in "
        f"{info['n_chains']} chains on {devices}{processes}, chunk size "
        f"{chunk}; {'SR' if taken == 'sr' else 'MinSR'} diag_shift {args.diag_shift}, "
        f"lr {args.lr}, {args.steps} steps"
    )
    given = info.get("samples_given", info["n_samples"])
    if given != info["n_samples"]:
        per_device = info["n_chains"] // info["n_devices"]
        print(
            f"note: --samples {given} rounded up to {info['n_samples']}, the same number in each of the "
            f"{info['n_chains']} chains ({per_device} per device on {devices})"
        )
    budget = "" if args.memory_budget is None else f", within {args.memory_budget} bytes per device"
    grow = (
        "" if args.grow_samples is None else f"; samples grow up to {args.grow_samples} as the energy settles"
    )
    print(f"driver {taken}: {info['driver_reason']}{budget}{grow}")
    if info.get("route") is not None:
        print(f"route {info['route']}: {ROUTES[info['route']]}{_modelled(info.get('route_choice'))}")
    if taken == "sr" and args.chunk_size == "auto":
        solve = chunks.get("qgt_solve")
        solve = (
            f"; each solve keeps every chunk's linearisation, at chunk {solve}"
            if solve is not None
            else "; each solve's products recompute the forward pass (the kept linearisations do not fit)"
        )
        print(
            f"chunk size auto: picked {chunks['gradient']} for the gradient and {chunks['qgt']} "
            f"({info['qgt_design']} design) for the QGT products (the largest powers of two whose "
            f"compiled programs fit the memory budget; the QGT's design is the faster one within it){solve}"
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


def _modelled(choice: dict | None) -> str:
    """``"; chunk 256 per device, modelled 1.2 ms on tpu (dense 1.2 ms, cg 3.4 ms)"``: the chunk the
    route takes (a number, also where ``--chunk-size auto`` chose it), its modelled time and each
    route's that fits, from the route's record (``info["route_choice"]``); "" without one.

    Examples:
        >>> _modelled({"value": ["dense", 256], "seconds": 0.0012, "platform": "tpu",
        ...            "priced": [["dense", 0.0012], ["cg", 0.0034]]})
        '; chunk 256 per device, modelled 1.2 ms on tpu (dense 1.2 ms, cg 3.4 ms)'
    """
    if not choice or choice.get("seconds") is None:
        return ""
    chunk = (choice.get("value") or [None, None])[1]
    at = f"; chunk {chunk} per device," if isinstance(chunk, int) else ";"
    each = ", ".join(f"{route} {_ms(t)}" for route, t in choice.get("priced", ()))
    return f"{at} modelled {_ms(choice['seconds'])} on {choice['platform']}" + (f" ({each})" if each else "")


def _ms(seconds: float) -> str:
    """Seconds, in ms below one second.

    Examples:
        >>> _ms(0.0123), _ms(2.845)
        ('12.3 ms', '2.85 s')
    """
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _plural(n: int, word: str) -> str:
    """``"1 step"``, ``"2 steps"``.

    Examples:
        >>> _plural(1, "step"), _plural(3, "device")
        ('1 step', '3 devices')
    """
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


#: What each MinSR route is, for the line printed when a step first takes it.
ROUTES = {
    "dense": "the N x N kernel built in chunked blocks and solved densely",
    "parameter": "the P x P matrix S built in chunks and solved densely (P < N: the smaller system)",
    "cg": "matrix-free conjugate gradient on the N x N kernel (no N x N matrix stored)",
}


def describe(error: BaseException) -> str:
    """``"TypeName: first line of the message"``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def keep(kept: dict) -> str | None:
    """On a second Ctrl-C: the log as it stands, with the status "interrupted"."""
    recorder = kept.get("recorder")
    if recorder is None or not recorder.main:
        return None
    recorder.finish("interrupted")
    recorder.write()
    if recorder.log_error is not None:
        return str(recorder.log_error)
    kept = f"kept {recorder.out / 'log.json'} ({_plural(len(recorder.records), 'step')})"
    return kept + resume_hint(recorder.out, recorder.n_checkpoint)


def resume_hint(out: Path, step: int | None = None) -> str:
    """``"; continue from the checkpoint of step K with `vmcgrad vmc --resume DIR`"`` when ``out``
    holds a checkpoint, else ``""``."""
    if not (out / _checkpoint.CHECKPOINT).is_file():
        return ""
    at = "" if step is None else f" of step {step}"
    return f"; continue from the checkpoint{at} with `vmcgrad vmc --resume {out}`"


def v_score_text(recorder) -> str:
    """``V-score ...`` for the final line, or why there is none."""
    if recorder.v_score is None:
        return "V-score unknown (Tr H / dim unknown)"
    return f"V-score {recorder.v_score:.3e} (N Var E / (E - E_inf)^2, E_inf {recorder.e_infinity:.6f})"


class StopRequested(Exception):
    """Raised by the driver callback after a step when Ctrl-C asked the run to stop."""


class Recorder:
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
        phases: _phases.PhaseBytes | None = None,
        checkpoint_every: int = CHECKPOINT_EVERY,
        records: list[tuple] = (),
        deadline: float | None = None,
        kernel_chunk: int | str | None = None,
    ):
        self.out, self.config, self.info, self.exact = out, config, info, exact
        self.interrupts = interrupts
        self.main = main  # False on processes other than 0: no files, no progress bar
        self.driver, self.checkpoint_every, self.steps = driver, checkpoint_every, steps
        # One tuple per completed step (mean, error, variance, acceptance, seconds), appended at once,
        # so that an interrupt never leaves the lists of different lengths; a resumed run starts with
        # those of its checkpoint.
        # (a checkpoint of a run logged before the route and bytes were: those fields are None)
        self.records: list[tuple] = [(*r, *[None] * (len(STEP_KEYS) - len(r))) for r in records]
        self.phases = phases
        self.kernel_chunk = kernel_chunk  # MinSR's kernel chunk (an int, or "auto"), None for SR
        self.route: str | None = None  # the last route a MinSR step took, said when it changes
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
        self.bar = progress_bar(steps, disable=not main, initial=len(self.records))
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
        n = int(log_data.get("n_samples", driver.state.n_samples))  # the N this step sampled
        record = (
            float(np.real(stats.mean)),
            float(stats.error_of_mean),
            float(stats.variance),
            None if acceptance is None else float(acceptance),
            now - self.t_last,
            n,
            _phases.route_of(driver),
            None if self.phases is None else self.phases(n, driver),
            _phases.modelled_time_of(driver),
        )
        self.records.append(record)
        self.write()
        self._say_route(record[6], n)
        mean, error, variance, acc, dt = record[:5]
        acc_s = "-" if acc is None else f"{acc:.0%}"
        self.bar.set_description_str(
            f"E = {mean:.5f} ± {error:.5f}, var {variance:.4f}, acc {acc_s}, {dt * 1e3:.0f} ms/step",
            refresh=False,
        )
        self.bar.update(1)
        if time.perf_counter() - self.t_plot > PLOT_EVERY_S:
            self.plot()
        return True

    def _say_route(self, route: str, n: int) -> None:
        """One line when a MinSR step takes a route other than the last one (the first step's included):
        the route, what it is, N and the kernel's chunk."""
        if not self.main or self.kernel_chunk is None or route == self.route:
            return
        self.route = route
        chunk = (
            "kernel blocks chosen within the budget by vmcgrad.minsr_update"
            if self.kernel_chunk == "auto"
            else f"kernel chunk {self.kernel_chunk}"
        )
        what = ROUTES.get(route, route)
        self.bar.write(
            f"step {len(self.records)}: MinSR route {route}, {what}; N = {n}, {chunk}", file=sys.stdout
        )

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
            raise StopRequested
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
        columns = list(zip(*self.records)) if self.records else [()] * len(STEP_KEYS)
        return {
            **{key: list(column) for key, column in zip(STEP_KEYS, columns)},
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


def after_step(recorder: Recorder):
    """A NetKet callback calling ``recorder.after_step()`` once a step's parameters are updated (a
    legacy callback, such as the recorder itself, runs before the update)."""
    import netket as nk
    from netket.utils import struct

    class AfterStep(nk.callbacks.AbstractCallback, mutable=True):
        _recorder: Recorder = struct.field(pytree_node=False, serialize=False)

        def __init__(self, recorder):
            self._recorder = recorder

        def on_step_end(self, step, log_data, driver):
            self._recorder.after_step()

    return AfterStep(recorder)


def progress_bar(steps: int, disable: bool = False, initial: int = 0):
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
