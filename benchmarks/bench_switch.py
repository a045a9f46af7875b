"""End-to-end: NetKet's tutorial drivers on ``nk.vqs.MCState`` against the vmcgrad switch, one process.

Usage (``PYTHONPATH=.`` in a checkout, or vmcgrad installed)::

    python benchmarks/bench_switch.py                                  # every row (minutes)
    python benchmarks/bench_switch.py --models rbm --drivers sr --configs equal-c
    python benchmarks/bench_switch.py --profile rbm:sr                 # cProfile of the switch's steps
    python benchmarks/bench_switch.py --sampling excluded --before     # with the uncached before

Systems and models as in NetKet's tutorials: the transverse-field Ising chain (L sites, h=1,
``nk.sampler.MetropolisLocal``) with ``Jastrow``, a one-hidden-layer real ``FFN`` (the tutorial's
``Dense(alpha*L) -> relu -> sum``), ``RBM`` and ``RBMSymm`` over the chain's translations.

Drivers (each a NetKet driver, the same code on both paths; only the state and the QGT differ):

- ``sr``: ``nk.driver.VMC(H, Sgd(0.01), preconditioner=SR(diag_shift=0.01))``; NetKet's path uses
  ``nk.optimizer.SR`` (its default QGT: ``QGTOnTheFly`` for these models), the switch
  ``vmcgrad.netket.SR`` (vmcgrad's QGT); jax.scipy's cg at its default tolerance.
- ``tdvp``: ``nkx.driver.TDVP`` (imaginary time, Heun, dt=0.005), ``QGTOnTheFly(diag_shift=1e-4)``
  (NetKet's / vmcgrad's), cg, ``error_norm="qgt"``.
- ``vmc_sr``: ``nk.driver.VMC_SR(H, Sgd(0.01), diag_shift=0.01)`` (NetKet's Jacobian/NTK code on
  both paths; the switch changes the local energies' chunking only).

Configurations (``--configs``): ``unchunked`` (both ``chunk_size=None``), ``equal-c`` (both at
``--chunk-size``; it must divide the samples per device, as NetKet's needs), and ``user`` (NetKet
unchunked, the switch at ``--chunk-size``: what a user sees after the README's switch; with the
defaults 1024 samples / 256 = 4 chunks per device).

Timing: for every row both drivers are built, compiled (``--warmup`` steps each), then run in
``--repeats`` interleaved blocks of ``--steps`` steps (NetKet, switch, NetKet, ...); a block's time
is blocked on the parameters. Sampling included: ``driver.advance(steps)``. Excluded: the same with
``vstate.reset`` replaced by a no-op after the warm-up (the samples stay; everything else runs).
Reported: median seconds per step of each path and switch/NetKet. ``--before`` adds a third path,
interleaved with the two: the switch with vmcgrad's per-signature validation cache off (every call
validates its inputs again, as before issue 18 item 4), and its ratio to NetKet.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
import warnings

MODELS = ("jastrow", "ffn", "rbm", "rbm_symm")
DRIVERS = ("sr", "tdvp", "vmc_sr")
CONFIGS = ("unchunked", "equal-c", "user")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--n-samples", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--drivers", nargs="+", default=list(DRIVERS), choices=DRIVERS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument(
        "--sampling", nargs="+", default=["excluded", "included"], choices=["excluded", "included"]
    )
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved blocks per path")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", metavar="MODEL:DRIVER", help="cProfile the switch's steps (config user)")
    ap.add_argument(
        "--before",
        action="store_true",
        help="also time the switch with its per-signature validation cache off (vmcgrad._problem.problem: "
        "every call validates its inputs again, as before issue 18), interleaved with the other two",
    )
    return ap.parse_args()


def build(args, model_name, driver_name, switch, chunk):
    import jax
    import jax.numpy as jnp
    import netket as nk
    import netket.experimental as nkx
    from flax import linen as nn

    import vmcgrad.netket as vnk

    L = args.L
    graph = nk.graph.Chain(L, pbc=True)
    hi = nk.hilbert.Spin(0.5, L)
    H = nk.operator.IsingJax(hi, graph, h=1.0)

    class FFN(nn.Module):  # NetKet's tutorial model
        alpha: int = 1

        @nn.compact
        def __call__(self, x):
            x = nn.Dense(self.alpha * x.shape[-1], param_dtype=jnp.float64)(x)
            return jnp.sum(nn.relu(x), axis=-1)

    model = {
        "jastrow": lambda: nk.models.Jastrow(param_dtype=jnp.float64),
        "ffn": lambda: FFN(alpha=1),
        "rbm": lambda: nk.models.RBM(alpha=1, param_dtype=jnp.float64),
        "rbm_symm": lambda: nk.models.RBMSymm(graph.translation_group(), alpha=1, param_dtype=jnp.float64),
    }[model_name]()
    sampler = nk.sampler.MetropolisLocal(hi, n_chains=16)
    kw = dict(n_samples=args.n_samples, seed=0, sampler_seed=1)
    vs = (
        vnk.MCState(sampler, model, chunk_size=chunk, **kw)
        if switch
        else nk.vqs.MCState(sampler, model, chunk_size=chunk, **kw)
    )
    cg = jax.scipy.sparse.linalg.cg
    if driver_name == "sr":
        sr = vnk.SR(diag_shift=0.01) if switch else nk.optimizer.SR(diag_shift=0.01)
        return nk.driver.VMC(H, nk.optimizer.Sgd(0.01), variational_state=vs, preconditioner=sr), vs
    if driver_name == "vmc_sr":
        return nk.driver.VMC_SR(H, nk.optimizer.Sgd(0.01), diag_shift=0.01, variational_state=vs), vs
    qgt = (vnk.QGTOnTheFly if switch else nk.optimizer.qgt.QGTOnTheFly)(diag_shift=1e-4)
    te = nkx.driver.TDVP(
        H,
        vs,
        nkx.dynamics.Heun(dt=0.005),
        qgt=qgt,
        linear_solver=cg,
        propagation_type="imag",
        error_norm="qgt",
    )
    return te, vs


def advance(driver, steps):
    import jax

    if hasattr(driver, "integrator"):  # TDVP: fixed steps of dt
        driver.run(T=steps * driver.integrator.dt - 1e-12, show_progress=False)
    else:
        driver.run(steps, show_progress=False)
    jax.block_until_ready(driver.state.parameters)


@contextlib.contextmanager
def validation_cache(on):
    """vmcgrad's per-signature validation cache as it is (``on``), or off: every call validates."""
    from vmcgrad._problem import problem as _problem

    kept = _problem._CHECKED_MAX
    if not on:
        _problem._CHECKED_MAX = 0
        _problem._CHECKED.clear()
    try:
        yield
    finally:
        _problem._CHECKED_MAX = kept


