r"""The local energies of a driver step: ``vmcgrad.netket.MCState(chunk_size="auto")`` against NetKet.

``VMC_SR`` calls ``vstate.local_estimators(H)`` every step. NetKet's chunked local-value kernels count
their chunk in model evaluations, each sample's connected configurations included, so the gradient's
automatic chunk walks about :math:`N n_\text{conn} / c` trips of the model. On a GPU or TPU each trip
is a fixed cost; there ``chunk_size="auto"`` now chooses the local values' own chunk
(:func:`vmcgrad.netket._local_values.fewest_trips`). This script times, interleaved, on the race's
problem and model (``time_to_energy.py``), at N samples:

- ``netket``: NetKet's ``MCState.local_estimators``, unchunked (``chunk_size=None``, NetKet's default);
- ``netket-chunk``: NetKet's at ``--chunk`` (given: the chunk a NetKet user would pick);
- ``vmcgrad-<platform>``: ``vmcgrad.netket.MCState(chunk_size="auto", memory_budget=...)`` with its
  choices priced for each platform of ``--priced`` (``vmcgrad.cost_platform``): ``cpu`` keeps the
  gradient's chunk, ``gpu`` and ``tpu`` take the fewest trips that fit.

Each row holds the chunk the local values ran at, the seconds of the first call (its compilations
included) and the median of ``--runs`` later calls (``block_until_ready``), and its program's counts
(NetKet's compiled local-value program at that chunk: its bytes per device, and from
:func:`vmcgrad.program_cost` its ops in sequence and modelled milliseconds on each platform's
constants). The states draw the same
samples (same seeds), and each row gives its largest difference from NetKet's unchunked values.

``--estimator expect_and_grad`` times ``vs.expect_and_grad(H)`` instead, VMC's step: one program of
the local values and the gradient, whose local values ``chunk_size="auto"`` runs at their own chunk
on a GPU or TPU too (:func:`vmcgrad.netket._local_values.at_fewest_trips`); its rows count that
program (NetKet's rows are timed only), and the difference is the energy's and the gradient's.

Run::

    PYTHONPATH=.:benchmarks python benchmarks/local_values.py --dtype float32 --n 256 \
        --budget-mib default --priced cpu tpu [--estimator expect_and_grad]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import time_to_energy as tte  # the race's problem and model (this script's folder)
from step_regime import budget_mib


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", choices=tte.PROBLEMS, default="j1j2")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float32")
    ap.add_argument("--n", type=int, default=256, help="samples")
    ap.add_argument("--chunk", type=int, default=64, help="NetKet's chunk of the 'netket-chunk' row")
    ap.add_argument("--budget-mib", type=budget_mib, default=None, help="MiB per device, or 'default'")
    ap.add_argument("--priced", nargs="+", choices=("cpu", "gpu", "tpu"), default=["cpu", "tpu"])
    ap.add_argument("--runs", type=int, default=10, help="timed calls after the first, per row")
    ap.add_argument(
        "--estimator",
        choices=("local_estimators", "expect_and_grad"),
        default="local_estimators",
        help="the call timed: VMC_SR's local energies, or VMC's energy and gradient (one program)",
    )
    ap.add_argument("--platform", default=None, help="JAX platform (jax_platforms); default JAX's")
    ap.add_argument("--json", help="JSON lines, one per row, appended")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: expected at least 1")
    args.priced = list(dict.fromkeys(args.priced))  # (a platform named twice: one row)
    return args


def main(argv=None):
    args = parse(argv)
    tte.setup_jax(args.platform, x64=args.dtype == "float64")
    import jax
    import netket as nk
    import numpy as np

    import vmcgrad
    import vmcgrad.netket as vnk

    race = argparse.Namespace(
        problem=args.problem, model="gcnn", layers=args.layers, features=args.features, dtype=args.dtype
    )
    hi, g, H, _ = tte.build_problem(race, exact=False)
    model = tte.build_model(race, g)

    def state(cls, **kw):
        sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=min(args.n, 256), d_max=2)
        return cls(sampler, model, n_samples=args.n, n_discard_per_chain=4, seed=0, sampler_seed=1000, **kw)

    budget = tte.mib_or_default(args.budget_mib)
    rows = [
        ("netket", state(nk.vqs.MCState), None),
        ("netket-chunk", state(nk.vqs.MCState, chunk_size=args.chunk), None),
    ]
    rows += [
        (f"vmcgrad-{p}", state(vnk.MCState, chunk_size="auto", memory_budget=budget), p) for p in args.priced
    ]
    for _, vs, _ in rows:
        vs.sample()
    d = jax.devices()[0]
    device = f"{jax.device_count()} x {d.platform} {d.device_kind}"

    def values(vs):  # the local energies, or the gradient's leaves flattened (and the energy)
        if args.estimator == "local_estimators":
            return vs.local_estimators(H).data
        stats, grad = vs.expect_and_grad(H)
        return jax.numpy.concatenate([stats.mean.ravel(), *(g.ravel() for g in jax.tree.leaves(grad))])

    def call(vs, priced):
        if priced is None:
            return jax.block_until_ready(values(vs))
        with vmcgrad.cost_platform(priced):
            return jax.block_until_ready(values(vs))

    reference = np.asarray(call(rows[0][1], None))
    first, times = {}, {name: [] for name, _, _ in rows}
    for name, vs, priced in rows:
        t = time.perf_counter()
        out = np.asarray(call(vs, priced))
        first[name] = (time.perf_counter() - t, float(np.max(np.abs(out - reference))))
    for _ in range(args.runs):  # interleaved
        for name, vs, priced in rows:
            t = time.perf_counter()
            call(vs, priced)
            times[name].append(time.perf_counter() - t)
    for name, vs, priced in rows:
        run = functools.partial(values, vs)
        chunk = vs.chunk_size if priced is None else _local_chunk(vs, H, priced, run)
        counts = {}
        if args.estimator == "local_estimators":
            counts = _counts(vs, H, chunk)
        elif priced is not None:  # (NetKet's expect_and_grad: timed, not counted)
            counts = _step_counts(vs, H, chunk)
        row = {
            "row": name,
            "estimator": args.estimator,
            "device": device,
            "dtype": args.dtype,
            "N": args.n,
            "budget_mib": args.budget_mib if priced else None,
            "priced_for": priced,
            "chunk": chunk,
            "first_s": first[name][0],
            "median_s": statistics.median(times[name]),
            "max_abs_diff": first[name][1],
            "max_abs": float(np.max(np.abs(reference))),  # (the values' scale, for the difference)
            **counts,
        }
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


def _counts(vs, H, chunk):
    """Compiled MiB per device, ``ops`` and the modelled ``{cpu,gpu,tpu}_ms`` of NetKet's local-value
    program at ``chunk``."""
    from netket.vqs.mc import get_local_kernel_arguments

    from vmcgrad.netket import _nk_private as nkp
    from vmcgrad.netket._local_values import forward_kernel

    sigma, args = get_local_kernel_arguments(vs, H)
    kernel = forward_kernel(vs, H, chunk)
    compiled = nkp.local_estimators_impl.lower(
        kernel, nkp.apply_fun(vs), sigma.shape[:-1], vs.variables, sigma, args
    ).compile()
    return _program_counts(compiled)


def _step_counts(vs, H, chunk):
    """As :func:`_counts`, of ``vmcgrad.netket.MCState.expect_and_grad``'s one program: NetKet's
    local-value kernel at ``chunk``, the gradient at the state's automatic chunk."""
    from netket.vqs.mc import get_local_kernel_arguments

    from vmcgrad.netket import _expect_grad
    from vmcgrad.netket import _nk_private as nkp
    from vmcgrad.netket._local_values import forward_kernel

    sigma, args = get_local_kernel_arguments(vs, H)
    kernel = forward_kernel(vs, H, chunk)
    compiled = _expect_grad._expect_and_grad_step.lower(
        kernel, nkp.apply_fun(vs), vs._chunk(), vs.parameters, vs.model_state, sigma, args
    ).compile()
    return _program_counts(compiled)


