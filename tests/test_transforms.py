"""Every estimator under jax.vmap / jvp / jacfwd / grad / vjp / checkpoint (issue 12, item 1).

``vmcgrad.batched_vjp``, ``batched_jvp``, ``expect_grad``, ``QGT @ v`` and ``QGT.solve`` are bound as
one chunked map-reduce primitive (:mod:`vmcgrad._runner.primitive`), whose rules bind it again: every
transformation of a chunked estimator is itself chunked, with one reduction. Each is compared with
the same transformation of the plain, unchunked reference (``jax.vjp`` / ``jax.jvp`` on the whole
batch, a dense ``jax.jacfwd`` QGT), in float64, at 1e-10; with no mesh, an Auto-axis mesh (NetKet's
set-up) and an Explicit-axis mesh; for real->real, real->complex and complex non-holomorphic
functions; with a sample count the devices do not divide (padding). Under a mesh the compiled
program keeps every collective out of the chunk loop (HLO).
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, auto_mesh, explicit_mesh, make_case, random_like
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._chunks.plan import Space
from vmcgrad._runner.primitive import map_reduce

N_DEV = jax.device_count()
N = 7 * N_DEV  # 7 samples per device; chunk 3 -> 3 chunks, the last shifted back over 2 samples
CHUNK = 3
RTOL, ATOL = 1e-10, 1e-12
CASES = ["r2r", "r2c", "c2c_nonholo"]


# --- estimators and their unchunked references: est(params, samples, a) ---------------------


def ref_vjp(fun):
    return lambda p, x, c: jax.vjp(lambda p: fun(p, x), p)[1](c)[0]


def ref_jvp(fun):
    return lambda p, x, t: jax.jvp(lambda p: fun(p, x), (p,), (t,))[1]


def ref_expect_grad(fun):
    def est(p, x, e):
        c = jnp.conj(e - jnp.mean(e)) / e.shape[0]
        return jax.tree.map(lambda g: 2 * jnp.conj(g), ref_vjp(fun)(p, x, c))

    return est


PUBLIC = {"vjp": vmcgrad.batched_vjp, "jvp": vmcgrad.batched_jvp, "expect_grad": vmcgrad.expect_grad}
REFERENCE = {"vjp": ref_vjp, "jvp": ref_jvp, "expect_grad": ref_expect_grad}


def chunked(kind, fun, chunk=CHUNK):
    est = PUBLIC[kind]
    return lambda p, x, a: est(fun, p, x, a, chunk_size=chunk)


def loss(out):
    """A real, non-linear scalar of any estimator output (mixes real and imaginary parts)."""
    total = 0.0
    for o in jax.tree.leaves(out):
        total = total + jnp.sum(jnp.sin(jnp.real(o)) + 0.5 * jnp.cos(jnp.imag(o)) + 0.1 * jnp.abs(o) ** 2)
    return total


def real_part_replaced(x, xr):
    return xr + 1j * jnp.imag(x) if jnp.iscomplexobj(x) else xr


def shift(tree, s, d):
    return jax.tree.map(lambda a, b: a + s * b, tree, d)


# --- transformations: each maps est -> (function, which inputs it takes) --------------------
# Inputs are (p, x, a, dp, dx, da, ps, xs, as_): primals, tangents, and batched stacks.


TRANSFORMS = {
    "value": lambda est: lambda p, x, a, **_: est(p, x, a),
    "grad_params": lambda est: lambda p, x, a, **_: jax.grad(lambda p: loss(est(p, x, a)))(p),
    "grad_samples": lambda est: lambda p, x, a, **_: jax.grad(lambda x: loss(est(p, x, a)))(x),
    "grad_arg": lambda est: lambda p, x, a, **_: jax.grad(lambda a: loss(est(p, x, a)))(a),
    "vjp_all": lambda est: lambda p, x, a, **_: jax.vjp(est, p, x, a)[1](est(p, x, a)),
    "jvp_all": lambda est: lambda p, x, a, dp, dx, da, **_: jax.jvp(est, (p, x, a), (dp, dx, da)),
    "jacfwd_line": lambda est: (
        lambda p, x, a, dp, dx, da, **_: jax.jacfwd(
            lambda s: est(shift(p, s, dp), shift(x, s, dx), shift(a, s, da))
        )(0.0)
    ),
    # jacfwd in the samples' real part: JAX builds an unsharded basis that becomes a tangent operand
    "jacfwd_samples": lambda est: (
        lambda p, x, a, **_: jax.jacfwd(lambda xr: loss(est(p, real_part_replaced(x, xr), a)))(jnp.real(x))
    ),
    "hessian_line": lambda est: (
        lambda p, x, a, dp, dx, da, **_: jax.hessian(
            lambda s: loss(est(shift(p, s, dp), shift(x, s, dx), shift(a, s, da)))
        )(0.0)
    ),
    "vmap_arg": lambda est: lambda p, x, a, as_, **_: jax.vmap(est, (None, None, 0))(p, x, as_),
    "vmap_params": lambda est: lambda p, x, a, ps, **_: jax.vmap(est, (0, None, None))(ps, x, a),
    "vmap_samples": lambda est: lambda p, x, a, xs, **_: jax.vmap(est, (None, 0, None))(p, xs, a),
    "grad_of_vmap": lambda est: (
        lambda p, x, a, as_, **_: jax.grad(
            lambda p, as_: jnp.sum(jax.vmap(lambda a: loss(est(p, x, a)))(as_)), (0, 1)
        )(p, as_)
    ),
    "vmap_of_grad": lambda est: (
        lambda p, x, a, as_, **_: jax.vmap(jax.grad(lambda p, a: loss(est(p, x, a)), (0, 1)), (None, 0))(
            p, as_
        )
    ),
    "checkpoint_grad": lambda est: (
        lambda p, x, a, **_: jax.grad(jax.checkpoint(lambda p, x, a: loss(est(p, x, a))), (0, 1, 2))(p, x, a)
    ),
    "linear_transpose_arg": lambda est: (
        lambda p, x, a, **_: jax.linear_transpose(lambda a: est(p, x, a), a)(est(p, x, a))
    ),
}


# --- set-ups --------------------------------------------------------------------------------


@contextlib.contextmanager
def placement(kind):
    """Yields (on_mesh, place) where place(tree, sample_axis) puts arrays on the mesh."""
    with warnings.catch_warnings():
        # "none" on several devices: traced unsharded samples, as intended here
        warnings.filterwarnings("ignore", message=".*no sharding visible.*")
        if kind == "none":
            yield False, lambda tree, axis=None: tree
            return
        mesh = auto_mesh() if kind in ("netket", "auto_no_context") else explicit_mesh()

        def place(tree, axis):
            spec = P() if axis is None else P(*([None] * axis), "S")
            return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)

        if kind == "auto_no_context":  # sharded arrays, no jax.set_mesh around the user's jit
            yield True, place
            return
        with jax.set_mesh(mesh):
            yield True, place


def inputs(kind_est, case, n=N):
    fun, params, samples = make_case(case, n)
    out = jax.eval_shape(fun, params, samples)
    leaves, tdef = jax.tree.flatten(params)
    keys = iter(jax.random.split(jax.random.key(7), 16))

    def like_params():
        return jax.tree.unflatten(tdef, [random_like(next(keys), p.shape, p.dtype) for p in leaves])

    def like_samples(shape=(n,)):
        return random_like(next(keys), shape, out.dtype)

    if kind_est == "jvp":
        a, da = like_params(), like_params()
        as_ = jax.tree.map(lambda *t: jnp.stack(t), *[like_params() for _ in range(3)])
        a_axis = None
    else:
        a, da, as_ = like_samples(), like_samples(), like_samples((3, n))
        a_axis = 0
    ps = jax.tree.map(lambda u, v: jnp.stack([u, u + 0.1 * v]), params, like_params())
    xs = jnp.stack([samples, samples[::-1]])
    args = dict(
        p=params,
        x=samples,
        a=a,
        dp=like_params(),
        dx=random_like(next(keys), samples.shape, samples.dtype),
        da=da,
        ps=ps,
        xs=xs,
        as_=as_,
    )
    axes = dict(
        p=None, x=0, a=a_axis, dp=None, dx=0, da=a_axis, ps=None, xs=1, as_=None if a_axis is None else 1
    )
    return fun, args, axes


def run_case(est_kind, case, transform, setup, n=N):
    fun, args, axes = inputs(est_kind, case, n)
    reference = jax.jit(TRANSFORMS[transform](REFERENCE[est_kind](fun)))(**args)
    with placement(setup) as (on_mesh, place):
        placed = {k: place(v, axes[k]) if n % N_DEV == 0 else v for k, v in args.items()}
        f = jax.jit(TRANSFORMS[transform](chunked(est_kind, fun)))
        compiled = f.lower(**placed).compile()
        actual = compiled(**placed)
    assert_tree_allclose(jax.device_get(actual), jax.device_get(reference), rtol=RTOL, atol=ATOL)
    if on_mesh and N_DEV > 1:
        report = vmcgrad.collective_report(compiled)
        assert report.total_in_loops == 0, report
        if est_kind != "jvp":
            assert report.total_outside >= 1, report  # the reduction after the loop is there
    return compiled


JVP_TRANSFORMS = [
    t for t in TRANSFORMS if t not in ("vjp_all", "hessian_line", "vmap_params", "grad_of_vmap")
]
MATRIX = [("vjp", t) for t in TRANSFORMS] + [("jvp", t) for t in JVP_TRANSFORMS]


@pytest.mark.quick_cover("est_kind")
@pytest.mark.parametrize(("est_kind", "transform"), MATRIX)
def test_transform_under_mesh(est_kind, transform):
    """NetKet's set-up (Auto-axis mesh "S" in context, samples sharded): every transformation (the
    real->complex case here; the others run without a mesh and in the expect_grad tests)."""
    run_case(est_kind, "r2c", transform, "netket")


@pytest.mark.parametrize(("est_kind", "transform"), MATRIX)
def test_transform_without_mesh(est_kind, transform):
    """No mesh: the same rules, the complex non-holomorphic case."""
    run_case(est_kind, "c2c_nonholo", transform, "none")


EXPLICIT_SUBSET = [
    "value",
    "grad_params",
    "grad_samples",
    "jvp_all",
    "jacfwd_samples",
    "vmap_arg",
    "vmap_samples",
    "checkpoint_grad",
]


@pytest.mark.parametrize("transform", EXPLICIT_SUBSET)
@pytest.mark.parametrize(("est_kind", "case"), [("vjp", "c2c_nonholo"), ("jvp", "r2c")])
def test_transform_explicit_mesh(est_kind, case, transform):
    """An Explicit-axis mesh under ``jax.set_mesh`` (operands made by transformations, such as
    jacfwd's basis, are resharded by the runner)."""
    run_case(est_kind, case, transform, "explicit")


@pytest.mark.parametrize("transform", ["value", "grad_params", "grad_arg", "jvp_all", "vmap_arg"])
@pytest.mark.parametrize("case", CASES)
def test_expect_grad_transforms(case, transform):
    run_case("expect_grad", case, transform, "netket")


def test_expect_grad_hessian_line():
    run_case("expect_grad", "c2c_nonholo", "hessian_line", "netket")


@pytest.mark.parametrize("transform", ["grad_params", "grad_arg", "jvp_all", "vmap_arg", "vmap_samples"])
@pytest.mark.parametrize("est_kind", ["vjp", "jvp"])
def test_transform_with_padding(est_kind, transform):
    """N not divisible by the devices (padded rows inside the primitive get weight 0; their
    cotangents and per-sample outputs are dropped) and chunks that do not divide the rows."""
    run_case(est_kind, "r2c", transform, "netket", n=N + 1)


def test_parameter_derivative_is_one_chunked_pass_with_one_reduction():
    """grad in the parameters of a loss on batched_vjp (forward-over-reverse) compiles to chunk
    loops with no collective inside and a bounded number of reductions after them: the derivative
    of a chunked estimator is again a chunked estimator."""
    compiled = run_case("vjp", "r2c", "grad_params", "netket")
    if N_DEV > 1:
        report = vmcgrad.collective_report(compiled)
        assert report.total_in_loops == 0 and 1 <= report.total_outside <= 6, report


# --- QGT @ v and QGT.solve -------------------------------------------------------------------


def dense_qgt(fun, p, x, shift):
    """Re(ΔO† ΔO)/N + shift (the 'real' / 'complex'-rep QGT of real parameters), dense."""
    flat, unravel = ravel_pytree(p)
    jac = jax.jacfwd(lambda v: fun(unravel(v), x))(flat)
    d_jac = jac - jac.mean(0)
    return (d_jac.conj().T @ d_jac).real / x.shape[0] + shift * jnp.eye(flat.size)


SHIFT = 1e-2


def qgt_matvec(fun, design="fused"):
    return lambda p, x, v: vmcgrad.QGT(fun, p, x, chunk_size=CHUNK, diag_shift=SHIFT, design=design) @ v


def qgt_solve(fun, design="fused"):
    def solve(p, x, b):
        S = vmcgrad.QGT(fun, p, x, chunk_size=CHUNK, diag_shift=SHIFT, design=design)
        return S.solve(b, tol=1e-14)[0]

    return solve


def ref_matvec(fun):
    return lambda p, x, v: dense_qgt(fun, p, x, SHIFT) @ v


def ref_solve(fun):
    return lambda p, x, b: jnp.linalg.solve(dense_qgt(fun, p, x, SHIFT), b)


QGT_TRANSFORMS = {
    "value": lambda f: lambda p, x, b, basis: f(p, x, b),
    "dense_by_vmap": lambda f: lambda p, x, b, basis: jax.vmap(f, (None, None, 0))(p, x, basis),
    "vmap_params": lambda f: (
        lambda p, x, b, basis: jax.vmap(f, (0, None, None))(jnp.stack([p, p + 0.1 * b]), x, b)
    ),
    "grad_params": lambda f: lambda p, x, b, basis: jax.grad(lambda p: loss(f(p, x, b)))(p),
    "grad_vector": lambda f: lambda p, x, b, basis: jax.grad(lambda b: loss(f(p, x, b)))(b),
    "jvp_params": lambda f: lambda p, x, b, basis: jax.jvp(lambda p: f(p, x, b), (p,), (b,)),
    "checkpoint_grad": lambda f: (
        lambda p, x, b, basis: jax.grad(jax.checkpoint(lambda p: loss(f(p, x, b))))(p)
    ),
}


#: the fused design (the default): every transformation on r2c, under NetKet's mesh and without one;
#: the real case ('real' mode) on the mesh under the transformations that differentiate or batch in the
#: parameters (the mode's own code). The jvp-then-vjp design: r2c on the mesh, batched, differentiated
#: in the parameters and in the vector.
QGT_TRANSFORM_CASES = [
    (case, setup, op, transform, design)
    for case, setup, transforms, design in [
        ("r2c", "netket", list(QGT_TRANSFORMS), "fused"),
        ("r2c", "none", list(QGT_TRANSFORMS), "fused"),
        ("r2r", "netket", ["value", "vmap_params", "grad_params", "jvp_params"], "fused"),
        ("r2c", "netket", ["dense_by_vmap", "grad_params", "grad_vector", "jvp_params"], "jvp_vjp"),
    ]
    for op in ("matvec", "solve")
    for transform in transforms
]


@pytest.mark.quick_cover("op", "design")
@pytest.mark.parametrize(("case", "setup", "op", "transform", "design"), QGT_TRANSFORM_CASES)
def test_qgt_transforms(setup, case, op, transform, design):
    """S @ v and S.solve(b), in either design of the product, under vmap (a dense S from the basis),
    grad and jvp in the parameters (the QGT rebuilt inside), grad in the vector, checkpoint: against
    the dense jacfwd QGT."""
    fun, params, x = make_case(case, N)
    flat, unravel = ravel_pytree(params)
    f = lambda p, x: fun(unravel(p), x)
    b = random_like(jax.random.key(3), flat.shape, flat.dtype)
    basis = jnp.eye(flat.size, dtype=flat.dtype)[:4]
    transform_fn = QGT_TRANSFORMS[transform]
    build, ref = (qgt_matvec, ref_matvec) if op == "matvec" else (qgt_solve, ref_solve)
    reference = jax.jit(transform_fn(ref(f)))(flat, x, b, basis)
    with placement(setup) as (on_mesh, place):
        args = (place(flat, None), place(x, 0), place(b, None), place(basis, None))
        compiled = jax.jit(transform_fn(build(f, design))).lower(*args).compile()
        actual = compiled(*args)
    # cg to tol 1e-14 on a system of condition ~1e3; its implicit derivative is one more solve
    rtol, atol = (RTOL, 1e-10) if op == "matvec" else (1e-7, 1e-8)
    assert_tree_allclose(jax.device_get(actual), jax.device_get(reference), rtol=rtol, atol=atol)
    if on_mesh and N_DEV > 1:
        if op == "matvec":
            assert vmcgrad.collective_report(compiled).total_in_loops == 0
        else:
            # cg's own loop reduces each iteration (one product's reduction); the chunk loops
            # inside it must not.
            assert vmcgrad.collective_report(compiled).total_in_loops > 0
            assert innermost_loop_collectives(compiled.as_text()) == 0


@pytest.mark.heavy
def test_qgt_dense_and_diagonal_transform():
    """to_dense and diagonal (the Jacobian passes) under grad, jvp and vmap in the parameters."""
    fun, params, x = make_case("r2c", N)
    flat, unravel = ravel_pytree(params)
    f = lambda p, x: fun(unravel(p), x)
    dp = random_like(jax.random.key(4), flat.shape, flat.dtype)
    stack = jnp.stack([flat, flat + 0.1 * dp])

    def ours(p):
        S = vmcgrad.QGT(f, p, x, chunk_size=CHUNK, diag_shift=SHIFT, diag_scale=0.1)
        return S.to_dense(), S.diagonal()

    def ref(p):
        d = dense_qgt(f, p, x, 0.0)
        d = d + jnp.diag(0.1 * jnp.diag(d) + SHIFT)
        return d, jnp.diag(d)

    def scalar(fn):
        return lambda p: sum(jnp.sum(jnp.sin(a)) for a in fn(p))

    for transform in (
        lambda fn: jax.grad(scalar(fn))(flat),
        lambda fn: jax.jvp(fn, (flat,), (dp,)),
        lambda fn: jax.vmap(fn)(stack),
    ):
        assert_tree_allclose(transform(ours), transform(ref), rtol=1e-10, atol=1e-12)


def test_linearized_qgt_vmaps():
    """S.linearize() (kept linearisations: per-chunk operands of the primitive) under vmap over vectors."""
    fun, params, x = make_case("r2c", N)
    flat, unravel = ravel_pytree(params)
    f = lambda p, x: fun(unravel(p), x)
    basis = jnp.eye(flat.size, dtype=flat.dtype)[:4]
    lin = vmcgrad.QGT(f, flat, x, chunk_size=CHUNK, diag_shift=SHIFT).linearize()
    expected = basis @ dense_qgt(f, flat, x, SHIFT).T
    np.testing.assert_allclose(jax.vmap(lambda v: lin @ v)(basis), expected, rtol=1e-10, atol=1e-12)


def innermost_loop_collectives(text):
    """Collectives reachable from while bodies that contain no further while (the chunk loops)."""
    from vmcgrad._hlo import collectives as _hlo

    comps, _ = _hlo._parse(text)
    roots = [
        n
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for n in _hlo._CALLS.findall(line)
    ]
    count = 0
    for root in roots:
        reach = _hlo._reach(comps, [root])
        if any(" while(" in line for name in reach for line in comps[name]):
            continue
        count += sum(len(_hlo._OP.findall(line)) for name in reach for line in comps[name])
    return count


# --- closures, refusals, the primitive's contract and the HLO detector ----------------------


@pytest.mark.heavy
def test_traced_closure_is_differentiated():
    """A fun closing over a traced value (here the outer grad's variable) is hoisted, not frozen:
    without the hoisting the closed-over tangent would be silently dropped."""
    fun, params, x = make_case("r2c", N)
    c = random_like(jax.random.key(5), (N,), jnp.complex128)

    def make(vjp_of):
        return lambda s: loss(vjp_of(lambda p, x: s * fun(p, x))(params, x, c))

    expected = jax.grad(make(ref_vjp))(0.7)
    actual = jax.jit(jax.grad(make(lambda f: chunked("vjp", f))))(0.7)
    np.testing.assert_allclose(actual, expected, rtol=RTOL)


def test_partial_model_state_is_differentiated():
    """A ``Partial`` fun's arrays (model state) are operands of the primitive: grad reaches them."""
    fun, params, x = make_case("r2r", N)
    c = random_like(jax.random.key(6), (N,), jnp.float64)

    def scaled(s, p, x):
        return s * fun(p, x)

    def total(s, est):
        return loss(est(jax.tree_util.Partial(scaled, s), params, x, c))

    expected = jax.grad(lambda s: total(s, lambda f, p, x, c: ref_vjp(f)(p, x, c)))(0.7)
    actual = jax.grad(
        lambda s: total(s, lambda f, p, x, c: vmcgrad.batched_vjp(f, p, x, c, chunk_size=CHUNK))
    )(0.7)
    np.testing.assert_allclose(actual, expected, rtol=RTOL)


@pytest.mark.skipif(N_DEV == 1, reason="needs a mesh of several devices")
def test_refused_inside_shard_map():
    """The estimators shard themselves: called inside the user's shard_map they refuse up front."""
    fun, params, x = make_case("r2r", N)
    mesh = auto_mesh()

    def inner(x):
        return vmcgrad.batched_vjp(fun, params, x, jnp.ones(x.shape[0]), chunk_size=2)["b"]

    with pytest.raises(ValueError, match=r"vmcgrad.*inside jax\.shard_map.*Fix: call it outside"):
        jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("S"), out_specs=P()))(x)


