"""vmcgrad.QGT against dense references built from explicit Jacobians, and against NetKet's QGTs."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, close, compile_count, make_case, random_like, setup
from jax.flatten_util import ravel_pytree

import vmcgrad
from vmcgrad import collective_report
from vmcgrad._chunks.plan import plan_chunks

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N_DEV = jax.device_count()
N = 37 * N_DEV  # prime per device: chunk sizes leave remainders
multi = pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")

# case -> the mode chosen automatically (NetKet's rule), or forced
MODES = {
    "r2r": "real",
    "r2c": "real",
    "c2c_holo": "holomorphic",
    "c2c_nonholo": "complex",
    "mixed": "complex",
    "layered": "real",
    "pytree_samples": "real",
}


# --- an independent dense reference --------------------------------------------------------------


def _is_complex(a):
    return jnp.issubdtype(a.dtype, jnp.complexfloating)


class Dense:
    """S in a mode's representation, from the explicit Jacobian of all samples (jax.jacrev).

    Representation ('complex' mode): [Re of every leaf..., Im of the complex leaves...], raveled.
    """

    def __init__(self, fun, params, samples, mode):
        self.mode, self.params = mode, params
        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [p.shape for p in leaves]
        self.dtypes = [p.dtype for p in leaves]
        flat0 = self.to_flat(params)
        g = lambda f: fun(self.from_flat(f), samples)
        if mode == "holomorphic":
            J = jax.jacrev(g, holomorphic=True)(flat0)
        elif _is_complex(jax.eval_shape(g, flat0)):
            J = jax.jacrev(lambda f: g(f).real)(flat0) + 1j * jax.jacrev(lambda f: g(f).imag)(flat0)
        else:
            J = jax.jacrev(g)(flat0)
        dJ = J - J.mean(0)
        S = dJ.conj().T @ dJ / J.shape[0]
        self.S = S if mode == "holomorphic" else S.real

    def to_flat(self, tree):
        leaves = jax.tree.leaves(tree)
        if self.mode != "complex":
            return jnp.concatenate([a.ravel() for a in leaves])
        re = [jnp.real(a).ravel() for a in leaves]
        im = [jnp.imag(a).ravel() for a in leaves if _is_complex(a)]
        return jnp.concatenate(re + im)

    def from_flat(self, flat):
        out, i = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            out.append(flat[i : i + size].reshape(shape))
            i += size
        if self.mode == "complex":
            for k, dtype in enumerate(self.dtypes):
                if jnp.issubdtype(dtype, jnp.complexfloating):
                    size = int(np.prod(self.shapes[k]))
                    out[k] = jax.lax.complex(out[k], flat[i : i + size].reshape(self.shapes[k]))
                    i += size
        return self.treedef.unflatten([o.astype(d) for o, d in zip(out, self.dtypes)])

    def matrix(self, diag_shift=0.0, diag_scale=None):
        d = jnp.diag(self.S)
        extra = diag_shift + (0.0 if diag_scale is None else diag_scale * d) + 0 * d
        return self.S + jnp.diag(extra)

    def apply(self, v, **shifts):
        return self.from_flat(self.matrix(**shifts) @ self.to_flat(v))


def tree_like(params, seed):
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tdef, [random_like(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])


# --- S @ v, to_dense, diagonal in every mode -----------------------------------------------------


DTYPE_CASES = [(c, jnp.float64) for c in MODES] + [
    (c, jnp.float32) for c in ("r2c", "c2c_holo", "c2c_nonholo")
]


@pytest.mark.quick_cover("dtype", "design")
@pytest.mark.parametrize("design", ["fused", "jvp_vjp", "two_loop"])
@pytest.mark.parametrize("case, dtype", DTYPE_CASES, ids=[f"{c}-{jnp.dtype(d).name}" for c, d in DTYPE_CASES])
def test_against_dense_reference(case, dtype, design):
    """Every design of the product (one linearisation per chunk; a jvp, then the pullback of a second
    forward pass; a loop of jvps, their centring, then a loop of pullbacks) gives the dense S's
    products on every kind of vector, its matrix, diagonal and solves (chunk 5 of 37 rows per device:
    a shifted last chunk)."""
    fun, params, samples = make_case(case, N, dtype)
    mode = MODES[case]
    ref = Dense(fun, params, samples, mode)
    shifts = {"diag_shift": 0.03, "diag_scale": 0.2}
    v = tree_like(params, 1)
    with setup("netket") as place:
        forced = "holomorphic" if case == "c2c_holo" else None
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=5, mode=forced, design=design, **shifts)
        assert S.mode == mode and S.dim == ref.S.shape[0]
        assert S.design == design and f"design={design!r}" in repr(S)
        close(S @ v, ref.apply(v, **shifts), dtype)
        # flat vectors: ravel_pytree(v) order, and the real representation (the order of to_dense)
        flat, _ = ravel_pytree(v)
        close(S @ flat, ravel_pytree(ref.apply(v, **shifts))[0], dtype)
        rep = ref.to_flat(v)
        close(S @ rep, ref.matrix(**shifts) @ rep, dtype)
        close(S.to_dense(), ref.matrix(**shifts), dtype)
        close(S.diagonal(), jnp.diag(ref.matrix(**shifts)), dtype)
        # without shifts: the bare S
        S0 = S.replace(diag_shift=0.0, diag_scale=None)
        close(S0 @ v, ref.apply(v), dtype)
        if case in ("r2c", "c2c_holo", "mixed") and jnp.dtype(dtype) == jnp.float64:  # a solve: 3 modes
            x, _ = S.solve(ref.apply(v, **shifts), tol=1e-13)
            close(x, v, dtype, scale=100)


@pytest.mark.parametrize("case, chunk_size", [("r2c", c) for c in (None, 1, 37, 1000)] + [("c2c_nonholo", 3)])
def test_chunk_sizes(case, chunk_size):
    fun, params, samples = make_case(case, N)
    ref = Dense(fun, params, samples, MODES[case])
    v = tree_like(params, 2)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=chunk_size, diag_shift=0.1, mode=MODES[case])
        close(S @ v, ref.apply(v, diag_shift=0.1), jnp.float64)
        close(S.to_dense(), ref.matrix(diag_shift=0.1), jnp.float64)


SETUPS = [
    ("netket", N),
    ("explicit", N),
    ("none", N),
    ("netket", 1),
    ("netket", 3),
    ("netket", 5 * N_DEV + 1),
]
SETUPS = [(kind, n, "r2c") for kind, n in SETUPS] + [("netket", 5 * N_DEV + 1, "pytree_samples")]


@pytest.mark.parametrize("kind, n, case", SETUPS)
def test_sharding_setups_and_sample_counts(kind, n, case):
    """Sharded samples (any N, also N < devices) give the single-device dense answer: no
    n_devices factor, no divisibility requirement."""
    fun, params, samples = make_case(case, n)
    ref = Dense(fun, params, samples, "real")
    v = tree_like(params, 3)
    with setup(kind) as place:
        x = place(samples) if n % N_DEV == 0 else samples  # else: padded over the devices inside
        S = vmcgrad.QGT(fun, params, x, chunk_size=2, diag_shift=0.1)
        close(S @ v, ref.apply(v, diag_shift=0.1), jnp.float64)
        close(S.to_dense(), ref.matrix(diag_shift=0.1), jnp.float64)
        sol, _ = S.solve(ref.apply(v, diag_shift=0.1), tol=1e-13)
        close(sol, v, jnp.float64, scale=100)


# --- solve -------------------------------------------------------------------------------------


SHIFT, SCALE = {"diag_shift": 0.05}, {"diag_shift": 0.01, "diag_scale": 0.1}
SOLVES = [("r2r", SHIFT), ("c2c_holo", SHIFT), ("mixed", SHIFT), ("r2c", SCALE), ("c2c_nonholo", SCALE)]


@pytest.mark.parametrize("case, shifts", SOLVES)
def test_solve_recovers_known_x(case, shifts):
    fun, params, samples = make_case(case, N)
    mode = MODES[case]
    ref = Dense(fun, params, samples, mode)
    x_true = tree_like(params, 4)
    b = ref.apply(x_true, **shifts)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, mode=mode, **shifts)
        x, info = S.solve(b, tol=1e-13)
        close(x, x_true, jnp.float64, scale=100)
        assert bool(info.converged) and 0 < int(info.iterations) <= 10 * S.dim
        if "diag_scale" not in shifts:  # (else: the norm of the Jacobi-rescaled system's residual)
            assert float(info.residual_norm) <= 1e-13 * float(jnp.linalg.norm(ref.to_flat(b))) * 1.0001
        # flat, with a start close to the answer: fewer iterations, same answer
        xf, _ = S.solve(ravel_pytree(b)[0], x0=ravel_pytree(x_true)[0] * 0.999, tol=1e-13)
        close(xf, ravel_pytree(x_true)[0], jnp.float64, scale=100)
        # maxiter caps the iterations; tol=0 runs exactly maxiter of them
        _, info3 = S.solve(b, tol=0.0, maxiter=3)
        assert int(info3.iterations) == 3 and not bool(info3.converged)


def test_solve_matches_jax_scipy_cg_iterates():
    """Same recursion as jax.scipy.sparse.linalg.cg: equal after a fixed number of iterations."""
    fun, params, samples = make_case("r2r", N)
    ref = Dense(fun, params, samples, "real")
    b = tree_like(params, 5)
    A = ref.matrix(diag_shift=0.01)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=5, diag_shift=0.01)
        x, _ = S.solve(ref.to_flat(b), tol=0.0, maxiter=6)
    x_ref, _ = jax.scipy.sparse.linalg.cg(lambda y: A @ y, ref.to_flat(b), tol=0.0, maxiter=6)
    np.testing.assert_allclose(x, x_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["r2r", "c2c_nonholo"])
def test_solve_traces_the_product_once(case):
    """CG calls the product in its loop, for the residual of x0, in its final residual check, and
    again in the transposed solve that custom_linear_solve traces: the solve traces the model as
    often as one product does (the product is a function of its own, traced once per shapes), not
    five or six times as often. Counted at trace time, on a model no other test has traced."""
    fun, params, samples = make_case(case, N)
    traced = []

    def counted(p, x):
        traced.append(x.shape)
        return fun(p, x)

    b = tree_like(params, 3)
    S = vmcgrad.QGT(counted, params, samples, chunk_size=7, mode=MODES[case], diag_shift=0.1)
    del traced[:]
    jax.block_until_ready(S @ b)
    product = len(traced)
    del traced[:]
    x, info = S.solve(b, x0=b, tol=1e-10)
    assert product > 0 and len(traced) == product, (len(traced), product)
    assert bool(info.converged)
    assert_tree_allclose(S @ x, b, rtol=0, atol=1e-8)


@pytest.mark.parametrize("case", ["c2c_holo", "c2c_nonholo"])
def test_jax_scipy_cg_over_products(case):
    """NetKet's default SR solver, jax.scipy.sparse.linalg.cg, transposes the product for complex
    vectors: S @ v carries its own transpose rule (the chunk loop is never transposed)."""
    fun, params, samples = make_case(case, N)
    b = tree_like(params, 13)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, mode=MODES[case], diag_shift=0.05)
        x_ours, _ = S.solve(b, tol=1e-12)
        x_scipy, _ = jax.jit(lambda S, b: jax.scipy.sparse.linalg.cg(lambda y: S @ y, b, tol=1e-12))(S, b)
    close(x_scipy, x_ours, jnp.float64, scale=1e3)


@pytest.mark.parametrize("case", ["r2c", "c2c_holo", "c2c_nonholo"])
def test_jax_scipy_cg_on_kept_linearisations(case):
    """jax.scipy.sparse.linalg.cg over products of a LinearizedQGT, outside and inside jax.jit, and
    vmapped over right-hand sides: the dense solve, and QGT.solve's answer (the product is the chunked
    primitive, which jax.scipy's complex CG transposes; nothing of it is a ref loop of its own)."""
    fun, params, samples = make_case(case, N)
    mode = MODES[case]
    ref = Dense(fun, params, samples, mode)
    b = tree_like(params, 13)
    bs = jnp.stack([ref.to_flat(b), ref.to_flat(tree_like(params, 14))])
    A = ref.matrix(diag_shift=0.05)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, mode=mode, diag_shift=0.05)
        lin = S.linearize()
        x_ours, _ = S.solve(b, tol=1e-12)
        cg = lambda L, b: jax.scipy.sparse.linalg.cg(lambda y: L @ y, b, tol=1e-12)[0]
        eager = cg(lin, b)
        jitted = jax.jit(cg)(lin, b)
        batched = jax.jit(jax.vmap(cg, in_axes=(None, 0)))(lin, bs)
    expected = ref.from_flat(jnp.linalg.solve(A, ref.to_flat(b)))
    for x in (eager, jitted):
        close(x, expected, jnp.float64, scale=1e3)
        close(x, x_ours, jnp.float64, scale=1e3)
    close(batched, jnp.linalg.solve(A, bs.T).T, jnp.float64, scale=1e3)


