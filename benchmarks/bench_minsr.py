"""Sample-space SR (MinSR) at a memory budget: vmcgrad's NTK against NetKet's ``VMC_SR`` kernels.

One sample-space SR step δθ = ΔJ†(T + λ)⁻¹ε/√N (local energies given), compiled (never run) on abstract
samples, so N can exceed the machine. Per device: ``total`` = temporaries + arguments + outputs of the
compiled program (``memory_analysis()``), the figure a budget is compared with. Candidates:

- ``vmcgrad dense``: ``vmcgrad.minsr_update(..., chunk_size=c)``, the kernel built block by block
  (c rows × c columns per block, per-chunk Jacobians), Cholesky solve of the N×N (2N×2N) kernel;
- ``vmcgrad cg``: the same with ``solver="cg"``, ``--cg-iters`` iterations of ``T @ v`` (one jvp and one vjp
  pass each; no N×N matrix);
- ``VMC_SR dense``: NetKet's ``srt`` (``use_ntk=True, on_the_fly=False``: the N×P Jacobian, the N×N kernel);
- ``VMC_SR ntk``: NetKet's ``srt_onthefly`` (``on_the_fly=True``: an N/d×P Jacobian per device);

all at ``chunk_size_bwd = c`` and NetKet's default solver ``cholesky_with_fallback`` for the dense ones.
Models (real parameters, complex log ψ): NetKet's ``GCNN`` on the 6×6 square lattice with all 288
symmetries, features (8, 8, 8, 8) (P = 55 616), and a flax ViT (2×2 patches, embedding 64, 2 blocks,
P = 100 354); float64 and float32. The largest N per device at a budget is found by doubling then
bisection over compiled programs (to 1/16 of N), both ends verified.

Usage (standalone; PYTHONPATH=. in a checkout)::

    python benchmarks/bench_minsr.py --models gcnn --dtypes float64 --sizes 256 1024 --budgets-mib 256 1024
    python benchmarks/bench_minsr.py --small --sizes 64 256 --budgets-mib 8   # smoke run, 4x4 models
"""

from __future__ import annotations

import argparse
import json
import time

from benchlib.large import largest_n

IMPLS = ("vmcgrad dense", "vmcgrad cg", "VMC_SR dense", "VMC_SR ntk")
MiB = 2**20


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gcnn", "vit"], choices=["gcnn", "vit"])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    ap.add_argument("--small", action="store_true", help="4x4 lattice, tiny models (smoke run)")
    ap.add_argument("--sizes", type=int, nargs="*", default=[256, 1024, 4096], help="N of the memory table")
    ap.add_argument("--budgets-mib", type=float, nargs="*", default=[256, 1024])
    ap.add_argument("--chunk", type=int, default=16, help="chunk_size / chunk_size_bwd of every candidate")
    ap.add_argument("--cg-iters", type=int, default=10)
    ap.add_argument("--n-max", type=int, default=2**17, help="largest N the budget search tries")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


def make_model(name, dtype, small):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import netket as nk

    dt = jnp.dtype(dtype)
    L = 4 if small else 6
    if name == "gcnn":
        feats = (2, 2) if small else (8, 8, 8, 8)
        model = nk.models.GCNN(
            symmetries=nk.graph.Square(L), layers=len(feats), features=feats, param_dtype=dt
        )
    else:
        embed, depth, heads = (8, 1, 2) if small else (64, 2, 4)

        class ViT(nn.Module):
            @nn.compact
            def __call__(self, x):
                b, n, p = x.shape[0], L // 2, 2
                t = x.reshape(b, n, p, n, p).transpose(0, 1, 3, 2, 4).reshape(b, n * n, p * p).astype(dt)
                h = nn.Dense(embed, param_dtype=dt, dtype=dt)(t)
                h = h + self.param("pos", nn.initializers.normal(0.02), (n * n, embed), dt)
                for _ in range(depth):
                    y = nn.LayerNorm(param_dtype=dt, dtype=dt)(h)
                    h = h + nn.MultiHeadDotProductAttention(num_heads=heads, param_dtype=dt, dtype=dt)(y, y)
                    y = nn.LayerNorm(param_dtype=dt, dtype=dt)(h)
                    y = nn.Dense(4 * embed, param_dtype=dt, dtype=dt)(y)
                    h = h + nn.Dense(embed, param_dtype=dt, dtype=dt)(nn.gelu(y))
                h = nn.LayerNorm(param_dtype=dt, dtype=dt)(h).sum(axis=1)
                out = nn.Dense(2, param_dtype=dt, dtype=dt, kernel_init=nn.initializers.normal(0.01))(h)
                return jax.lax.complex(out[:, 0], out[:, 1])

        model = ViT()
    params = model.init(jax.random.key(0), jnp.ones((2, L * L), dt))["params"]
    return model, params, L * L