def test_chunk_function_contract_sums_and_maps():
    """map_reduce itself: summed part and per-sample part, with the shifted last chunk and padding."""
    n = N + 1
    x = jnp.arange(n, dtype=jnp.float64)

    def chunk(scale, xc, w):
        return jnp.sum(jnp.where(w, xc, 0.0)) * scale, xc**2 * scale

    where = None
    if N_DEV > 1:
        from vmcgrad._problem.sharding import SampleAxis

        where = SampleAxis(auto_mesh(), "S")
    space = Space(where, n, -(-n // N_DEV) if where else n, CHUNK)
    total, rows = jax.jit(lambda s, x: map_reduce(space, chunk, [(s, (None,))], [x]))(jnp.float64(2.0), x)
    np.testing.assert_allclose(total, 2 * jnp.sum(x), rtol=RTOL)
    np.testing.assert_allclose(rows, 2 * x**2, rtol=RTOL)


@pytest.mark.skipif(N_DEV == 1, reason="needs a mesh of several devices")
def test_hlo_detector_fires_on_psum_inside_loop():
    """Companion: the HLO check sees a reduction per chunk when there is one."""
    mesh = auto_mesh()

    def local(x):
        def body(k, acc):
            return acc + jax.lax.psum(jax.lax.dynamic_slice_in_dim(x, k, 1).sum(), "S")

        return jax.lax.fori_loop(0, x.shape[0], body, jnp.zeros((), x.dtype))

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("S"), out_specs=P()))
    x = jnp.arange(N, dtype=jnp.float64)
    assert vmcgrad.collective_report(f.lower(x).compile()).total_in_loops >= 1


