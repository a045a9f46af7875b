"""Compiled temp bytes of ``S @ v`` per product design, and its CPU time per chunk size (one CPU device).

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/qgt_design_bytes.py                                  # RBM L=48, N=8192, chunk 1024
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/qgt_design_bytes.py
    python benchmarks/qgt_design_bytes.py --time-chunks 16 32 64 --repeats 9

NetKet's ``RBM`` (alpha 1, float64). Prints the temp bytes of the compiled product ``S @ v`` (the
operator built outside the program) of NetKet's ``QGTOnTheFly`` and of ``vmcgrad.QGT(...,
design=d)`` for each design at ``--chunk``, in units of one ``chunk × L`` float64 array: the
figures of ``docs/performance.md``, "The design, chosen from the budget". With ``--time-chunks``,
also the median process CPU time of the fused product at each of those chunk sizes over
interleaved calls, and its ratio to the time at the largest: the per-chunk cost on this CPU, against
which the CPU constants of ``vmcgrad._hlo.cost.PLATFORMS`` (what the design choice prices) are checked.
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=48, help="spins (RBM with alpha=1)")
    ap.add_argument("--n-samples", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024, help="chunk size of the bytes rows")
    ap.add_argument("--time-chunks", type=int, nargs="*", default=[], help="chunk sizes to time (fused)")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved timed calls per chunk size")
    return ap.parse_args()


def main() -> None:
    args = parse()
    from benchlib import init_model, log_psi, place, use_cpu_devices

    use_cpu_devices(1)
    import jax
    import jax.numpy as jnp
    import netket as nk
    from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

    import vmcgrad

    model = nk.models.RBM(alpha=1, param_dtype=jnp.float64)
    s = init_model(model, args.L, args.n_samples, 0)
    x, (w, state) = place(s["samples"].astype(jnp.float64), (s["params"], s["model_state"]))
    v = jax.tree.map(jnp.ones_like, w)
    logpsi = log_psi(model.apply, state)
    unit = args.chunk * args.L * 8
    product = jax.jit(lambda S, v: S @ v)

    def temp(compiled) -> float:
        return compiled.memory_analysis().temp_size_in_bytes / unit

    def theirs(w, x, v):
        return QGTOnTheFly_DefaultConstructor(model.apply, w, state, x, chunk_size=args.chunk) @ v

    theirs = jax.jit(theirs)
    print(
        f"temp bytes of S @ v in chunk x L x 8 B units (L={args.L}, N={args.n_samples}, chunk {args.chunk}):"
    )
    print(f"  netket QGTOnTheFly: {temp(theirs.lower(w, x, v).compile()):.2f}")
    for design in ("fused", "jvp_vjp"):
        S = vmcgrad.QGT(logpsi, w, x, chunk_size=args.chunk, design=design)
        print(f"  vmcgrad {design}: {temp(product.lower(S, v).compile()):.2f}")

    if not args.time_chunks:
        return
    ops = {c: vmcgrad.QGT(logpsi, w, x, chunk_size=c) for c in args.time_chunks}
    for S in ops.values():
        jax.block_until_ready(product(S, v))  # compile and warm up
    times: dict[int, list[float]] = {c: [] for c in ops}
    for _ in range(args.repeats):
        for c, S in ops.items():
            t = time.process_time()
            jax.block_until_ready(product(S, v))
            times[c].append(time.process_time() - t)
    base = statistics.median(times[max(ops)])
    print(f"process CPU time of the fused S @ v, median of {args.repeats} interleaved calls:")
    for c in sorted(ops):
        med = statistics.median(times[c])
        print(f"  chunk {c}: {med * 1e3:.1f} ms, {med / base:.2f}x chunk {max(ops)}")


if __name__ == "__main__":
    main()
