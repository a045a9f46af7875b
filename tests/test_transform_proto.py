"""vmcgrad._transform: chunked estimators under jax.vmap / jvp / jacfwd / grad / vjp / checkpoint.

Every transformation of a chunked estimator is compared with the same transformation of the plain,
unchunked reference built from ``jax.vjp`` / ``jax.jvp`` on the whole batch, in float64, at 1e-10;
with no mesh, an Auto-axis mesh (NetKet's set-up) and an Explicit-axis mesh; for a real->real, a
real->complex and a complex non-holomorphic function. Under a mesh the compiled program must keep
every collective out of the chunk loop.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, auto_mesh, explicit_mesh, make_case, random_like
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._transform import Devices, chunked_map_reduce, expect_grad_pass, jvp_pass, vjp_pass

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


def chunked(kind, fun, devices, chunk=CHUNK):
    pas = {"vjp": vjp_pass, "jvp": jvp_pass, "expect_grad": expect_grad_pass}[kind]
    return lambda p, x, a: pas(fun, p, x, a, chunk_size=chunk, devices=devices)


REFERENCE = {"vjp": ref_vjp, "jvp": ref_jvp, "expect_grad": ref_expect_grad}


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
    """Yields (devices, place) where place(tree, sample_axis) puts arrays on the mesh."""
    if kind == "none":
        yield None, lambda tree, axis=None: tree
        return
    mesh = auto_mesh() if kind in ("netket", "auto_no_context") else explicit_mesh()

    def place(tree, axis):
        spec = P() if axis is None else P(*([None] * axis), "S")
        return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)

    if kind.endswith("_no_context"):  # sharded arrays, no jax.set_mesh around the user's jit
        yield Devices(mesh, "S"), place
        return
    with jax.set_mesh(mesh):
        yield Devices(mesh, "S"), place


def inputs(kind_est, case):
    fun, params, samples = make_case(case, N)
    out = jax.eval_shape(fun, params, samples)
    leaves, tdef = jax.tree.flatten(params)
    keys = iter(jax.random.split(jax.random.key(7), 16))

    def like_params():
        return jax.tree.unflatten(tdef, [random_like(next(keys), p.shape, p.dtype) for p in leaves])

    def like_samples(shape=(N,)):
        return random_like(next(keys), shape, out.dtype)

    if kind_est == "jvp":
        a, da = like_params(), like_params()
        as_ = jax.tree.map(lambda *t: jnp.stack(t), *[like_params() for _ in range(3)])
        a_axis = None
    else:
        a, da, as_ = like_samples(), like_samples(), like_samples((3, N))
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


def run_case(est_kind, case, transform, setup):
    fun, args, axes = inputs(est_kind, case)
    reference = jax.jit(TRANSFORMS[transform](REFERENCE[est_kind](fun)))(**args)
    with placement(setup) as (devices, place):
        placed = {k: place(v, axes[k]) for k, v in args.items()}
        f = jax.jit(TRANSFORMS[transform](chunked(est_kind, fun, devices)))
        compiled = f.lower(**placed).compile()
        actual = compiled(**placed)
    assert_tree_allclose(jax.device_get(actual), jax.device_get(reference), rtol=RTOL, atol=ATOL)
    if devices is not None:
        report = vmcgrad.collective_report(compiled)
        assert report.total_in_loops == 0, report
        if est_kind != "jvp":
            assert report.total_outside >= 1, report  # the psum after the loop is there


JVP_TRANSFORMS = [
    t for t in TRANSFORMS if t not in ("vjp_all", "hessian_line", "vmap_params", "grad_of_vmap")
]
MATRIX = [("vjp", t) for t in TRANSFORMS] + [("jvp", t) for t in JVP_TRANSFORMS]


@pytest.mark.parametrize("case", ["r2c"])  # r2r and c2c_nonholo: test_expect_grad_transforms, no mesh
@pytest.mark.parametrize(("est_kind", "transform"), MATRIX)
def test_transform_under_mesh(est_kind, transform, case):
    """NetKet's set-up (Auto-axis mesh "S", samples sharded): every transformation (one dtype case
    here to keep the suite's time; the others run without a mesh and in the expect_grad tests)."""
    run_case(est_kind, case, transform, "netket")


