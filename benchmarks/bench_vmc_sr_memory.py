"""Memory of one SR step with the switch: NetKet's VMC_SR (Jacobian / NTK) vs VMC + SR with vmcgrad's QGT.

Each variant runs in its own process (one CPU device, float64): a real RBM on a chain of ``--L``
sites, ``--samples`` samples, ``vmcgrad.netket.MCState(chunk_size=--chunk)``. The figure is the
growth of the process's peak resident memory (``ru_maxrss``) during the first optimisation step,
compilation included, over the state after sampling and one ``expect`` (which compiles the local
values). Variants:

- ``vmc_sr``: ``nk.driver.VMC_SR(use_ntk=False)`` — NetKet builds the N×P Jacobian (in chunks of
  ``chunk_size_bwd = c``) and the P×P matrix;
- ``vmc_sr_ntk``: ``use_ntk=True, on_the_fly=False`` — the N×P Jacobian and the N×N NTK;
- ``vmc_sr_ntk_otf``: ``use_ntk=True, on_the_fly=True`` — an N/d×N NTK block per device, the
  Jacobians of the N/d local samples at once;
- ``vmc_qgt_onthefly``: ``nk.driver.VMC`` + ``nk.optimizer.SR(qgt=vmcgrad.netket.QGTOnTheFly, cg)`` —
  nothing of size N×P or P×P.

Usage::

    python benchmarks/bench_vmc_sr_memory.py --L 32 --alpha 4 --samples 2048 --chunk 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

VARIANTS = ["vmc_sr", "vmc_sr_ntk", "vmc_sr_ntk_otf", "vmc_qgt_onthefly"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_variant(variant: str, L: int, alpha: int, samples: int, chunk: int) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import netket as nk
    import optax

    import vmcgrad.netket as vnk

    g = nk.graph.Chain(L, pbc=True)
    hi = nk.hilbert.Spin(0.5, L, total_sz=0)
    H = nk.operator.Heisenberg(hi, g)
    vs = vnk.MCState(
        nk.sampler.MetropolisExchange(hi, graph=g, n_chains=16),
        nk.models.RBM(alpha=alpha, param_dtype=jnp.float64),
        n_samples=samples,
        seed=0,
        chunk_size=chunk,
    )
    jax.block_until_ready(vs.samples)
    vs.expect(H)
    if variant == "vmc_qgt_onthefly":
        sr = nk.optimizer.SR(qgt=vnk.QGTOnTheFly, solver=jax.scipy.sparse.linalg.cg, diag_shift=0.01)
        driver = nk.driver.VMC(H, optax.sgd(0.01), variational_state=vs, preconditioner=sr)
    else:
        modes = {"vmc_sr": (False, False), "vmc_sr_ntk": (True, False), "vmc_sr_ntk_otf": (True, True)}
        use_ntk, otf = modes[variant]
        driver = nk.driver.VMC_SR(
            H, optax.sgd(0.01), diag_shift=0.01, variational_state=vs, use_ntk=use_ntk, on_the_fly=otf
        )
    before = _rss_mb()
    jax.block_until_ready(driver.compute_loss_and_update())
    return {
        "variant": variant,
        "n_parameters": vs.n_parameters,
        "n_samples": vs.n_samples,
        "chunk": chunk,
        "peak_growth_mb": round(_rss_mb() - before, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", type=int, default=32)
    parser.add_argument("--alpha", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.L, args.alpha, args.samples, args.chunk)))
        return
    env = dict(os.environ, NETKET_EXPERIMENTAL_SHARDING_CPU="1")
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant]
        cmd += ["--L", str(args.L), "--alpha", str(args.alpha), "--samples", str(args.samples)]
        cmd += ["--chunk", str(args.chunk)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
