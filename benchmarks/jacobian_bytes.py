r"""What a per-sample Jacobian costs in memory: compiled temporaries of deriving b samples' rows at once.

On the race's model (``time_to_energy.py``'s: the 4×4 J1–J2 GCNN, 3 layers × 8 features, P = 16 536,
float32, 'complex' mode, K = 2), this compiles, for each batch b, the program that derives b
samples' per-sample Jacobians at once (one trip of the model's derivative, as MinSR's kept Jacobian
derives a chunk on an accelerator) and prints its temporaries
(``memory_analysis().temp_size_in_bytes``) and ops (``vmcgrad.program_cost``, priced for a TPU);
the slope in b is the bytes a sample costs besides its row:

- ``at once``: vmcgrad's rows (``vmcgrad._sr.jacobian.flat_jacobian``), jacrev's vmap over the K
  components' cotangents: both components' reverse passes held at once;
- ``in turn``: the same with ``in_turn=True``: one forward pass, the K pullbacks one after another;
- ``netket``: NetKet's ``nk.jax.jacobian(mode='complex', dense=True)`` at chunk b (its
  ``_sr_srt_common`` path): two pullbacks of the complex output, which XLA partly overlaps.

Compile only. Which buffers make up the slope: run with
``XLA_FLAGS=--xla_dump_to=DIR`` and read ``DIR/*jit_*memory-usage-report.txt``.

Usage (PYTHONPATH=.:benchmarks in a checkout)::

    python benchmarks/jacobian_bytes.py                      # b = 1, 2, 4, 8, 16, 32
    python benchmarks/jacobian_bytes.py --batches 4 8 16 --smoke
"""

from __future__ import annotations

import argparse

import time_to_energy as tte  # the race's problem and model (this folder)

MiB = 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--smoke", action="store_true", help="the 12-site chain, a 1-layer GCNN of 4 features")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import netket.jax as nkjax

    import vmcgrad
    from vmcgrad._sr.jacobian import flat_jacobian
    from vmcgrad._sr.ntk.modes import rows_fun, theta_of

    problem, layers, features = ("chain", 1, 4) if args.smoke else ("j1j2", 3, 8)
    race = argparse.Namespace(
        problem=problem, model="gcnn", layers=layers, features=features, dtype="float32"
    )
    hi, g, _, _ = tte.build_problem(race, exact=False)
    model = tte.build_model(race, g)
    x = jnp.asarray(hi.random_state(jax.random.key(0), max(args.batches)), jnp.float32)
    params = model.init(jax.random.key(1), x[:2])["params"]
    f = rows_fun(lambda w, x: model.apply({"params": w}, x), "complex", params)
    theta = theta_of("complex", params)
    p = sum(leaf.size for leaf in jax.tree.leaves(theta))
    row = 2 * p * 4 / MiB
    print(f"{problem}, GCNN {layers} x {features}, P = {p}, float32, 'complex' (K = 2); row {row:.3f} MiB")

    def ours(in_turn):
        return lambda b: jax.jit(lambda t, x: flat_jacobian(f, t, x, "complex", b, in_turn=in_turn)).lower(
            theta, x[:b]
        )

    def netket(b):
        jac = lambda w, x: nkjax.jacobian(
            model.apply, w, x, {}, mode="complex", dense=True, center=False, chunk_size=b
        )
        return jax.jit(jac).lower(params, x[:b])

    print("| derivation | " + " | ".join(f"b = {b}" for b in args.batches) + " | MiB / sample | ops a trip |")
    print("|---|" + "---|" * (len(args.batches) + 2))
    for name, lower in (
        ("vmcgrad, at once", ours(False)),
        ("vmcgrad, in turn", ours(True)),
        ("netket", netket),
    ):
        temps, ops = [], None
        for b in args.batches:
            with vmcgrad.cost_platform("tpu"):
                compiled = lower(b).compile()
            temps.append(compiled.memory_analysis().temp_size_in_bytes / MiB)
            ops = vmcgrad.program_cost(compiled, "tpu").ops
        bs = args.batches
        slope = (temps[-1] - temps[0]) / (bs[-1] - bs[0]) if len(bs) > 1 else float("nan")
        print(
            f"| {name} | " + " | ".join(f"{t:.2f}" for t in temps) + f" | {slope:.3f} | {ops:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
