r"""Which regime a device is in: a driver step's time against N, compilation apart.

On a CPU a VMC step costs about N (sampling and local energies scale with it); on an accelerator
a step should stay nearly flat in N until the device fills, so that extra samples come almost
free and a memory budget that holds more samples turns into accuracy. This script measures that
on the race's problem (``time_to_energy.py``'s model, sampler and drivers): for each
``NAME=N[:CHUNK]`` in ``--runs`` (the race's contender names), in one process, in the order given,
it builds the driver, times the first step (compilation included) and ``--steps`` more (medians,
split into sampling, local energies and the SR phase like the race), and writes one JSON row per
run as soon as it is done, so a run stopped by a time limit keeps what it finished.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/step_regime.py --dtype float32 --budget-mib 32 \
        --runs netket-vmcsr=256:64 vmcgrad-vmcsr=256:auto vmcgrad-vmcsr=1024:auto --json rows.jsonl

Each row: the run, the device, the seconds to build the driver and state, the first step, the
median step and phases, the step per sample, the chunk vmcgrad chose and the device's allocator
peak (``memory_stats``; none on a CPU) and the process's peak RSS so far; the first step's phases
(``first_sample_s``, ``first_local_s``, ``first_sr_s``) and what it compiled (``first_compiles``:
function name -> [backend compilations, seconds]) and each candidate vmcgrad's searches compiled
(``first_probes``: [where, candidate, bytes per device, budget], in order); with ``--kernel``, the
SR kernel of the run lowered and compiled apart (the seconds of each, its StableHLO lines and
compiled bytes: how much program the first step compiles for the SR phase) and
:func:`vmcgrad.program_cost` of the program this device compiled (its ops in sequence, FLOPs, bytes
and modelled seconds per platform: beside the measured SR phase, the data to fit ``t_op`` on real
kernels).

``@SPLIT`` after a vmcgrad run sets how many parts a chunk's per-sample Jacobians are derived in
(``vmcgrad._sr.ntk.modes.JACOBIAN_SPLIT``: ``@16`` derives a chunk of 64 4 samples at a time, and the
dense kernel's column blocks are 4 samples wide), in place of the platform's (16 on a CPU, 1 on an
accelerator: ``vmcgrad._sr.ntk.modes.jacobian_split``). On a CPU the parts are the fastest; on an
accelerator each is a small sequential step, which this measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time

import time_to_energy as tte  # the race's problem, model and drivers (this script's folder)


def budget_mib(text: str) -> float | None:
    """``--budget-mib``: a positive number of MiB, or ``default`` (None)."""
    if text == "default":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB or 'default'; got {text!r}")
    return value


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="NAME=N[:CHUNK][@SPLIT]")
    ap.add_argument("--problem", choices=tte.PROBLEMS, default="j1j2")
    ap.add_argument("--model", choices=("gcnn", "vit"), default="gcnn")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument(
        "--budget-mib",
        type=budget_mib,
        default=64.0,
        help="vmcgrad's memory budget per device in MiB, or 'default' (vmcgrad's own: half the "
        "device's free memory where it reports it, else 2 GiB)",
    )
    ap.add_argument("--chains", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steps after the first, timed for the medians")
    ap.add_argument("--platform", default=None)
    ap.add_argument(
        "--kernel",
        action="store_true",
        help="also lower and compile each run's SR kernel apart (time_to_energy.kernel_lowered): its "
        "seconds to lower and to compile, its StableHLO lines and compiled bytes",
    )
    ap.add_argument("--json", help="JSON lines, one per run, appended as each ends")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: expected at least 1 step after the first (the medians)")
    runs = []
    for item in args.runs:  # parsed as the race parses --n, less an "@SPLIT"
        item, _, split = item.partition("@")
        name = item.partition("=")[0]
        if split and (not name.startswith("vmcgrad") or not split.isdigit() or int(split) < 1):
            ap.error(f"--runs {item}@{split}: '@SPLIT' is a positive int, for vmcgrad's runs only")
        race = tte.parse(["--n", item, "--contenders", name])
        runs.append((name, race.sizes[name], int(split) if split else None))
    args.runs = runs
    return args


def main(argv=None):
    args = parse(argv)
    tte.setup_jax(args.platform, x64=args.dtype == "float64")
    import jax

    race = argparse.Namespace(
        problem=args.problem,
        model=args.model,
        layers=args.layers,
        features=args.features,
        dtype=args.dtype,
        budget_mib=args.budget_mib,
        chains=args.chains,
        lr=0.005,
        diag_shift=1e-3,
        grow_max=8192,
        grow_window=20,
    )
    t = time.perf_counter()
    hi, g, H, _ = tte.build_problem(race, exact=False)
    model = tte.build_model(race, g)
    d = jax.devices()[0]
    device = f"{jax.device_count()} x {d.platform} {d.device_kind}"
    print(f"{device}; problem and model in {time.perf_counter() - t:.1f} s", flush=True)
    from vmcgrad._cache import registry
    from vmcgrad._sr.ntk import modes as ntk_modes

    default_split = ntk_modes.JACOBIAN_SPLIT
    for name, (n, chunk), split in args.runs:
        race.sizes = {name: (n, chunk)}
        # the dense kernel derives a chunk's Jacobians chunk/SPLIT samples at a time (and its column
        # blocks are that wide): a module constant, read when the program is traced, so the compiled
        # programs and vmcgrad's chunk memos are dropped where it changes
        if (split or default_split) != ntk_modes.JACOBIAN_SPLIT:
            ntk_modes.JACOBIAN_SPLIT = split or default_split
            jax.clear_caches()
            for cache in registry():
                cache.clear()
        t = time.perf_counter()
        driver, vs = tte.build_driver(race, name, 0, hi, g, H, model)
        jax.block_until_ready(vs.parameters)
        build = time.perf_counter() - t
        phases, is_vmc = tte.instrument(driver, vs)
        with compilations() as compiled, searched() as probes:  # the first step's
            steps = [step(driver, vs, phases, is_vmc)]
        steps += [step(driver, vs, phases, is_vmc) for _ in range(args.steps)]
        med = {k: statistics.median(s[k] for s in steps[1:]) for k in steps[0]}
        chunk_used = getattr(driver, "chunk_size_bwd", None)
        row = {
            "run": f"{name}={n}:{chunk}" + (f"@{split}" if split else ""),
            "jacobian_split": ntk_modes.jacobian_split() if name.startswith("vmcgrad") else None,
            "device": device,
            "dtype": args.dtype,
            "budget_mib": args.budget_mib,
            "build_s": build,
            "first_step_s": steps[0]["step_s"],
            **{f"first_{k}": v for k, v in steps[0].items() if k != "step_s"},  # compiling, by phase
            "first_compiles": compiled,  # function name -> [backend compilations, their seconds]
            "first_probes": probes,  # [where, candidate, bytes per device, budget], in order
            **{f"median_{k}": v for k, v in med.items()},
            "step_per_sample_ms": 1e3 * med["step_s"] / n,
            "chunk_size_bwd": chunk_used if not hasattr(chunk_used, "item") else int(chunk_used),
            # vmcgrad's update: its route, chunk, modelled time and the programs compiled to choose
            "route_choice": choice.as_dict() if (choice := getattr(driver, "route_choice", None)) else None,
            "device_peak": tte.device_peak_bytes(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if args.kernel:
            row |= kernel_cost(race, name, driver, vs, H)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def compilations():
    """``{function name: [backend compilations, seconds]}`` of the programs compiled inside the
    ``with`` block (JAX's ``/jax/core/compile/backend_compile_duration`` events): what a first step
    spends compiling, and on what (vmcgrad's automatic searches compile candidates of
    ``jit(_update_program)``)."""
    import jax

    found: dict = {}

    def listen(event, duration, fun_name="?", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            count, seconds = found.get(fun_name, (0, 0.0))
            found[fun_name] = [count + 1, seconds + duration]

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield found
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def searched():
    """``[[where, candidate, bytes per device, budget], ...]``: each candidate vmcgrad's automatic
    searches compiled inside the ``with`` block, in order (the ``"vmcgrad"`` logger's DEBUG records):
    the bytes a device's compiler gives each chunk, which a search on another platform cannot see."""
    import logging

    found: list = []

    class Probes(logging.Handler):
        def emit(self, record):
            where, candidate, memory, budget = record.args
            found.append(
                [where, candidate if isinstance(candidate, int) else repr(candidate), memory, budget]
            )

    log, handler = logging.getLogger("vmcgrad"), Probes(logging.DEBUG)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def kernel_cost(race, name, driver, vs, H):
    """The run's SR kernel lowered and compiled apart: seconds for each, StableHLO lines, bytes."""
    import vmcgrad

    t = time.perf_counter()
    lowered = tte.kernel_lowered(race, name, driver, vs, H)
    lower = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t
    cost = vmcgrad.program_cost(compiled)  # counted on the program this device compiled
    return {
        "kernel_lower_s": lower,
        "kernel_compile_s": seconds,
        "kernel_stablehlo_lines": lowered.as_text().count("\n"),
        "kernel_bytes": vmcgrad.program_bytes(compiled),
        "kernel_ops": cost.ops,
        "kernel_flops": cost.flops,
        "kernel_bytes_accessed": cost.bytes,
        "kernel_modelled_s": {p: cost.time(p) for p in ("cpu", "gpu", "tpu")},
    }


def step(driver, vs, phases, is_vmc):
    """One step as the race times it (:func:`time_to_energy.timed_step`): the step and its phases,
    in seconds."""
    _, total = tte.timed_step(driver, vs, phases, is_vmc)
    return {"step_s": total, **{f"{k}_s": v for k, v in phases.items()}}


if __name__ == "__main__":
    main()