def compiled_bytes(impl, model, params, n_sites, n, args):
    """Per-device bytes of one SR step at N = n, compiled on abstract inputs (None if it does not compile)."""
    import jax
    import jax.numpy as jnp
    import netket as nk
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vmcgrad

    dt = jax.tree.leaves(params)[0].dtype
    cdt = jnp.result_type(dt, jnp.complex64)
    mesh = jax.sharding.get_abstract_mesh()
    shard = NamedSharding(jax.sharding.get_mesh(), P("S")) if not mesh.empty else None
    x = jax.ShapeDtypeStruct((n, n_sites), dt, sharding=shard)
    e = jax.ShapeDtypeStruct((n,), cdt, sharding=shard)
    w = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    diag = 1e-4
    if impl.startswith("vmcgrad"):
        logpsi = lambda p, s: model.apply({"params": p}, s)
        solver = "cg" if impl == "vmcgrad cg" else None

        def step(w, x, e):
            return vmcgrad.minsr_update(
                logpsi,
                w,
                x,
                e,
                diag_shift=diag,
                chunk_size=args.chunk,
                solver=solver,
                maxiter=args.cg_iters,
                tol=0.0,
            )[0]

        lowered = jax.jit(step).lower(w, x, e)
    else:
        from netket._src.ngd.sr_srt_common import _sr_srt_common
        from netket._src.ngd.srt_onthefly import srt_onthefly

        # timed wrappers (functools.wraps) around the jitted kernels VMC_SR calls
        kernel = (_sr_srt_common if impl == "VMC_SR dense" else srt_onthefly).__wrapped__
        kw = dict(
            diag_shift=diag,
            solver_fn=nk.optimizer.solver.cholesky_with_fallback,
            mode="complex",
            chunk_size=args.chunk,
        )
        if impl == "VMC_SR dense":
            kw["use_ntk"] = True
        lowered = kernel.lower(model.apply, e, w, {}, x, **kw)
    return vmcgrad.program_bytes(lowered.compile())


def main(argv=None):
    args = parse(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    import netket as nk  # noqa: F401  (sets its mesh)

    results = {"config": vars(args), "memory": [], "limits": []}
    n_dev = jax.device_count()
    for name in args.models:
        for dtype in args.dtypes:
            model, params, n_sites = make_model(name, dtype, args.small)
            n_params = sum(p.size for p in jax.tree.leaves(params))
            print(f"== {name} {dtype} P={n_params} devices={n_dev} chunk={args.chunk}")
            for n in args.sizes:
                for impl in args.impls:
                    t0 = time.perf_counter()
                    try:
                        b = compiled_bytes(impl, model, params, n_sites, n, args)
                    except Exception as err:  # a candidate that cannot compile at this N
                        b, why = None, f"{type(err).__name__}: {str(err)[:120]}"
                    row = dict(model=name, dtype=dtype, P=n_params, N=n, impl=impl, total_bytes=b)
                    results["memory"].append(row)
                    cell = f"{b / MiB:10.2f} MiB" if b is not None else f"   -- ({why})"
                    print(f"  N={n:<7} {impl:<14} {cell}  ({time.perf_counter() - t0:.1f} s)")
            for budget in args.budgets_mib:
                for impl in args.impls:
                    cache = {}

                    def fits(n, impl=impl, budget=budget, cache=cache, m=(model, params, n_sites)):
                        if n not in cache:
                            try:
                                cache[n] = compiled_bytes(impl, *m, n, args) <= budget * MiB
                            except Exception:
                                cache[n] = False
                        return cache[n]

                    lo, hi, _ = largest_n(
                        fits, granule=args.chunk * n_dev, hint=4 * args.chunk * n_dev, n_max=args.n_max
                    )
                    results["limits"].append(
                        dict(
                            model=name, dtype=dtype, P=n_params, budget_mib=budget, impl=impl, n=lo, n_fail=hi
                        )
                    )
                    print(
                        f"  budget {budget:g} MiB  {impl:<14} largest N = {lo} ({lo // n_dev} per device)"
                        f"  [{'≥ n_max' if hi is None else f'{hi} does not fit'}]"
                    )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
