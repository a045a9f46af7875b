"""Gradient benchmark: vmcgrad.expect_grad vs NetKet's chunked force vs jax.vjp on RBMModPhase (R→C).

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_grad.py                      # the process's default device count
    python benchmarks/bench_grad.py --devices 4          # 4 fake CPU devices (NetKet's mesh "S")
    python benchmarks/bench_grad.py --L 48 --n-samples 8192 --chunk-size 1024 --json rows.json

The device count is fixed per process, so ``--devices`` sets ``jax_num_cpu_devices`` and NetKet's
``NETKET_EXPERIMENTAL_SHARDING_CPU`` before JAX or NetKet is imported. Bar (issue 3): time
<= 0.6x NetKet's chunked force, goal <= 0.5x.
"""

from __future__ import annotations

import argparse

BAR, GOAL = 0.6, 0.5


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=None, help="fake CPU device count (default: JAX's)")
    ap.add_argument("--L", type=int, default=48, help="spins (RBMModPhase with alpha=1)")
    ap.add_argument("--n-samples", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timed calls per candidate")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    return ap.parse_args()


def main() -> None:
    args = parse()
    import jax
    from benchlib import use_cpu_devices

    use_cpu_devices(args.devices)

    from benchlib import format_table, write_json
    from benchlib.grad import run

    rows = run(L=args.L, n_samples=args.n_samples, chunk_size=args.chunk_size, repeats=args.repeats)
    extra = {"L": args.L, "N": args.n_samples, "chunk": args.chunk_size}
    write_json([{**r.as_dict(), **extra} for r in rows], args.json)
    print(
        f"\nRBMModPhase(alpha=1), L={args.L}, N={args.n_samples}, chunk={args.chunk_size}, "
        f"devices={jax.device_count()}, repeats={args.repeats}"
    )
    print(format_table(rows, baseline="netket"))
    by_name = {r.name: r for r in rows}
    me, nk = by_name["vmcgrad"], by_name["netket"]
    t = me.median / nk.median
    verdict = "goal met" if t <= GOAL else ("bar met" if t <= BAR else "BAR MISSED")
    print(f"\nvmcgrad / netket time: {t:.3f} (bar {BAR}, goal {GOAL}: {verdict})")
    print(f"vmcgrad / netket temp memory: {me.temp_bytes / nk.temp_bytes:.3f}")


if __name__ == "__main__":
    main()
