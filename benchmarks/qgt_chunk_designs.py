"""Compiled temp bytes of one chunk of ``S @ v`` in each design (compile only, one CPU device).

Usage (``PYTHONPATH=.`` not needed: plain JAX and NetKet)::

    python benchmarks/qgt_chunk_designs.py --L 192 --chunk 512
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/qgt_chunk_designs.py

NetKet's ``RBM`` (alpha 1, float64) on one chunk of ``chunk`` samples; each design is jitted alone
and its temp bytes are printed in units of one ``chunk × L`` float64 array: the vjp alone and the
jvp alone (NetKet's two passes), the fused linearise + jvp + transpose (vmcgrad's product), the
jvp then the vjp with the forward recomputed (plain, across ``lax.optimization_barrier``, and with
a fake data dependency ``θ + 0·Σ(Ov)``). The one-loop designs are checked equal to the fused one.
The figures behind ``docs/performance.md#the-qgt-product-which-design-measured``.
"""

import argparse

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)


def designs(f):
    def vjp(p, x, v):  # NetKet's second pass alone, on a given cotangent (ones)
        out, pullback = jax.vjp(lambda p: f(p, x), p)
        return pullback(jnp.ones_like(out))[0]

    def jvp(p, x, v):
        return jax.jvp(lambda p: f(p, x), (p,), (v,))[1]

    def fused(p, x, v):
        _, lin = jax.linearize(lambda p: f(p, x), p)
        return jax.linear_transpose(lin, p)(lin(v))[0]

    def jvp_then_vjp(p, x, v):
        t = jax.jvp(lambda p: f(p, x), (p,), (v,))[1]
        return jax.vjp(lambda p: f(p, x), p)[1](t)[0]

    def jvp_barrier_vjp(p, x, v):
        t = jax.jvp(lambda p: f(p, x), (p,), (v,))[1]
        p2, x2, t = jax.lax.optimization_barrier((p, x, t))
        return jax.vjp(lambda p: f(p, x2), p2)[1](t)[0]

    def jvp_dependency_vjp(p, x, v):
        t = jax.jvp(lambda p: f(p, x), (p,), (v,))[1]
        z = 0.0 * jnp.sum(t)
        return jax.vjp(lambda p: f(p, x), jax.tree.map(lambda a: a + z, p))[1](t)[0]

    return {
        "fused (vmcgrad)": fused,
        "vjp alone": vjp,
        "jvp alone": jvp,
        "jvp then vjp": jvp_then_vjp,
        "jvp, barrier, vjp": jvp_barrier_vjp,
        "jvp, dependency, vjp": jvp_dependency_vjp,
    }


def main() -> None:
    import netket as nk

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=192)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    model = nk.models.RBM(alpha=1, param_dtype=jnp.float64)
    x = nk.hilbert.Spin(0.5, args.L).random_state(jax.random.key(0), args.chunk).astype(jnp.float64)
    p = model.init(jax.random.key(1), x[:2])["params"]
    v = jax.tree.map(jnp.ones_like, p)
    f = lambda p, x: model.apply({"params": p}, x)
    unit = args.chunk * args.L * 8
    fns = designs(f)
    ref = jax.jit(fns["fused (vmcgrad)"])(p, x, v)
    for name, fn in fns.items():
        compiled = jax.jit(fn).lower(p, x, v).compile()
        if "alone" not in name:
            err = max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(compiled(p, x, v)), jax.tree.leaves(ref))
            )
            assert err < 1e-9, (name, err)
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{name:22s} temp {temp:>11,d} B = {temp / unit:5.2f} x (chunk x L x 8 B)")


if __name__ == "__main__":
    main()
