"""The choice of the QGT product's design (fused; jvp then vjp) and chunk that ``chunk_size="auto"``
makes from the memory budget (compiled bytes, nothing timed); the two-loop design of a product in the
trace that built its operator (trip-weighted FLOPs). Both designs against the dense Jacobian
reference: ``test_qgt.py::test_against_dense_reference``; under transformations:
``test_transforms.py::test_qgt_transforms``."""

import jax
import jax.numpy as jnp
import pytest
from helpers import close, qgt_bytes, setup

import vmcgrad
from vmcgrad._chunks.budget import program_bytes
from vmcgrad._sr.qgt import qgt as _qgt
from vmcgrad._sr.qgt.apply import matmul_program
from vmcgrad._sr.qgt.qgt import PASSES, choose_design

N_DEV = jax.device_count()


def _rbm(L=16, alpha=1, per_device=512):
    """NetKet's RBM written out (float64): the model whose designs hold different chunk footprints."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "W": jax.random.normal(k[0], (L, alpha * L)) / L,
        "b": jax.random.normal(k[1], (alpha * L,)) / 10,
        "a": jax.random.normal(k[2], (L,)) / 10,
    }
    x = jax.random.rademacher(k[3], (per_device * N_DEV, L), jnp.float64)

    def fun(p, x):
        return jnp.sum(jnp.log(jnp.cosh(x @ p["W"] + p["b"])), -1) + x @ p["a"]

    return fun, params, x


def _cheapest(S, fits, platform):
    """The design of least modelled time at its chunk, from ``program_cost`` of each compiled product
    (the fused one on a tie); on the CPU, of least P_d (n + r ceil(n / c_d)) (the
    measured rule that stands in for the model there)."""
    import dataclasses

    if platform == "cpu":
        n = S.problem.n_local
        rows = {d: PASSES[d] * (n + _qgt.CPU_CHUNK_ROWS * -(-n // c)) for d, c in fits.items()}
        return min(rows, key=rows.get)

    def seconds(design):
        op = dataclasses.replace(S, design=design)
        compiled = matmul_program.lower(S.problem.at_chunk(fits[design]), op, S.params, "tree").compile()
        return vmcgrad.program_cost(compiled, platform).modelled_seconds

    return min(fits, key=seconds)


def _largest_fit(S, design, budget):
    """The largest power-of-two chunk whose program fits ``budget`` (a plain scan, independent of the
    search in vmcgrad._chunks.budget)."""
    best, c = None, 1
    while c <= S.problem.n_local:
        if qgt_bytes(S, design, c) <= budget:
            best = c
        c *= 2
    return best


@pytest.mark.heavy
def test_auto_chooses_design_and_chunk_from_the_budget_and_the_platform():
    """A tight budget, where the jvp-then-vjp chunk fits twice the fused one: each design's chunk is
    the largest that fits (a plain scan), and the design is the one of least modelled time on the
    platform (``program_cost`` of the two compiled products, priced independently here; on the CPU
    the measured rows rule). On the CPU the fused design wins (as measured); on the TPU's constants
    (t_op 10 us) the jvp-then-vjp design, half the trips: fewer, larger ops within the same budget.
    A loose budget: both fit every row and the fused design (three passes) is chosen on every
    platform. The chosen program fits the budget and the next chunk of that design does not."""
    fun, params, x = _rbm()
    with setup("netket") as place:
        x = place(x)
        probe = vmcgrad.QGT(fun, params, x, chunk_size=64)
        c = 64
        budget = qgt_bytes(probe, "jvp_vjp", 2 * c)
        assert qgt_bytes(probe, "fused", 2 * c) > budget, "jvp then vjp should hold less"
        fits = {d: _largest_fit(probe, d, budget) for d in ("fused", "jvp_vjp")}
        assert fits["fused"] <= c < 2 * c == fits["jvp_vjp"], fits
        picked = {}
        for platform in ("cpu", "tpu"):
            with vmcgrad.cost_platform(platform):
                S = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=budget)
            picked[platform] = (S.design, S.chunk_size)
            expected = _cheapest(probe, fits, platform)
            assert (S.design, S.chunk_size) == (expected, fits[expected]), platform
            assert qgt_bytes(S, S.design, S.chunk_size) <= budget < qgt_bytes(S, S.design, 2 * S.chunk_size)
            with vmcgrad.cost_platform(platform):
                record = S.choice
                assert choose_design(S) == (S.design, S.chunk_size) == record.value
            assert record.platform == platform and record.seconds > 0
            assert {v for v, _ in record.priced} <= {(d, fits[d]) for d in fits}
        # the route: the CPU's measured rule keeps the fused design at its chunk; the TPU's constants
        # take the jvp-then-vjp design at twice the chunk: fewer, larger ops within the same budget
        assert picked == {"cpu": ("fused", fits["fused"]), "tpu": ("jvp_vjp", 2 * c)}, picked
        assert "design='jvp_vjp'" in repr(S)
        # the chosen design's program: the jvp in a conditional of its own
        hlo = jax.jit(lambda S, v: S @ v).lower(S, params).compile().as_text()
        assert "conditional" in hlo

        for platform in ("cpu", "tpu"):
            with vmcgrad.cost_platform(platform):
                loose = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=2**34)
            assert (loose.design, loose.chunk_size) == ("fused", loose.problem.n_local)
        hlo = jax.jit(lambda S, v: S @ v).lower(loose, params).compile().as_text()
        assert "conditional" not in hlo
        # the products agree (and with a fixed chunk)
        ref = probe @ params
        close(S @ params, ref, jnp.float64)
        close(loose @ params, ref, jnp.float64)


def test_explicit_design_and_bad_design():
    fun, params, x = _rbm(per_device=64)
    S = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=2**34, design="jvp_vjp")
    assert S.design == "jvp_vjp" and S.chunk_size == S.problem.n_local
    assert vmcgrad.QGT(fun, params, x, chunk_size=8).design == "fused"
    with pytest.raises(ValueError, match=r"`design` must be one of \('fused', 'jvp_vjp', 'two_loop'\)"):
        vmcgrad.QGT(fun, params, x, design="jvp")


# --- a product in the trace that built the operator: NetKet's passes, no pass for O-bar ----------


def _flops(fun, *args):
    """Trip-weighted FLOPs of ``fun``'s compiled program (:func:`vmcgrad.program_cost`)."""
    return vmcgrad.program_cost(jax.jit(fun).lower(*args).compile()).flops