def time_row(args, model_name, driver_name, config):
    c = args.chunk_size
    chunks = {"unchunked": (None, None), "equal-c": (c, c), "user": (None, c)}[config]
    paths = ["netket", "switch"] + (["uncached"] if args.before else [])
    built = {p: build(args, model_name, driver_name, p != "netket", chunks[p != "netket"]) for p in paths}
    out = {}
    for sampling in args.sampling:
        for p, (d, vs) in built.items():
            with validation_cache(p != "uncached"):
                advance(d, args.warmup)
            if sampling == "excluded":
                vs.reset = lambda: None  # keep the samples: every other part of the step runs
            elif "reset" in vs.__dict__:
                del vs.reset
        times = {p: [] for p in built}
        for _ in range(args.repeats):
            for p, (d, _vs) in built.items():
                with validation_cache(p != "uncached"):
                    t0 = time.perf_counter()
                    advance(d, args.steps)
                    times[p].append((time.perf_counter() - t0) / args.steps)
        out[sampling] = {p: statistics.median(t) for p, t in times.items()}
    return out


def profile(args, spec):
    model_name, driver_name = spec.split(":")
    d, vs = build(args, model_name, driver_name, True, args.chunk_size)
    advance(d, args.warmup)
    vs.reset = lambda: None
    prof = cProfile.Profile()
    prof.enable()
    advance(d, args.steps * args.repeats)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def main() -> None:
    args = parse()
    import jax

    jax.config.update("jax_enable_x64", True)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.profile:
        return profile(args, args.profile)
    print(
        f"Ising L={args.L}, N={args.n_samples}, c={args.chunk_size}, {jax.device_count()} device(s), "
        f"{args.repeats} interleaved blocks of {args.steps} steps; median s/step"
    )
    head = (
        f"{'model':<9} {'driver':<7} {'config':<10} {'sampling':<9} {'netket':>9} {'switch':>9} {'ratio':>6}"
    )
    if args.before:
        head += f" {'uncached':>9} {'ratio':>6}"
    print(head)
    for model_name in args.models:
        for driver_name in args.drivers:
            for config in args.configs:
                row = time_row(args, model_name, driver_name, config)
                for sampling, t in row.items():
                    r = t["switch"] / t["netket"]
                    line = (
                        f"{model_name:<9} {driver_name:<7} {config:<10} {sampling:<9} "
                        f"{t['netket']:9.4f} {t['switch']:9.4f} {r:6.2f}"
                    )
                    if args.before:
                        line += f" {t['uncached']:9.4f} {t['uncached'] / t['netket']:6.2f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