@pytest.mark.parametrize("case", ["r2c", "c2c_nonholo", "layered"])
def test_solve_with_kept_linearisations(case):
    """S.linearize(): the same products and solution, iterate for iterate; the forward pass runs once
    per chunk when linearising and never again in products or solve iterations."""
    fun, params, samples = make_case(case, N)
    b = tree_like(params, 12)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, diag_shift=0.05)
        lin = S.linearize()
        assert isinstance(lin, vmcgrad.LinearizedQGT) and lin.nbytes > 0
        close(lin @ b, S @ b, jnp.float64)
        # Iterate for iterate: 10 fixed iterations agree to rounding (c2c_nonholo, one device:
        # 5e-16 relative). Later CG amplifies rounding (3e-8 at 20 iterations, 3e-6 at 40).
        x10, _ = S.solve(b, tol=0.0, maxiter=10)
        xc10, _ = lin.solve(b, tol=0.0, maxiter=10)
        x, info = S.solve(b, tol=1e-12)
        xc, info_c = lin.solve(b, tol=1e-12)
    close(xc10, x10, jnp.float64)
    close(xc, x, jnp.float64, scale=1e3)
    # Converged to 1e-12 after ~100 iterations, rounding differences between the recomputed and the
    # kept products move the stopping iteration by a few (CI, one device: 105 vs 107).
    assert bool(info.converged) and bool(info_c.converged)
    assert abs(int(info_c.iterations) - int(info.iterations)) <= max(3, int(info.iterations) // 20)

    calls = []

    def counted(p, x):
        jax.debug.callback(lambda: calls.append(1))
        return fun(p, x)

    with setup("none"):
        S = vmcgrad.QGT(counted, params, samples, chunk_size=N // 2 + 1, diag_shift=0.05)  # 2 chunks
        calls.clear()
        jax.block_until_ready(S.solve(b, tol=0.0, maxiter=3))
        # recomputed: one forward per chunk per iteration, and, where the 2 chunks re-read a row (N
        # odd), one forward-mode pass over the chunk holding it, which looks for a row whose
        # derivative is finite to stand in for it (vmcgrad._runner.primitive._finite_stand_ins)
        plan = plan_chunks(N, N // 2 + 1)
        assert len(calls) == 2 * 3 + (3 if plan.count * plan.size != N else 0)
        calls.clear()
        lin = jax.block_until_ready(S.linearize())
        assert len(calls) == 2  # one forward per chunk, once
        calls.clear()
        jax.block_until_ready(lin.solve(b, tol=0.0, maxiter=3))
        jax.block_until_ready(lin @ b)
        assert calls == []  # nothing recomputed


def test_kept_linearisations_share_the_operators_methods():
    """A LinearizedQGT is an AbstractQGT like the operator it came from: to_dense, diagonal, replace
    (which keeps the linearisations: the shifts do not enter them) and the repr, against the dense
    reference; and the operator classes are abstract or final (equinox's rule)."""
    fun, params, samples = make_case("c2c_nonholo", N)
    ref = Dense(fun, params, samples, "complex")
    v = tree_like(params, 15)
    with setup("netket") as place:
        lin = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, diag_shift=0.05).linearize()
        close(lin.to_dense(), ref.matrix(diag_shift=0.05), jnp.float64)
        close(lin.diagonal(), jnp.diag(ref.matrix(diag_shift=0.05)), jnp.float64)
        lin2 = lin.replace(diag_shift=0.5, diag_scale=0.1)
        assert isinstance(lin2, vmcgrad.LinearizedQGT) and float(lin.diag_shift) == 0.05
        assert jax.tree.leaves(lin2.linear_maps)[0] is jax.tree.leaves(lin.linear_maps)[0]
        close(lin2 @ v, ref.apply(v, diag_shift=0.5, diag_scale=0.1), jnp.float64)
        x, info = lin2.solve(v, tol=1e-12)
        close(
            x,
            ref.from_flat(jnp.linalg.solve(ref.matrix(diag_shift=0.5, diag_scale=0.1), ref.to_flat(v))),
            jnp.float64,
            scale=1e3,
        )
        assert bool(info.converged)
    assert repr(lin).startswith(
        f"LinearizedQGT(mode='complex', dim={ref.S.shape[0]}, n_samples={N}, chunk_size=7"
    )
    named = r"vmcgrad\.QGT\(\.\.\.\)\.linearize\(\)"  # its messages name how it is built
    with pytest.raises(
        TypeError, match=rf"{named}\.replace: only `diag_shift` and `diag_scale`.*Fix: .*{named}"
    ):
        lin.replace(linear_maps=None)
    with pytest.raises(TypeError, match=rf"{named} \(v\): `v` must be a pytree like `params`"):
        lin @ [1.0]

    from vmcgrad._sr.base import AbstractOperator

    def subclasses(cls):
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    expected = {vmcgrad.QGTOperator, vmcgrad.LinearizedQGT, vmcgrad.NTKOperator}  # (imported lazily)
    classes = [c for c in subclasses(AbstractOperator) if c.__module__.startswith("vmcgrad.")]
    assert expected <= set(classes)
    for cls in classes:
        vmcgrad_subclasses = [c for c in cls.__subclasses__() if c.__module__.startswith("vmcgrad.")]
        assert inspect.isabstract(cls) or not vmcgrad_subclasses, (cls, vmcgrad_subclasses)


# --- structure: one reduction, jit, no recompilation ---------------------------------------------


@multi
@pytest.mark.parametrize(
    "kind, case",
    [
        ("netket", "r2c"),
        ("explicit", "r2c"),
        ("netket", "c2c_holo"),
        ("netket", "mixed"),
        ("netket", "layered"),
    ],
)
def test_one_reduction_per_product(kind, case):
    fun, params, samples = make_case(case, N)
    n_dtypes = len({p.dtype for p in jax.tree.leaves(params)})
    v = tree_like(params, 6)
    with setup(kind) as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=5, diag_shift=0.1)
        product = collective_report(jax.jit(lambda S, v: S @ v).lower(S, v).compile())
        assert product.total_in_loops == 0, product
        assert set(product.outside) == {"all-reduce"}
        assert 1 <= product.outside["all-reduce"] <= n_dtypes, product
        # a solve: the product's reduction once per CG iteration (the CG loop), none in the chunk loop
        solve = collective_report(jax.jit(lambda S, v: S.solve(v, maxiter=5)).lower(S, v).compile())
        assert set(solve.in_loops) == {"all-reduce"} and solve.in_loops["all-reduce"] <= n_dtypes, solve
        # kept linearisations: the same, and the linearising pass reduces nothing (per-chunk slots)
        from vmcgrad._sr.qgt.qgt import _linearize_program

        lin = S.linearize()
        kept = collective_report(_linearize_program.lower(S.problem, S).compile())
        assert kept.total_in_loops == 0 and not kept.outside, kept
        two = jax.tree.map(lambda a: jnp.stack([a, a]), v)
        for program, vs in ((lambda L, v: L @ v, v), (jax.vmap(lambda L, v: L @ v, in_axes=(None, 0)), two)):
            product = collective_report(jax.jit(program).lower(lin, vs).compile())
            assert product.total_in_loops == 0, product
            assert set(product.outside) == {"all-reduce"}
            assert 1 <= product.outside["all-reduce"] <= n_dtypes, product
        solve = collective_report(jax.jit(lambda L, v: L.solve(v, maxiter=5)).lower(lin, v).compile())
        assert set(solve.in_loops) == {"all-reduce"} and solve.in_loops["all-reduce"] <= n_dtypes, solve


def test_jit_operator_argument_no_recompilation():
    fun, params, samples = make_case("r2c", N)
    ref = Dense(fun, params, samples, "real")
    with setup("netket") as place:
        x = place(samples)
        S = vmcgrad.QGT(fun, params, x, chunk_size=5, diag_shift=0.1)

        @jax.jit
        def step(S, v):
            return S @ v, S.solve(v, tol=1e-12)[0]

        v1, v2 = tree_like(params, 7), tree_like(params, 8)
        out1 = step(S, v1)
        close(S @ v1, ref.apply(v1, diag_shift=0.1), jnp.float64)  # eager: the same product
        close(out1[0], ref.apply(v1, diag_shift=0.1), jnp.float64)
        params2 = jax.block_until_ready(jax.tree.map(lambda p: p * 1.1, params))
        before = compile_count()
        prod, sol = step(S, v2)
        # a new operator (new params, new shift) of the same shapes, and eager calls, reuse the programs
        S2 = vmcgrad.QGT(fun, params2, x, chunk_size=5, diag_shift=0.2)
        step(S2, v2)
        S2 @ v2
        S.replace(diag_shift=0.3) @ v1
        assert compile_count() == before
        close(prod, ref.apply(v2, diag_shift=0.1), jnp.float64)
        close(ref.apply(sol, diag_shift=0.1), v2, jnp.float64, scale=100)

        # built inside jit too
        inside = jax.jit(lambda p, x, v: vmcgrad.QGT(fun, p, x, chunk_size=5, diag_shift=0.1) @ v)
        close(inside(params, x, v1), ref.apply(v1, diag_shift=0.1), jnp.float64)


def test_partial_logpsi_model_state_is_traced():
    def scaled(scale, p, x):
        return scale * jnp.tanh(x @ p["W"] + p["b"]).sum(-1)

    _, params, samples = make_case("r2r", N)
    v = tree_like(params, 9)
    with setup("netket") as place:
        x = place(samples)
        S1 = vmcgrad.QGT(jax.tree_util.Partial(scaled, jnp.float64(0.5)), params, x, chunk_size=5)
        S1 @ v
        before = compile_count()
        S2 = vmcgrad.QGT(jax.tree_util.Partial(scaled, jnp.float64(2.0)), params, x, chunk_size=5)
        out = S2 @ v
        assert compile_count() == before
    ref = Dense(lambda p, x: scaled(2.0, p, x), params, samples, "real")
    close(out, ref.apply(v), jnp.float64)


def test_replace_is_immutable_and_updates_shifts():
    fun, params, samples = make_case("c2c_nonholo", N)
    ref = Dense(fun, params, samples, "complex")
    v = tree_like(params, 10)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=5)
        S2 = S.replace(diag_shift=0.5, diag_scale=0.1)
        assert float(S.diag_shift) == 0.0 and S.diag_scale is None
        close(S2 @ v, ref.apply(v, diag_shift=0.5, diag_scale=0.1), jnp.float64)
        close(S2.replace(diag_scale=None) @ v, ref.apply(v, diag_shift=0.5), jnp.float64)
        with pytest.raises(TypeError, match="only `diag_shift` and `diag_scale`"):
            S.replace(chunk_size=3)


