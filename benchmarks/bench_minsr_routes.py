r"""MinSR's routes in time: the dense blocks at a budget, the Nyström-preconditioned CG, and the same
preconditioner on the parameter-space QGT.

Model: NetKet's ``GCNN`` on the 6×6 square lattice over its space group (288 symmetries), 2 layers of 4
features (the CLI's ``gcnn``), complex parameters by default (P = 9 520 real entries, 'complex' mode,
K = 2), float64; random configurations and random complex local energies (the timing does not depend
on them). One device. Each timed call is one eager ``vmcgrad.minsr_update`` (compiled before timing),
blocked on; candidates are called in turns, ``--repeats`` rounds, the median reported.

Parts (``--part``):

- ``blocks``: the dense route at the chunk ``chunk_size="auto"`` picks for the budget
  :math:`B_q = \mathrm{Jacobian}/q + 2(NK)^2 \cdot 8` bytes (the N×P Jacobian's q-th part beside the
  N×N kernel and its factor), for each ``--fractions`` q, against one block (``chunk_size=None``, no
  budget). Prints the chosen chunk, the compiled bytes, the time and its ratio to one block.
  ``--no-jacobian-batches`` derives each chunk's Jacobians all at once (the code before the
  ``jacobian_batch`` split) for comparison. The chunk column gives the chunk and its Jacobian batch;
  ``--compare-powers`` times, interleaved with it, the chunk the powers of two alone choose (the
  choice before ``ntk_dense.choose_dense`` took fewer, larger chunks at the batch they fix);
  ``--compare-kept`` times one block as before it kept its Jacobian (``passes``: the mean-Jacobian
  estimate and a pullback pass besides the kernel's Jacobians); ``--compare-one-block`` the choice
  without its last step (one block of every sample at a Jacobian batch below the powers' one).
- ``kept``: the dense route at a chunk given (``--chunk``), one device, for each ``--sizes`` N: the
  Jacobian kept over the chunks (``minsr.keeps_jacobian``, where it fits the default budget) against
  the blocks (the rule before: kept only in one chunk), interleaved, with the max. abs. difference of
  the updates.
- ``cg``: CG iterations and update time at ``--n`` of the matrix-free route, plain and with the
  Nyström preconditioner (``--ranks``; ``auto`` is the budget's), against the dense route (max. abs.
  difference of the update too).
- ``qgt``: the parameter-space QGT CG (``vmcgrad.QGT``, 'real' mode of the real parametrisation) at
  ``--n``, plain and preconditioned by the subsampled QGT of r evenly strided samples,
  :math:`M = (\frac1r \Delta J_S^\dagger \Delta J_S + \lambda)^{-1}` applied by Woodbury (the
  parameter-space analogue of the Nyström preconditioner: an rK×rK system); iterations only.

``--model j1j2`` runs the race's model instead (``benchmarks/time_to_energy.py``: the 4×4 GCNN, 3 × 8
features; with ``--param-dtype float64`` P = 16 536 as in the race), and ``--budgets-mib`` adds budgets
in MiB to the ``blocks`` part's fractions.

Usage (standalone; PYTHONPATH=. in a checkout)::

    python benchmarks/bench_minsr_routes.py --part blocks --sizes 128 256 512 --fractions 1 2 4
    python benchmarks/bench_minsr_routes.py --part cg --n 512 --ranks 0 auto --tol 1e-8
    python benchmarks/bench_minsr_routes.py --part qgt --n 512 --ranks 0 128 256
    python benchmarks/bench_minsr_routes.py --part blocks --model j1j2 --param-dtype float64 --sizes 256 \
        --fractions --budgets-mib 64 --compare-powers
"""

from __future__ import annotations