@pytest.mark.parametrize(("est_kind", "transform"), MATRIX)
def test_transform_without_mesh(est_kind, transform):
    """One device, no shard_map in the lowering: the same rules, the complex non-holomorphic case."""
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
    """An Explicit-axis mesh (jax.make_mesh's default): operands made by transformations are resharded."""
    run_case(est_kind, case, transform, "explicit")


@pytest.mark.parametrize("transform", ["value", "grad_samples", "jacfwd_samples", "vmap_samples"])
@pytest.mark.parametrize(("est_kind", "case"), [("vjp", "c2c_nonholo"), ("jvp", "r2c")])
def test_transform_explicit_mesh_no_context(est_kind, case, transform):
    """Explicit-axis arrays under the user's jit with no context mesh (the seed discussion's set-up)."""
    run_case(est_kind, case, transform, "explicit_no_context")


@pytest.mark.parametrize("transform", ["value", "grad_params", "grad_arg", "jvp_all", "vmap_arg"])
@pytest.mark.parametrize("case", CASES)
def test_expect_grad_transforms(case, transform):
    run_case("expect_grad", case, transform, "netket")


def test_expect_grad_hessian_line():
    run_case("expect_grad", "c2c_nonholo", "hessian_line", "netket")


# --- QGT @ v and QGT.solve: ordinary compositions of the two passes -------------------------


def qgt_matvec(jvp, vjp, n):
    """S v = (1/N) Re ΔO† ΔO v for real parameters: a jvp pass, a centring, a vjp pass."""

    def matvec(p, x, v):
        w = jvp(p, x, v)
        return jax.tree.map(lambda g: g / n, vjp(p, x, jnp.conj(w - jnp.mean(w))))

    return matvec


def qgt_solve(matvec, shift):
    def solve(p, x, b):
        op = lambda v: jax.tree.map(lambda sv, vv: sv + shift * vv, matvec(p, x, v), v)
        return jax.scipy.sparse.linalg.cg(op, b, tol=1e-15, atol=0.0, maxiter=400)[0]

    return solve


QGT_TRANSFORMS = {
    "dense_by_vmap": lambda f: lambda p, x, b, basis: jax.vmap(f, (None, None, 0))(p, x, basis),
    "grad_params": lambda f: lambda p, x, b, basis: jax.grad(lambda p: loss(f(p, x, b)))(p),
    "grad_vector": lambda f: lambda p, x, b, basis: jax.grad(lambda b: loss(f(p, x, b)))(b),
    "jvp_params": lambda f: lambda p, x, b, basis: jax.jvp(lambda p: f(p, x, b), (p,), (b,)),
}


@pytest.mark.parametrize("transform", list(QGT_TRANSFORMS))
@pytest.mark.parametrize("op", ["matvec", "solve"])
@pytest.mark.parametrize("case", ["r2r", "r2c"])
@pytest.mark.parametrize("setup", ["netket"])
def test_qgt_compositions(setup, case, op, transform):
    fun, params, x = make_case(case, N)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    f = lambda p, x: fun(unravel(p), x)
    b = random_like(jax.random.key(3), flat.shape, flat.dtype)
    basis = jnp.eye(flat.size, dtype=flat.dtype)[:4]

    def build(jvp, vjp):
        mv = qgt_matvec(jvp, vjp, N)
        return mv if op == "matvec" else qgt_solve(mv, 1e-2)

    transform_fn = QGT_TRANSFORMS[transform]
    reference = jax.jit(transform_fn(build(ref_jvp(f), ref_vjp(f))))(flat, x, b, basis)
    with placement(setup) as (devices, place):
        est = build(chunked("jvp", f, devices), chunked("vjp", f, devices))
        args = (place(flat, None), place(x, 0), place(b, None), place(basis, None))
        compiled = jax.jit(transform_fn(est)).lower(*args).compile()
        actual = compiled(*args)
    rtol = RTOL if op == "matvec" else 1e-8  # cg to tol 1e-15 on a system of condition ~1e3
    assert_tree_allclose(jax.device_get(actual), jax.device_get(reference), rtol=rtol, atol=1e-10)
    if devices is not None and op == "matvec":
        assert vmcgrad.collective_report(compiled).total_in_loops == 0
    elif devices is not None:
        # cg's own loop reduces each iteration (the centring mean and the vjp pass's psum);
        # the chunk loops inside it must not.
        assert vmcgrad.collective_report(compiled).total_in_loops > 0
        assert innermost_loop_collectives(compiled.as_text()) == 0