def test_no_recompile_under_jit():
    """A jitted transformed estimator compiles once."""
    from helpers import compile_count

    fun, params, x = make_case("r2c", N)
    c = random_like(jax.random.key(9), (N,), jnp.complex128)
    f = jax.jit(jax.grad(lambda p, c: loss(vmcgrad.batched_vjp(fun, p, x, c, chunk_size=CHUNK)), (0, 1)))
    c2 = jax.block_until_ready(2 * c)
    f(params, c)
    before = compile_count()
    f(params, c2)
    assert compile_count() == before


def spin_fun(p, s):
    """Integer spins in {0, 1}: the usual VMC sample type (no tangent, no cotangent)."""
    return jnp.sum(jnp.tanh((2 * s - 1) @ p["W"]), -1) + 1j * jnp.sum(s * p["a"], -1)


@pytest.mark.parametrize("setup", ["none", "netket", "auto_no_context"])
def test_integer_samples_captured_by_the_users_jit(setup):
    """int8 samples (float0 tangents) under grad, jvp and vmap, sharded or not, closed over by the
    user's jit (all its arguments unsharded: the primitive's operands tell jit the mesh)."""
    p = {"W": jax.random.normal(jax.random.key(0), (6, 4)) / 3, "a": jnp.linspace(0.0, 1.0, 6)}
    s = jax.random.bernoulli(jax.random.key(1), 0.5, (N, 6)).astype(jnp.int8)
    c = random_like(jax.random.key(2), (N,), jnp.complex128)

    def transforms(vjp, s):
        grad = jax.grad(lambda p, c: loss(vjp(p, s, c)), (0, 1))(p, c)
        tangents = jax.jvp(lambda p, c: vjp(p, s, c), (p, c), (p, c))
        batched = jax.vmap(lambda q: vjp(q, s, c))(jax.tree.map(lambda a: jnp.stack([a, -a]), p))
        return grad, tangents, batched

    expected = jax.jit(lambda: transforms(ref_vjp(spin_fun), s))()
    with placement(setup) as (_, place):
        s_placed = place(s, 0)
        actual = jax.jit(lambda: transforms(chunked("vjp", spin_fun), s_placed))()
    assert_tree_allclose(jax.device_get(actual), jax.device_get(expected), rtol=RTOL, atol=ATOL)