# --- bad input ---------------------------------------------------------------------------------


def test_a_real_vector_of_both_lengths_is_the_representation():
    """The one vector that two kinds fit with different answers (vmcgrad._sr.qgt.views.Views.guess): in
    'complex' mode with every complex leaf of size zero, D = P and the flat dtype is complex. A real
    vector is the representation (a real product); a complex one is flat. Through vmcgrad.netket,
    with a solve: test_netket_qgt.py, the same name."""

    def fun(p, x):
        return jnp.log(jnp.cosh(x @ p["w"])) + jnp.sum(p["c"])

    params = {"w": jnp.linspace(-0.5, 0.5, 4), "c": jnp.zeros((0,), jnp.complex128)}
    samples = jax.random.normal(jax.random.key(0), (N, 4))
    ref = Dense(fun, params, samples, "complex")
    S = vmcgrad.QGT(fun, params, samples, chunk_size=5, diag_shift=0.1)
    assert S.mode == "complex" and S.dim == ravel_pytree(params)[0].size == 4
    v = jnp.linspace(-1.0, 1.0, 4)
    product = S @ v
    assert product.dtype == jnp.float64
    close(product, ref.matrix(diag_shift=0.1) @ v, jnp.float64)
    flat = S @ v.astype(jnp.complex128)
    assert flat.dtype == jnp.complex128
    close(flat, (ref.matrix(diag_shift=0.1) @ v).astype(jnp.complex128), jnp.float64)