import argparse
import statistics


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["blocks", "kept", "cg", "qgt"], default="blocks")
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512], help="N of the blocks part")
    ap.add_argument(
        "--fractions", type=float, nargs="*", default=[1, 2, 4], help="q: budget = Jacobian/q + 2(NK)²·8"
    )
    ap.add_argument("--no-jacobian-batches", action="store_true")
    ap.add_argument(
        "--compare-powers",
        action="store_true",
        help="blocks: also time the chunk the powers of two alone choose, interleaved",
    )
    ap.add_argument(
        "--compare-kept",
        action="store_true",
        help="blocks: also time one block without keeping its Jacobian (a shift pass, a pullback pass)",
    )
    ap.add_argument(
        "--compare-one-block",
        action="store_true",
        help="blocks: also time the choice without its last step (one block at a smaller Jacobian batch)",
    )
    ap.add_argument("--n", type=int, default=512, help="N of the cg and qgt parts")
    ap.add_argument("--ranks", nargs="+", default=["0", "auto"], help="Nyström samples r (0: plain CG)")
    ap.add_argument("--chunk", type=int, default=64, help="chunk of the cg and qgt parts")
    ap.add_argument("--diag-shift", type=float, default=1e-3)
    ap.add_argument("--tol", type=float, default=1e-8)
    ap.add_argument("--param-dtype", default="complex128", choices=["complex128", "float64"])
    ap.add_argument(
        "--model",
        default="gcnn6",
        choices=["gcnn6", "j1j2"],
        help="gcnn6: the 6×6 GCNN, 2 × 4 features; j1j2: time_to_energy's 4×4 GCNN, 3 × 8 features",
    )
    ap.add_argument(
        "--budgets-mib", type=float, nargs="*", default=[], help="blocks: budgets in MiB besides --fractions"
    )
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args(argv)


def setup(n, param_dtype, model="gcnn6"):
    import jax
    import jax.numpy as jnp
    import netket as nk
    import numpy as np

    side, layers, features = (6, 2, 4) if model == "gcnn6" else (4, 3, 8)
    g = nk.graph.Square(side)
    # j1j2: as time_to_energy.build_model (the graph's automorphisms; P = 16 536 with float64 parameters)
    symmetries = g.space_group() if model == "gcnn6" else g
    model = nk.models.GCNN(
        symmetries=symmetries, layers=layers, features=features, param_dtype=np.dtype(param_dtype)
    )
    hi = nk.hilbert.Spin(0.5, N=side * side)
    x = jnp.asarray(hi.random_state(jax.random.key(0), n), jnp.float64)
    params = model.init(jax.random.key(1), x[:2])["params"]
    k1, k2 = jax.random.split(jax.random.key(2))
    e = jax.random.normal(k1, (n,)) + 1j * jax.random.normal(k2, (n,))
    return (lambda p, x: model.apply({"params": p}, x)), params, x, e


def timed(calls, repeats):
    """Median seconds of each zero-argument call (the harness's interleaved timing)."""
    from benchlib import Candidate, measure

    rows = measure("minsr_routes", {}, [Candidate(str(k), f) for k, f in calls.items()], repeats=repeats)
    return {k: statistics.median(row.times) for k, row in zip(calls, rows)}