@pytest.mark.parametrize("output", ["complex", "real"])
def test_product_where_the_operator_is_built_costs_a_jvp_pass_and_a_vjp_pass(output):
    """``jax.jit(lambda w, x, v: vmcgrad.QGT(f, w, x) @ v)``, the operator built and applied once in
    one program (NetKet's lazy ``QGTOnTheFly @ v``): its trip-weighted FLOPs are at most those of a
    chunked jvp pass and a chunked vjp pass of the same model and chunk
    (``vmcgrad.batched_jvp`` + ``vmcgrad.batched_vjp``, each a forward pass and its linear pass: NetKet's
    design) plus elementwise work over the P parameters and the N rows. The pass for :math:`\bar O`
    that the operator's construction runs (a forward pass and one pullback, two where O is complex
    over real parameters) and the fused product's own forward pass exceed that bound by at least a
    forward pass and a pullback: the two-loop design reads no :math:`\bar O`, so XLA drops its pass.
    An operator built outside the program, or returned from another one, keeps the fused design
    (three passes: fewer FLOPs than the two loops). All three products agree."""
    fun, params, x = _rbm(per_device=256 // N_DEV)
    if output == "complex":
        real = fun
        fun = lambda p, x: real(p, x) + 1j * jnp.sum(jnp.sin(x @ p["W"]), -1)
    c = 32
    v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), params)

    with setup("netket") as place:  # the samples split over the devices: the mean is global
        x = place(x)
        inside = lambda w, x, v: vmcgrad.QGT(fun, w, x, chunk_size=c, diag_shift=0.1) @ v
        out = jax.eval_shape(fun, params, x)
        ct = place(jnp.ones(out.shape, out.dtype))
        jvp = lambda w, x, v: vmcgrad.batched_jvp(fun, w, x, v, chunk_size=c)
        vjp = lambda w, x, ct: vmcgrad.batched_vjp(fun, w, x, ct, chunk_size=c)
        flops = _flops(inside, params, x, v)
        passes = _flops(jvp, params, x, v) + _flops(vjp, params, x, ct)
        n_params = sum(a.size for a in jax.tree.leaves(params))
        slack = 16 * (n_params + x.shape[0])  # the centring, 1/N, the shift and the output casts
        assert flops <= passes + slack, (flops, passes, slack)

        S = vmcgrad.QGT(fun, params, x, chunk_size=c, diag_shift=0.1)  # outside any trace: O-bar paid here
        built = jax.jit(lambda w, x: vmcgrad.QGT(fun, w, x, chunk_size=c, diag_shift=0.1))(params, x)
        assert S._for_product().design == built._for_product().design == "fused"
        outside = _flops(lambda S, v: S @ v, S, v)
        assert outside < flops, (outside, flops)
        ref = S @ v
        close(jax.jit(inside)(params, x, v), ref, jnp.float64)
        close(built @ v, ref, jnp.float64)