def test_bad_input_messages():
    fun, params, samples = make_case("c2c_nonholo", 10)
    rfun, rparams, rsamples = make_case("r2r", 10)
    with pytest.raises(ValueError, match="not both"):
        vmcgrad.QGT(fun, params, samples, mode="complex", holomorphic=False)
    with pytest.raises(ValueError, match="must be one of"):
        vmcgrad.QGT(fun, params, samples, mode="imag")
    with pytest.raises(ValueError, match="needs real parameters"):
        vmcgrad.QGT(fun, params, samples, mode="real")
    with pytest.raises(ValueError, match="needs every leaf"):
        vmcgrad.QGT(rfun, rparams, rsamples, holomorphic=True)
    with pytest.raises(TypeError, match="`diag_shift` must be a real scalar"):
        vmcgrad.QGT(rfun, rparams, rsamples, diag_shift=jnp.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        vmcgrad.QGT(rfun, rparams, rsamples, chunk_size=0)
    S = vmcgrad.QGT(rfun, rparams, rsamples)
    with pytest.raises(TypeError, match="must have the shape"):
        S @ {"W": rparams["W"], "b": jnp.ones(2)}
    with pytest.raises(TypeError, match="`v` must be a pytree like `params`"):
        S @ jnp.ones(7)
    with pytest.raises(TypeError, match="`b` must be a pytree like `params`"):
        S.solve([1.0])
    with pytest.raises(TypeError, match="`x0` must be the same kind"):
        S.solve(rparams, x0=ravel_pytree(rparams)[0])


# --- NetKet ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nk():
    with jax.set_mesh(None):
        import netket

    return netket


@pytest.mark.parametrize(
    "model, nk_mode, our_mode, diag_scale",
    [
        ("RBM", "real", "real", None),
        ("RBMModPhase", "complex", "real", 0.1),  # NetKet's default for R->C is 'complex' = Re S
        ("RBM_complex", "complex", "complex", None),
        ("RBM_complex", "holomorphic", "holomorphic", 0.1),
    ],
)
def test_matches_netket_qgt_jacobian_dense(nk, model, nk_mode, our_mode, diag_scale):
    from netket.optimizer.qgt.qgt_jacobian import QGTJacobian_DefaultConstructor
    from netket.optimizer.qgt.qgt_onthefly import QGTOnTheFly_DefaultConstructor

    hi = nk.hilbert.Spin(0.5, 6)
    net = {
        "RBM": nk.models.RBM(alpha=1, param_dtype=jnp.float64),
        "RBMModPhase": nk.models.RBMModPhase(alpha=1, param_dtype=jnp.float64),
        "RBM_complex": nk.models.RBM(alpha=1, param_dtype=jnp.complex128),
    }[model]
    n = 16 * N_DEV
    samples = hi.random_state(jax.random.key(0), n).astype(jnp.float64)
    variables = net.init(jax.random.key(1), samples[:2])
    params = jax.tree.map(
        lambda p: p + 0.2 * random_like(jax.random.key(2), p.shape, p.dtype), variables["params"]
    )
    state = {k: v for k, v in variables.items() if k != "params"}
    logpsi = jax.tree_util.Partial(lambda st, w, x: net.apply({**st, "params": w}, x), state)
    v = tree_like(params, 11)
    with setup("netket") as place:
        x = place(samples)
        theirs = QGTJacobian_DefaultConstructor(
            net.apply, params, state, x, dense=True, mode=nk_mode, diag_shift=0.01, diag_scale=diag_scale
        )
        ours = vmcgrad.QGT(
            logpsi, params, x, chunk_size=5, mode=our_mode, diag_shift=0.01, diag_scale=diag_scale
        )
        np.testing.assert_allclose(ours.to_dense(), theirs.to_dense(), rtol=1e-10, atol=1e-13)
        assert_tree_allclose(ours @ v, theirs @ v, rtol=1e-10, atol=1e-13)
        x_ours, _ = ours.solve(v, tol=1e-12)
        x_theirs, _ = theirs.solve(nk.optimizer.solver.cholesky, v)
        assert_tree_allclose(x_ours, x_theirs, rtol=1e-10, atol=1e-12)
        if diag_scale is None:
            otf = QGTOnTheFly_DefaultConstructor(
                net.apply, params, state, x, chunk_size=4, diag_shift=0.01, holomorphic=False
            )
            assert_tree_allclose(ours @ v, otf @ v, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("case", ["r2c", "c2c_nonholo"])
def test_netket_solvers_on_kept_linearisations(nk, case):
    """NetKet's dense solvers take a LinearizedQGT as they take NetKet's QGTs (they call
    ``A.to_dense()``), and jax.scipy's GMRES runs on its products: each gives the dense solution of
    S_eff x = b for a flat b in the mode's representation."""
    fun, params, samples = make_case(case, N)
    ref = Dense(fun, params, samples, MODES[case])
    b = ref.to_flat(tree_like(params, 16))
    expected = jnp.linalg.solve(ref.matrix(diag_shift=0.05), b)
    with setup("netket") as place:
        lin = vmcgrad.QGT(fun, params, place(samples), chunk_size=7, diag_shift=0.05).linearize()
        solvers = [nk.optimizer.solver.cholesky, nk.optimizer.solver.LU, nk.optimizer.solver.pinv_smooth]
        xs = [solver(lin, b)[0] for solver in solvers]
        xs.append(jax.scipy.sparse.linalg.gmres(lambda v: lin @ v, b, tol=1e-12)[0])
    for x in xs:
        close(x, expected, jnp.float64, scale=1e3)