def blocks(args):
    import jax

    import vmcgrad
    from vmcgrad._problem import problem as problem_module
    from vmcgrad._sr.ntk import dense as ntk_dense
    from vmcgrad._sr.ntk import minsr, routes
    from vmcgrad._sr.ntk import modes as ntk_modes

    if args.no_jacobian_batches:  # (the default now, where the chunk is given: kept for old commands)
        ntk_modes.JACOBIAN_SPLIT = 1
    dense_choice, keeps_jacobian = routes.choose_dense, minsr.keeps_jacobian
    powers_only = lambda program, prob, *a: (problem_module.auto_chunk(program, prob, *a), a)

    def without_one_block(*a):  # choose_dense before it tried one block at a smaller Jacobian batch
        knob, ntk_dense.auto_knob = ntk_dense.auto_knob, lambda *a, **k: None
        try:
            return dense_choice(*a)
        finally:
            ntk_dense.auto_knob = knob

    choices = {"fewer": dense_choice}
    if args.compare_powers:
        choices["powers"] = powers_only
    if args.compare_one_block:
        choices["no one block"] = without_one_block
    print("| N | budget | choice | chunk (batch) | compiled MiB | time per update (s) | × one block |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        lp, params, x, e = setup(n, args.param_dtype, args.model)
        nk_, p, itemsize = routes.system_sizes("complex", n, params)
        jac = nk_ * p * itemsize
        kernel = 2 * nk_ * nk_ * itemsize
        budgets = {q: int(jac / q + kernel) for q in args.fractions}
        budgets |= {f"{mib:g} MiB": int(mib * 2**20) for mib in args.budgets_mib}
        chosen, calls, nbytes = {}, {}, {}
        kept = [(None, "fewer")] + ([(None, "passes")] if args.compare_kept else [])
        cases = kept + [(q, c) for q in budgets for c in choices]
        for q, choice in cases:
            budget = None if q is None else budgets[q]
            kw = dict(diag_shift=args.diag_shift, route="dense", memory_budget=budget)
            kw["chunk_size"] = None if q is None else "auto"
            seen = []  # what the choice returned: (chunk, (op, *args))
            choose = choices.get(choice, dense_choice)
            routes.choose_dense = lambda *a, seen=seen, choose=choose: seen.append(choose(*a)) or seen[-1]
            if choice == "passes":  # one block as before it kept its Jacobian
                minsr.keeps_jacobian = lambda op: False
            try:
                f = jax.jit(lambda p, x, e, kw=kw, lp=lp: vmcgrad.minsr_update(lp, p, x, e, **kw)[0])
                # the compiled program is what is timed: calling f would trace it again, after the
                # choice patched here is undone; vmcgrad's own jitted programs are traced afresh
                jax.clear_caches()
                f = f.lower(params, x, e).compile()
                nbytes[q, choice] = vmcgrad.program_bytes(f)
            finally:
                routes.choose_dense = dense_choice
                minsr.keeps_jacobian = keeps_jacobian
            chunk, (op, *_) = seen[-1] if seen else (n, (None,))
            batch = ntk_modes.jacobian_batch(chunk, op and op.jacobian_batch)
            chosen[q, choice] = f"{chunk} ({batch})"
            calls[q, choice] = lambda f=f, a=(params, x, e): f(*a)
        times = timed(calls, args.repeats)
        for q, choice in cases:
            if q is None:
                label = "none (one block)"
            elif isinstance(q, str):  # a budget given in MiB
                label = q
            else:
                label = f"J/{q:g} + kernel, factor: {_mib(budgets[q])}"
            print(
                f"| {n} | {label} | {choice if choice == 'passes' else '-' if q is None else choice} | "
                f"{chosen[q, choice]} | "
                f"{_mib(nbytes[q, choice])} | {times[q, choice]:.3f} | "
                f"{times[q, choice] / times[None, 'fewer']:.2f} |",
                flush=True,
            )


def kept_part(args):
    import jax

    import vmcgrad
    from vmcgrad._sr.ntk import minsr

    keeps_jacobian = minsr.keeps_jacobian
    blocks_only = lambda op: op.problem.n_local == op.problem.n and op.problem.plan.count == 1
    print("| N | chunk | kept s | blocks s | kept / blocks | max abs diff |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        lp, params, x, e = setup(n, args.param_dtype, args.model)
        kw = dict(diag_shift=args.diag_shift, route="dense", chunk_size=args.chunk)
        calls, outs = {}, {}
        for name, rule in (("kept", keeps_jacobian), ("blocks", blocks_only)):
            minsr.keeps_jacobian = rule
            try:
                f = jax.jit(lambda p, x, e, lp=lp, kw=kw: vmcgrad.minsr_update(lp, p, x, e, **kw)[0])
                jax.clear_caches()  # vmcgrad's own jitted programs traced afresh under the rule
                f = f.lower(params, x, e).compile()
            finally:
                minsr.keeps_jacobian = keeps_jacobian
            outs[name] = f(params, x, e)
            calls[name] = lambda f=f, a=(params, x, e): f(*a)
        diff = max(
            float(abs(a - b).max())
            for a, b in zip(jax.tree.leaves(outs["kept"]), jax.tree.leaves(outs["blocks"]))
        )
        times = timed(calls, args.repeats)
        kept, blocked = times["kept"], times["blocks"]
        print(
            f"| {n} | {args.chunk} | {kept:.3f} | {blocked:.3f} | {kept / blocked:.2f} | {diff:.1e} |",
            flush=True,
        )


def _mib(b):
    return f"{b / 2**20:.1f}"


def cg_part(args):
    import jax
    import jax.numpy as jnp

    import vmcgrad
    from vmcgrad._chunks.default_budget import default_memory_budget
    from vmcgrad._sr.ntk import nystrom, routes

    lp, params, x, e = setup(args.n, args.param_dtype, args.model)
    n = args.n
    _, p, itemsize = routes.system_sizes("complex", n, params)
    kw = dict(diag_shift=args.diag_shift, chunk_size=args.chunk)
    calls = {"dense": lambda: vmcgrad.minsr_update(lp, params, x, e, route="dense", **kw)}
    for r in args.ranks:
        rank = r if r == "auto" else int(r)
        calls[f"cg r={r}"] = lambda rank=rank: vmcgrad.minsr_update(
            lp, params, x, e, route="cg", nystrom_rank=rank, tol=args.tol, **kw
        )
    results = {name: f() for name, f in calls.items()}
    times = timed(calls, args.repeats)
    ref = results["dense"][0]
    auto = nystrom.nystrom_rank(n, 2, p, itemsize, default_memory_budget())
    print(
        f"N = {n}, P = {p}, diag_shift = {args.diag_shift}, tol = {args.tol}, chunk {args.chunk}, "
        f"auto r = {auto}"
    )
    print("| route | CG iterations | converged | time per update (s) | × dense | max abs diff to dense |")
    print("|---|---|---|---|---|---|")
    for name, (u, _, info) in results.items():
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(ref)))
        its = "-" if info is None else int(info.iterations)
        conv = "-" if info is None else bool(info.converged)
        print(
            f"| {name} | {its} | {conv} | {times[name]:.3f} | {times[name] / times['dense']:.2f} | "
            f"{diff:.1e} |"
        )