def innermost_loop_collectives(text):
    """Collectives reachable from while bodies that contain no further while (the chunk loops)."""
    from vmcgrad import _hlo

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


# --- closures, refusals, and the HLO detector ---------------------------------------------


def test_traced_closure_is_differentiated():
    """A fun closing over a traced value (here the outer grad's variable) is hoisted, not frozen."""
    fun, params, x = make_case("r2c", N)
    c = random_like(jax.random.key(5), (N,), jnp.complex128)

    def make(vjp_of):
        return lambda s: loss(vjp_of(lambda p, x: s * fun(p, x))(params, x, c))

    expected = jax.grad(make(ref_vjp))(0.7)
    actual = jax.jit(jax.grad(make(lambda f: chunked("vjp", f, None))))(0.7)
    np.testing.assert_allclose(actual, expected, rtol=RTOL)


@pytest.mark.skipif(N_DEV == 1, reason="needs a mesh of several devices")
def test_refused_inside_shard_map():
    fun, params, x = make_case("r2r", N)
    mesh = auto_mesh()
    devices = Devices(mesh, "S")

    def inner(x):
        return vjp_pass(fun, params, x, jnp.ones(x.shape[0]), chunk_size=2, devices=devices)["b"]

    with pytest.raises(ValueError, match=r"vmcgrad.*inside jax\.shard_map.*Fix: call it outside shard_map"):
        jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=P("S"), out_specs=P()))(x)


@pytest.mark.skipif(N_DEV == 1, reason="needs a mesh of several devices")
def test_refused_indivisible_sample_count():
    fun, params, x = make_case("r2r", N + 1)
    with pytest.raises(ValueError, match=rf"{N + 1} samples over {N_DEV} devices.*expected a multiple"):
        vjp_pass(fun, params, x, jnp.ones(N + 1), chunk_size=2, devices=Devices(auto_mesh(), "S"))


def test_chunk_function_contract_sums_and_maps():
    """chunked_map_reduce itself: summed part and per-sample part, with the shifted last chunk."""
    x = jnp.arange(N, dtype=jnp.float64)

    def chunk(scale, xc, fresh):
        return jnp.sum(jnp.where(fresh, xc, 0.0)) * scale, xc**2 * scale

    total, rows = chunked_map_reduce(chunk, jnp.float64(2.0), x, chunk_size=CHUNK)
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
    """A jitted transformed estimator compiles once (eager calls do retrace: see module notes)."""
    from helpers import compile_count

    fun, params, x = make_case("r2c", N)
    c = random_like(jax.random.key(9), (N,), jnp.complex128)
    f = jax.jit(jax.grad(lambda p, c: loss(vjp_pass(fun, p, x, c, chunk_size=CHUNK)), (0, 1)))
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
    """int8 samples, sharded and closed over by the user's jit (all jit arguments unsharded)."""
    p = {"W": jax.random.normal(jax.random.key(0), (6, 4)) / 3, "a": jnp.linspace(0.0, 1.0, 6)}
    s = jax.random.bernoulli(jax.random.key(1), 0.5, (N, 6)).astype(jnp.int8)
    c = random_like(jax.random.key(2), (N,), jnp.complex128)

    def transforms(vjp, s):
        grad = jax.grad(lambda p, c: loss(vjp(p, s, c)), (0, 1))(p, c)
        tangents = jax.jvp(lambda p, c: vjp(p, s, c), (p, c), (p, c))
        batched = jax.vmap(lambda q: vjp(q, s, c))(jax.tree.map(lambda a: jnp.stack([a, -a]), p))
        return grad, tangents, batched

    expected = jax.jit(lambda: transforms(ref_vjp(spin_fun), s))()
    with placement(setup) as (devices, place):
        s_placed = place(s, 0)
        actual = jax.jit(lambda: transforms(chunked("vjp", spin_fun, devices), s_placed))()
    assert_tree_allclose(jax.device_get(actual), jax.device_get(expected), rtol=RTOL, atol=ATOL)
