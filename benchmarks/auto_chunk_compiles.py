"""How many programs ``chunk_size="auto"`` compiles to choose a chunk (compile only, CPU).

Usage (with vmcgrad installed, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/auto_chunk_compiles.py              # the table below
    python benchmarks/auto_chunk_compiles.py --cli vmc --L 8 --samples 128 --chunk-size auto \\
        --steps 2 --devices 4 --out /tmp/auto-run       # a whole `vmcgrad vmc` run, in this process

The table: NetKet's ``RBM(alpha=2)``, complex128, L = 32, N = 4096, one CPU device; per memory
budget, the chunk :func:`vmcgrad.auto_chunk_size` picks for ``expect_grad`` and for the ``QGT``
and how many of vmcgrad's programs (the gradient, the QGT product, the QGT's mean pass) were
compiled to pick it. ``--cli`` runs the command line with the given arguments instead and prints
every compiled program's count and XLA compile seconds. Run it at two commits to compare a change
of the search (``git worktree add /tmp/old REV && PYTHONPATH=/tmp/old python
benchmarks/auto_chunk_compiles.py``).
"""

import argparse
import collections
import sys

import jax

#: The programs the search compiles, by the name JAX gives them.
SEARCHED = ("jit(grad_program)", "jit(matmul_program)", "jit(_mean_program)")

compiles: collections.Counter = collections.Counter()
seconds: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        compiles[fun_name] += 1
        seconds[fun_name] += duration


jax.monitoring.register_event_duration_secs_listener(_listen)


def budgets() -> None:
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import netket as nk
    from benchlib import Column, table

    import vmcgrad

    model = nk.models.RBM(alpha=2, param_dtype=jnp.complex128)
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    x = jax.random.choice(jax.random.key(1), jnp.array([-1.0, 1.0]), (4096, 32))

    def logpsi(w, s):
        return model.apply({"params": w}, s)

    rows = []
    for budget in (2**40, 2**21, 3 * 2**20, 5 * 2**20, 9 * 2**20):
        row = {"budget": budget / 2**20}
        for estimator in ("expect_grad", "QGT"):
            jax.clear_caches()
            compiles.clear()
            row[estimator] = vmcgrad.auto_chunk_size(
                logpsi, params, x, estimator=estimator, memory_budget=budget
            )
            row[f"{estimator} compiles"] = sum(compiles[name] for name in SEARCHED)
        rows.append(row)
    columns = [Column("budget [MiB]", "budget", ".0f")]
    for estimator in ("expect_grad", "QGT"):
        columns += [Column(f"{estimator} chunk", estimator), Column("compiled", f"{estimator} compiles")]
    print(table(rows, columns))


def cli(argv: list[str]) -> int:
    from vmcgrad.cli import main

    try:
        return main(argv)
    finally:
        print(f"{sum(compiles.values())} programs compiled, {sum(seconds.values()):.1f} s of XLA compile")
        for name, secs in seconds.most_common(12):
            print(f"{secs:7.2f} s {compiles[name]:4d}  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", nargs=argparse.REMAINDER, help="`vmcgrad` arguments: run them instead")
    args = parser.parse_args()
    sys.exit(cli(args.cli) if args.cli else budgets())