# --- solves with every chunk's linearisation kept ------------------------------------------------


def _solve_bytes(S, chunk, kept=True):
    """Compiled bytes of ``S.solve``, with the linearisations kept (what decides) or not, at ``chunk``."""

    from vmcgrad._sr.qgt.apply import solve_program

    lowered = solve_program.lower(S.problem.at_chunk(chunk), S, S.params, None, 1e-5, 0.0, 1, "tree", kept)
    return program_bytes(lowered.compile())


def test_auto_keeps_the_linearisations_through_a_solve_where_the_budget_holds_them():
    """``chunk_size="auto"``: a solve linearises every chunk once and iterates on the kept residuals,
    at the largest power-of-two chunk whose solve (residuals of all chunks included) fits the budget:
    forward passes counted at run time, one per chunk for the whole solve. Where the residuals of all
    samples do not fit, every product recomputes each chunk's forward pass (one per chunk per
    product: the detector fires on the recomputing route). The same solution every way."""
    fun, params, x = _rbm(per_device=256)
    x = x[:256]  # one device, no mesh: the host callback below needs no collective
    calls = []

    def counted(p, s):
        jax.debug.callback(lambda: calls.append(1))
        return fun(p, s)

    def largest(budget, kept):  # a plain scan over the powers of two, independent of the search
        fits = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if _solve_bytes(probe, c, kept) <= budget]
        return max(fits, default=None)

    b = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
    probe = vmcgrad.QGT(fun, params, x, chunk_size=32)
    solutions = []
    with setup("none"):
        loose = vmcgrad.QGT(counted, params, x, chunk_size="auto", memory_budget=2**34, diag_shift=1e-3)
        assert loose.kept_solve == 256
        middle = _solve_bytes(probe, 64)  # holds the kept solve at chunk 64, not at 128
        assert _solve_bytes(probe, 128) > middle
        medium = vmcgrad.QGT(counted, params, x, chunk_size="auto", memory_budget=middle, diag_shift=1e-3)
        assert medium.kept_solve == 64 == largest(middle, True)
        for S, chunks in ((loose, 1), (medium, 4)):
            calls.clear()
            solution, info = S.solve(b, tol=0.0, maxiter=6)
            assert int(info.iterations) == 6 and len(calls) == chunks, (len(calls), chunks)
            solutions.append(solution)

        tight_budget = _solve_bytes(probe, 1) - 1  # below the residuals of all samples
        tight = vmcgrad.QGT(
            counted, params, x, chunk_size="auto", memory_budget=tight_budget, diag_shift=1e-3
        )
        chunk = largest(tight_budget, False)  # the recomputing solve's chunk
        assert tight.kept_solve is None and chunk is not None
        calls.clear()
        solution, info = tight.solve(b, tol=0.0, maxiter=6)
        assert int(info.iterations) == 6 and len(calls) == 6 * -(-256 // chunk), (len(calls), chunk)
        solutions.append(solution)
    for solution in solutions[1:]:
        close(solution, solutions[0], jnp.float64)


def test_a_kept_solve_is_differentiated_through_the_recomputing_product():
    """Only the solution of a solve is differentiated (x' = A^{-1}(b' - A' x)), never its iterations:
    a solve on kept linearisations has the derivatives, in the parameters and in ``b``, of the
    recomputing solve (at the same chunk), under ``jax.grad`` and ``jax.jvp``."""
    fun, params, x = _rbm(per_device=64)
    x = x[:64]
    b = jax.tree.map(lambda a: jnp.sin(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
    chunk = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=2**34).kept_solve
    assert chunk == 64

    def loss(p, b, chunk_size):
        S = vmcgrad.QGT(fun, p, x, chunk_size=chunk_size, memory_budget=2**34, diag_shift=1e-2)
        solution, _ = S.solve(b, tol=1e-12)
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(solution))

    with setup("none"):
        kept = jax.grad(loss, argnums=(0, 1))(params, b, "auto")
        recomputed = jax.grad(loss, argnums=(0, 1))(params, b, chunk)
        tangent = jax.tree.map(jnp.cos, params)
        jvp_kept = jax.jvp(lambda p: loss(p, b, "auto"), (params,), (tangent,))
        jvp_recomputed = jax.jvp(lambda p: loss(p, b, chunk), (params,), (tangent,))
    close(kept, recomputed, jnp.float64, scale=1e3)
    close(jvp_kept, jvp_recomputed, jnp.float64, scale=1e3)