def _program_counts(compiled):
    """Compiled MiB per device, ``ops`` and the modelled ``{cpu,gpu,tpu}_ms`` of a program."""
    import vmcgrad

    cost = vmcgrad.program_cost(compiled, "tpu")
    modelled = {f"{p}_ms": 1e3 * cost.time(p) for p in ("cpu", "gpu", "tpu")}
    return {"mib": vmcgrad.program_bytes(compiled) / 2**20, "ops": cost.ops, **modelled}


def _local_chunk(vs, H, priced, call):
    """The chunk the local values run at in ``call()`` when priced for ``priced`` (the cached choice)."""
    import vmcgrad
    from vmcgrad.netket import _local_values

    chosen = []
    choose, recorded = _local_values.choose_chunk, _local_values.recorded

    def spy(*a, **kw):
        chosen.append(choose(*a, **kw))
        return chosen[-1]

    def spy_recorded(*a, **kw):  # (a cached choice is looked up, not chosen again)
        got = recorded(*a, **kw)
        if got is not None:
            chosen.append(got.value)
        return got

    _local_values.choose_chunk, _local_values.recorded = spy, spy_recorded
    try:
        with vmcgrad.cost_platform(priced):
            call()
    finally:
        _local_values.choose_chunk, _local_values.recorded = choose, recorded
    return chosen[-1] if chosen else vs._chunk()


if __name__ == "__main__":
    main()