def test_linearized_qgt_transforms_and_refusals():
    """Kept linearisations: products and solves differentiate in their vector (the solve implicitly,
    as QGT.solve) and vmap over it; differentiating through the kept maps in the parameters is refused
    by the primitive's own jvp rule, naming vmcgrad and the alternative (which then works), with or
    without an outer jax.jit. (The guard this replaces matched JAX's tracer class names before
    tracing, and an outer jit hid them: jax.grad(jax.jit(... .linearize().solve(b) ...)) failed inside
    JAX with "mutable array references cannot be returned", and the product's case ran unrefused.)"""
    fun, params, x = make_case("r2c", N)
    flat, unravel = ravel_pytree(params)
    f = lambda p, x: fun(unravel(p), x)
    S = vmcgrad.QGT(f, flat, x, chunk_size=CHUNK, diag_shift=SHIFT)
    lin = S.linearize()
    b = random_like(jax.random.key(3), flat.shape, flat.dtype)
    stack = jnp.stack([b, random_like(jax.random.key(4), flat.shape, flat.dtype)])
    for transform in (
        lambda A: jax.grad(lambda v: jnp.sum(jnp.sin(A @ v)))(b),
        lambda A: jax.jvp(lambda v: A @ v, (b,), (b,)),
    ):
        assert_tree_allclose(transform(lin), transform(S), rtol=1e-10, atol=1e-12)
    dense = dense_qgt(f, flat, x, SHIFT)
    solve = lambda v: lin.solve(v, tol=1e-13)[0]
    x_b = jnp.linalg.solve(dense, b)
    np.testing.assert_allclose(
        jax.grad(lambda v: jnp.sum(jnp.sin(solve(v))))(b), jnp.linalg.solve(dense.T, jnp.cos(x_b)), rtol=1e-8
    )
    np.testing.assert_allclose(
        jax.jvp(solve, (b,), (stack[1],))[1], jnp.linalg.solve(dense, stack[1]), rtol=1e-8
    )
    np.testing.assert_allclose(jax.jit(jax.vmap(solve))(stack), jnp.linalg.solve(dense, stack.T).T, rtol=1e-8)

    kept = lambda p: vmcgrad.QGT(f, p, x, chunk_size=CHUNK, diag_shift=SHIFT).linearize()
    refused = (
        lambda: jax.grad(lambda p: jnp.sum(kept(p) @ b))(flat),
        lambda: jax.grad(jax.jit(lambda p: jnp.sum(kept(p) @ b)))(flat),
        lambda: jax.grad(jax.jit(lambda p: jnp.sum(kept(p).solve(b)[0])))(flat),
        lambda: jax.jvp(jax.jit(lambda p: kept(p).solve(b)[0]), (flat,), (b,)),
        lambda: jax.jacfwd(lambda p: kept(p) @ b)(flat),
    )
    for transform in refused:
        with pytest.raises(TypeError, match=r"LinearizedQGT cannot be differentiated.*Fix: .*vmcgrad\.QGT"):
            transform()
    fix = jax.grad(jax.jit(lambda p: jnp.sum(vmcgrad.QGT(f, p, x, chunk_size=CHUNK, diag_shift=SHIFT) @ b)))(
        flat
    )
    expected = jax.grad(lambda p: jnp.sum(dense_qgt(f, p, x, SHIFT) @ b))(flat)
    np.testing.assert_allclose(fix, expected, rtol=1e-8)