def qgt_part(args):
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    import vmcgrad
    from vmcgrad._sr.jacobian import jacobian
    from vmcgrad._sr.ntk import modes as ntk_modes
    from vmcgrad._sr.solve import cg

    lp, params, x, _ = setup(args.n, args.param_dtype, args.model)
    n, lam = args.n, args.diag_shift
    theta = ntk_modes.theta_of("complex", params)
    real_lp = lambda t, x: lp(ntk_modes.params_of("complex", t, params), x)
    S = vmcgrad.QGT(real_lp, theta, x, chunk_size=args.chunk, diag_shift=lam)
    flat, _ = ravel_pytree(theta)
    b = jnp.cos(jnp.arange(flat.size) * 0.37)
    f = ntk_modes.rows_fun(lp, "complex", params)
    print(f"N = {n}, P = {flat.size}, diag_shift = {lam}, tol = {args.tol}")
    print("| preconditioner | CG iterations | converged |")
    print("|---|---|---|")
    for r in args.ranks:
        r = int(r)
        m = None
        if r:
            xs = x[(jnp.arange(r) * n) // r]
            js = jacobian(f, theta, xs, "complex", ntk_modes.jacobian_batch(args.chunk))
            u = jnp.concatenate([j.reshape(r * 2, -1) for j in jax.tree.leaves(js)], axis=1)
            u = u.reshape(r, 2, -1)
            u = (u - u.mean(0)).reshape(2 * r, -1).T / jnp.sqrt(r)  # P × rK
            small = jnp.linalg.cholesky(lam * jnp.eye(2 * r) + u.T @ u)
            m = lambda v, u=u, small=small: (v - u @ jax.scipy.linalg.cho_solve((small, True), u.T @ v)) / lam
        _, info = jax.jit(
            lambda b, m=m: cg(lambda v: S @ v, b, None, tol=args.tol, maxiter=20 * flat.size, M=m)
        )(b)
        print(
            f"| {'none' if not r else f'subsampled QGT, r = {r}'} | {int(info.iterations)} | "
            f"{bool(info.converged)} |"
        )


def main(argv=None):
    import jax

    jax.config.update("jax_enable_x64", True)
    args = parse(argv)
    {"blocks": blocks, "kept": kept_part, "cg": cg_part, "qgt": qgt_part}[args.part](args)


if __name__ == "__main__":
    main()
