r"""Sample-space SR (MinSR) at a memory budget and in time: vmcgrad's NTK against NetKet's ``VMC_SR``.

Models: :func:`benchlib.large.make_problem` (NetKet's ``GCNN`` on the 6×6 square lattice with all 288
symmetries, features (8, 8, 8, 8), P = 55 616; the flax ViT of :mod:`benchlib._vit`, 2×2 patches,
embedding 64, 2 blocks, P = 101 122; real parameters, complex log ψ, float64 or float32; ``--size small``
for the 4×4 versions).

**Memory** (compiled, never run, on abstract samples, so N can exceed the machine). One sample-space SR
step δθ = ΔJ†(T + λ)⁻¹ε/√N with the local energies given; per device ``total`` = temporaries +
arguments + outputs (:func:`vmcgrad.program_bytes`), the figure a budget is compared with:

- ``vmcgrad dense``: ``vmcgrad.minsr_update(..., chunk_size=c)``: the kernel built block by block
  (c rows × c columns, per-chunk Jacobians, the blocks on and above the diagonal, the rest filled by
  symmetry), Cholesky solve of the N×N (2N×2N) kernel;
- ``vmcgrad cg``: the same with ``solver="cg"``, ``--cg-iters`` iterations of ``T @ v`` (one jvp and one
  vjp pass each; no N×N matrix), without the Nyström preconditioner (``nystrom_rank=None``): the
  route's memory floor. Its default ``nystrom_rank="auto"`` adds r sampled Jacobian rows, r at most
  N/2 and what half the budget holds (``benchmarks/bench_minsr_routes.py --part cg`` measures it);
- ``VMC_SR dense``: NetKet's ``use_ntk=False`` kernel (the N×P Jacobian and the P×P matrix);
- ``VMC_SR ntk``: ``use_ntk=True, on_the_fly=False`` (``srt``: the N×P Jacobian, the N×N kernel);
- ``VMC_SR ntk otf``: ``use_ntk=True, on_the_fly=True`` (``srt_onthefly``: an N/d × P Jacobian per device);

NetKet's at ``chunk_size_bwd = c`` and its default solver ``cholesky_with_fallback``. The largest N per
device at a budget is found by :func:`benchlib.large.largest_n` over compiled programs (both ends verified).

**Time** (``--time-n N``, 0 to skip): one driver step as a user runs it, sampling excluded. One
``nk.vqs.MCState`` (sampled once, chunk c) is shared by the drivers, and each timed call is
``driver.compute_loss_and_update()``: the local energies of the Heisenberg model on the lattice plus the
update, blocked on. Candidates, called in turns (harness :func:`benchlib.measure`, median of
``--repeats``): ``vmcgrad.netket.VMC_SR(use_ntk=True)`` at ``chunk_size_bwd`` c and at one block (N per
device), NetKet's ``nk.driver.VMC_SR(use_ntk=True)`` NTK and NTK on the fly at ``chunk_size_bwd`` c, and
the local energies alone (the part every driver shares). The updates are checked against NetKet's
(relative 1e-8 in float64, 1e-3 in float32) before timing.

Usage (standalone; PYTHONPATH=. in a checkout)::

    python benchmarks/bench_minsr.py --models gcnn vit --dtypes float64 float32 --time-n 0
    python benchmarks/bench_minsr.py --models gcnn --dtypes float64 --budgets-mib --sizes 256 --time-n 256
    python benchmarks/bench_minsr.py --size small --sizes 64 256 --budgets-mib 8 --time-n 64   # smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

IMPLS = ("vmcgrad dense", "vmcgrad cg", "VMC_SR dense", "VMC_SR ntk", "VMC_SR ntk otf")
MiB = 2**20


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1, help="fake CPU devices (memory is per device)")
    ap.add_argument("--models", nargs="+", default=["gcnn", "vit"], choices=["gcnn", "vit"])
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    ap.add_argument("--size", default="large", choices=["large", "small"], help="model size (small: 4x4)")
    ap.add_argument("--sizes", type=int, nargs="*", default=[256, 1024], help="N of the memory table")
    ap.add_argument("--budgets-mib", type=float, nargs="*", default=[256, 1024], help="(none: skip)")
    ap.add_argument("--chunk", type=int, default=16, help="chunk_size / chunk_size_bwd of every candidate")
    ap.add_argument("--cg-iters", type=int, default=10)
    ap.add_argument("--diag-shift", type=float, default=1e-2)
    ap.add_argument("--n-max", type=int, default=2**17, help="largest N the budget search tries")
    ap.add_argument("--rel", type=float, default=1 / 16, help="relative precision of the budget search")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="memory candidates")
    ap.add_argument("--time-n", type=int, default=0, help="N of the timed driver steps (0: no timing)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed calls per candidate")
    ap.add_argument("--json", metavar="PATH")
    return ap.parse_args(argv)


# --- memory ------------------------------------------------------------------------------------


def compiled_bytes(impl, prob, n, args):
    """Per-device bytes of one SR step at N = n, compiled on abstract inputs."""
    import netket as nk
    from benchlib.large import abstract_inputs
    from netket._src.ngd.sr_srt_common import _sr_srt_common
    from netket._src.ngd.srt_onthefly import srt_onthefly

    import vmcgrad

    x, e, w = abstract_inputs(prob, n)
    if impl.startswith("vmcgrad"):
        solver = "cg" if impl == "vmcgrad cg" else None

        def step(w, x, e):
            return vmcgrad.minsr_update(
                prob.logpsi,
                w,
                x,
                e,
                diag_shift=args.diag_shift,
                mode=prob.mode,
                chunk_size=args.chunk,
                solver=solver,
                route="cg" if solver else "dense",  # the route measured, not the rule's choice
                nystrom_rank=None,  # plain CG: the matrix-free route's memory floor (no sampled rows)
                maxiter=args.cg_iters,
                tol=0.0,
            )[0]

        import jax

        lowered = jax.jit(step).lower(w, x, e)
    else:
        # timed wrappers (functools.wraps) around the jitted kernels nk.driver.VMC_SR calls
        kernel = (srt_onthefly if impl == "VMC_SR ntk otf" else _sr_srt_common).__wrapped__
        kw = dict(
            diag_shift=args.diag_shift,
            solver_fn=nk.optimizer.solver.cholesky_with_fallback,
            mode=prob.mode,
            chunk_size=args.chunk,
        )
        if impl != "VMC_SR ntk otf":
            kw["use_ntk"] = impl == "VMC_SR ntk"
        lowered = kernel.lower(prob.model.apply, e, w, {}, x, **kw)
    return vmcgrad.program_bytes(lowered.compile())


def memory(prob, args, results, log=print):
    import jax
    from benchlib.large import largest_n

    n_dev = jax.device_count()
    for n in args.sizes:
        for impl in args.impls:
            t0 = time.perf_counter()
            try:
                b = compiled_bytes(impl, prob, n, args)
            except Exception as err:  # a candidate that cannot compile at this N (e.g. no divisor)
                b, why = None, f"{type(err).__name__}: {str(err)[:120]}"
            row = dict(model=prob.name, dtype=prob.dtype, P=prob.n_params, N=n, impl=impl, total_bytes=b)
            results["memory"].append(row)
            cell = f"{b / MiB:10.2f} MiB" if b is not None else f"   -- ({why})"
            log(f"  N={n:<7} {impl:<15} {cell}  ({time.perf_counter() - t0:.1f} s)")
    # bytes per impl and N (None: does not compile), shared by the budgets' searches
    measured = {}
    for r in results["memory"]:
        if r["model"] == prob.name and r["dtype"] == prob.dtype:
            measured.setdefault(r["impl"], {})[r["N"]] = r["total_bytes"]
    for budget in args.budgets_mib:
        for impl in args.impls:
            cache = measured.setdefault(impl, {})

            def fits(n, impl=impl, budget=budget, cache=cache):
                if n not in cache:
                    try:
                        cache[n] = compiled_bytes(impl, prob, n, args)
                    except Exception:
                        cache[n] = None
                return cache[n] is not None and cache[n] <= budget * MiB

            t0 = time.perf_counter()
            granule = args.chunk * n_dev
            hint = _hint({n: b for n, b in cache.items() if b}, budget * MiB, default=4 * granule)
            lo, hi, probes = largest_n(
                fits,
                granule=granule,
                hint=max(granule, min(hint, args.n_max)),
                n_max=args.n_max,
                rel=args.rel,
            )
            results["limits"].append(
                dict(
                    model=prob.name,
                    dtype=prob.dtype,
                    P=prob.n_params,
                    budget_mib=budget,
                    impl=impl,
                    n_per_device=lo // n_dev,
                    n_fail_per_device=None if hi is None else hi // n_dev,
                    compiles=probes,
                )
            )
            log(
                f"  budget {budget:g} MiB  {impl:<15} largest N/device = {lo // n_dev}"
                f"  [{'>= n_max' if hi is None else f'{hi // n_dev} does not fit'}; {probes} probes, "
                f"{time.perf_counter() - t0:.0f} s]"
            )


def _hint(points: dict, budget: float, default: int) -> int:
    """Where ``bytes(N) = budget`` on the power law ``b N^p`` through the two largest measured points
    (the programs here are affine or quadratic in N); only a start for the search, which compiles."""
    if len(points) < 2:
        return default
    (n1, b1), (n2, b2) = sorted(points.items())[-2:]
    p = min(2.0, max(0.05, math.log(b2 / b1) / math.log(n2 / n1))) if b2 > b1 else 0.05
    return int(n2 * (budget / b2) ** (1 / p))


# --- time --------------------------------------------------------------------------------------


def step_times(prob, n, args, results, log=print):
    """Interleaved driver steps (sampling excluded): vmcgrad's VMC_SR against NetKet's."""
    import jax
    import netket as nk
    import optax
    from benchlib import Candidate, check_agree, measure

    import vmcgrad.netket as vnk

    n_dev = jax.device_count()
    L = math.isqrt(prob.n_sites)
    g = nk.graph.Square(L)
    hi = nk.hilbert.Spin(0.5, g.n_nodes, total_sz=0)
    H = nk.operator.Heisenberg(hi, g)
    sampler = nk.sampler.MetropolisExchange(hi, graph=g, n_chains=n, dtype=prob.dtype)
    vs = nk.vqs.MCState(sampler, prob.model, n_samples=n, n_discard_per_chain=0, chunk_size=args.chunk)
    vs.parameters = prob.params
    t0 = time.perf_counter()
    jax.block_until_ready(vs.sample())
    log(f"  sampled {n} configurations once ({time.perf_counter() - t0:.1f} s); shared by every driver")

    common = dict(diag_shift=args.diag_shift, variational_state=vs, use_ntk=True)
    opt = optax.sgd(0.01)
    drivers = {
        f"vmcgrad VMC_SR c={args.chunk}": vnk.VMC_SR(
            H, opt, chunk_size_bwd=args.chunk, route="dense", **common
        ),
        f"vmcgrad VMC_SR c={n // n_dev}": vnk.VMC_SR(
            H, opt, chunk_size_bwd=n // n_dev, route="dense", **common
        ),
        "NetKet VMC_SR ntk": nk.driver.VMC_SR(H, opt, chunk_size_bwd=args.chunk, on_the_fly=False, **common),
        "NetKet VMC_SR ntk otf": nk.driver.VMC_SR(
            H, opt, chunk_size_bwd=args.chunk, on_the_fly=True, **common
        ),
    }
    # NetKet returns float64 updates of float32 parameters (its local energies are complex128): compare
    # the values in float64
    updates = {
        k: jax.tree.map(lambda u: u.astype("float64"), jax.block_until_ready(d.compute_loss_and_update()[1]))
        for k, d in drivers.items()
    }
    ref = "NetKet VMC_SR ntk"
    rtol = 1e-8 if prob.dtype == "float64" else 1e-3
    errs = check_agree({ref: updates[ref], **{k: u for k, u in updates.items() if k != ref}}, rtol=rtol)
    log("  updates agree with NetKet's VMC_SR ntk: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))

    cands = [Candidate(k, (lambda d=d: d.compute_loss_and_update()[1])) for k, d in drivers.items()]
    cands.append(Candidate("local energies only", lambda: vs.local_estimators(H)))
    rows = measure(
        "minsr_driver_step", {"model": prob.name, "dtype": prob.dtype, "N": n}, cands, repeats=args.repeats
    )
    by = {r.name: r for r in rows}
    e_loc = by["local energies only"].median
    for r in rows:
        d = r.as_dict()
        d["update_s"] = r.median - e_loc if r.name != "local energies only" else None
        results["times"].append(d)
    for nk_name in ("NetKet VMC_SR ntk", "NetKet VMC_SR ntk otf"):
        for r in rows:
            if r.name.startswith("vmcgrad"):
                theirs = by[nk_name]
                results["ratios"].append(
                    dict(
                        model=prob.name,
                        dtype=prob.dtype,
                        N=n,
                        vmcgrad=r.name,
                        vs=nk_name,
                        step_ratio=r.median / theirs.median,
                        update_ratio=(r.median - e_loc) / max(theirs.median - e_loc, 1e-12),
                        cpu_ratio=statistics.median(r.cpu_times) / statistics.median(theirs.cpu_times),
                    )
                )
    for r in rows:
        log(
            f"  {r.name:<24} median {r.median * 1e3:9.1f} ms  (update {1e3 * (r.median - e_loc):8.1f} ms)"
            f"  cpu {statistics.median(r.cpu_times) * 1e3:9.1f} ms  times {[round(t * 1e3) for t in r.times]}"
        )
    for q in results["ratios"][-4:]:
        log(
            f"  {q['vmcgrad']:<22} / {q['vs']:<22} step {q['step_ratio']:.2f}x"
            f"  update {q['update_ratio']:.2f}x  cpu {q['cpu_ratio']:.2f}x"
        )


def main(argv=None):
    args = parse(argv)
    from benchlib import use_cpu_devices, write_json

    use_cpu_devices(args.devices)
    import jax
    from benchlib.large import make_problem

    results = {"config": vars(args), "memory": [], "limits": [], "times": [], "ratios": []}
    results["config"]["platform"] = jax.devices()[0].platform
    for name in args.models:
        for dtype in args.dtypes:
            prob = make_problem(name, dtype, size=args.size)
            print(
                f"== {name} {dtype} P={prob.n_params} mode={prob.mode} devices={jax.device_count()}"
                f" chunk={args.chunk}",
                flush=True,
            )
            memory(prob, args, results)
            write_json(results, args.json)
            if args.time_n:
                step_times(prob, args.time_n, args, results)
                write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
