"""Forward mode through an estimator: one combined primal-and-tangent pass against two passes.

Usage (with vmcgrad installed, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_combined_jvp.py                 # one device
    python benchmarks/bench_combined_jvp.py --devices 4     # samples split over 4 fake CPU devices

``g = vmcgrad.expect_grad`` of a real two-layer tanh MLP (16 -> 64 -> 64 -> 1, 5,248 parameters),
N = 1024 samples, chunk 64, float64. Candidates, timed in turns (medians) with the compiled temp bytes:

- ``jax.jvp``: ``jax.jvp(g, (p,), (t,))``. The chunked primitive's jvp rule binds one pass that
  computes the primal and the tangent together (real outputs only).
- ``linearize``: ``jax.linearize(g, p)`` then the linear map at ``t``: the partial-evaluation rule
  splits that pass into a primal pass and a tangent pass, which is the program ``jax.jvp`` would be
  without the combined pass (the tangent pass recomputes the forward pass).
- ``grad(grad)``: ``jax.grad`` of ``|g(p)|^2``: reverse mode splits the combined pass the same way,
  so the combined pass neither helps nor costs there (listed for its bytes and time).
"""

from __future__ import annotations

import argparse


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1, help="fake CPU device count")
    ap.add_argument("--n-samples", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21, help="interleaved timed calls per candidate")
    return ap.parse_args()


def main() -> None:
    args = parse()
    from benchlib import use_cpu_devices

    use_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp
    from benchlib import Candidate, check_agree, format_table, measure

    import vmcgrad

    d, h, n, c = 16, 64, args.n_samples, args.chunk_size
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "W1": jax.random.normal(k1, (d, h)) / d**0.5,
        "b1": jnp.zeros(h),
        "W2": jax.random.normal(k2, (h, h)) / h**0.5,
        "w3": jnp.ones(h) / h,
    }
    x = jax.random.normal(k3, (n, d))
    if args.devices > 1:
        # Auto axes, as the mesh NetKet sets when benchlib imports it
        mesh = jax.make_mesh((args.devices,), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("S")))
    local = jnp.linspace(-1.0, 1.0, n)

    def mlp(p, x):
        a = jnp.tanh(x @ p["W1"] + p["b1"])
        return jnp.tanh(a @ p["W2"]) @ p["w3"]

    g = lambda p: vmcgrad.expect_grad(mlp, p, x, local, chunk_size=c)
    square = lambda t: sum(jnp.sum(a**2) for a in jax.tree.leaves(t))

    def linearized(p, t):
        out, f_jvp = jax.linearize(g, p)
        return out, f_jvp(t)

    programs = {
        "jax.jvp": lambda p, t: jax.jvp(g, (p,), (t,)),
        "linearize": linearized,
        "grad(grad)": lambda p, t: jax.grad(lambda p: square(g(p)))(p),
    }
    compiled = {name: jax.jit(f).lower(params, params).compile() for name, f in programs.items()}
    errs = check_agree({k: compiled[k](params, params) for k in ("jax.jvp", "linearize")}, rtol=1e-12)
    print(f"jax.jvp against linearize: max relative error {max(errs.values()):.1e}")
    candidates = [Candidate(k, lambda f=f: f(params, params), f) for k, f in compiled.items()]
    setting = {
        "N": n,
        "chunk": c,
        "params": sum(a.size for a in jax.tree.leaves(params)),
        "devices": args.devices,
    }
    rows = measure("combined_jvp", setting, candidates, repeats=args.repeats)
    print(format_table(rows, baseline="linearize"))


if __name__ == "__main__":
    main()
