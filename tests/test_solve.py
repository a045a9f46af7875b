"""The conjugate-gradient solver (vmcgrad._sr.solve.cg) and QGT.solve: answers against dense solves and
jax.scipy's CG, and `converged` that is true only for a true solution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, make_case, random_like, setup
from jax.flatten_util import ravel_pytree

import vmcgrad
from vmcgrad._sr.solve import cg

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N_DEV = jax.device_count()
N = 11 * N_DEV


def spd(n, seed, *, complex_=False, spread=2.0, scale=1.0):
    """A Hermitian positive-definite matrix: eigenvalues in [1, 10**spread], then rescaled by a
    diagonal in [10**-scale, 10**scale] on both sides (an uneven diagonal, so that Jacobi
    preconditioning changes the iterates)."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(n, n)) + (1j * rng.normal(size=(n, n)) if complex_ else 0)
    q, _ = np.linalg.qr(g)
    d = np.diag(np.logspace(-scale, scale, n))  # a badly scaled system
    a = d @ q @ np.diag(np.logspace(0, spread, n)) @ q.conj().T @ d
    return jnp.asarray((a + a.conj().T) / 2)


def rhs(n, seed, *, complex_=False):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=n) + (1j * rng.normal(size=n) if complex_ else 0))


# --- cg on dense matrices --------------------------------------------------------------------


@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize("precondition", [False, True], ids=["plain", "jacobi"])
def test_cg_matches_dense_solve(complex_, precondition):
    """Tolerances from the problem: a residual below eps·‖A‖‖x‖ is rounding, so ``tol`` sits 100×
    above that floor (a lower one passes or fails with the compiler's rounding); the error follows
    from the residual, ‖x − x*‖ ≤ ‖A⁻¹‖ ‖b − A x‖, plus x*'s own rounding, eps·cond(A)·‖x*‖."""
    a, b = spd(20, 0, complex_=complex_), rhs(20, 1, complex_=complex_)
    a_np, b_np, eps = np.asarray(a), np.asarray(b), np.finfo(np.float64).eps
    x_ref = np.linalg.solve(a_np, b_np)
    eig = np.linalg.eigvalsh(a_np)
    floor = eps * eig.max() * np.linalg.norm(x_ref) / np.linalg.norm(b_np)
    tol = 100 * floor  # about 4e-10 here
    m = (lambda r: r / jnp.diag(a).real) if precondition else None
    x, info = jax.jit(lambda b: cg(lambda v: a @ v, b, tol=tol, maxiter=500, M=m))(b)
    assert bool(info.converged)
    true = float(np.linalg.norm(a_np @ np.asarray(x) - b_np))
    # two computations of one residual agree up to the rounding floor, not to a relative 1e-6
    np.testing.assert_allclose(float(info.true_residual_norm), true, atol=10 * floor * np.linalg.norm(b_np))
    assert true <= tol * np.linalg.norm(b_np)
    bound = true / eig.min() + 10 * eps * (eig.max() / eig.min()) * np.linalg.norm(x_ref)
    assert np.linalg.norm(np.asarray(x) - x_ref) <= bound


@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize("precondition", [False, True], ids=["plain", "jacobi"])
@pytest.mark.parametrize("with_x0", [False, True], ids=["x0=None", "x0"])
def test_cg_iterates_equal_jax_scipy(complex_, precondition, with_x0):
    """Iterate for iterate the recursion of jax.scipy.sparse.linalg.cg, also with its M=, on pytrees.

    (A well-conditioned matrix: after a few iterations on an ill-conditioned one, CG amplifies the
    last-bit differences of two summation orders.)"""
    a = spd(12, 2, complex_=complex_, spread=1.0, scale=0.5)
    b_flat = rhs(12, 3, complex_=complex_)
    unravel = lambda v: {"u": v[:5], "w": v[5:].reshape(7, 1)}
    ravel = lambda t: jnp.concatenate([t["u"], t["w"].ravel()])
    matvec = lambda t: unravel(a @ ravel(t))
    m = (lambda t: unravel(ravel(t) / jnp.diag(a).real)) if precondition else None
    x0 = unravel(0.1 * rhs(12, 4, complex_=complex_)) if with_x0 else None
    for k in (1, 2, 4, 6):
        ours, info = cg(matvec, unravel(b_flat), x0, tol=0.0, maxiter=k, M=m)
        theirs, _ = jax.scipy.sparse.linalg.cg(
            matvec, unravel(b_flat), x0, tol=0.0, maxiter=k, M=m if precondition else None
        )
        assert int(info.iterations) == k and not bool(info.converged)
        assert_tree_allclose(ours, theirs, rtol=1e-12, atol=1e-13)


def test_cg_stops_at_the_same_iteration_as_jax_scipy():
    """Same stopping rule (recursion residual <= max(tol |b|, atol)): at tol=1e-6, jax.scipy's CG stops
    at our iteration k too (its answer is its k-th iterate, not its (k-1)-th), and our answer is that
    iterate up to far less than the last step.

    Measured against the last step ‖x_k − x_{k−1}‖, not to a fixed 1e-10: two summation orders of
    the same recursion drift apart over 30 iterations on this condition number (1e3), by 1.5e-9
    relative on one CPU and under 1e-10 on another (a fixed tolerance failed in CI)."""
    a, b = spd(30, 5, spread=2.0, scale=0.5), rhs(30, 6)
    m = lambda r: r / jnp.diag(a)
    x, info = cg(lambda v: a @ v, b, tol=1e-6, maxiter=1000, M=m)
    k = int(info.iterations)
    assert bool(info.converged) and 1 < k < 60

    def theirs(maxiter):
        return np.asarray(jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, tol=1e-6, maxiter=maxiter, M=m)[0])

    final, at_k, before = theirs(1000), theirs(k), theirs(k - 1)
    step = np.linalg.norm(at_k - before)
    assert np.linalg.norm(at_k - final) <= 1e-3 * step  # jax.scipy did not go on after k
    assert np.linalg.norm(before - final) >= 0.5 * step  # nor stop before it
    assert np.linalg.norm(np.asarray(x) - final) <= 1e-2 * step


def test_converged_uses_the_true_residual():
    """Detector: on an ill-conditioned system the recursion residual drifts below the tolerance
    while b - A x does not; `converged` must follow the true residual."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(60, 60)))
    a = q @ np.diag(np.logspace(0, 10, 60)) @ q.T
    a = jnp.asarray((a + a.T) / 2)
    b = jnp.asarray(rng.normal(size=60))
    thresh = 1e-10 * float(jnp.linalg.norm(b))
    x, info = jax.jit(lambda b: cg(lambda v: a @ v, b, tol=1e-10, maxiter=20000))(b)
    assert float(info.residual_norm) <= thresh  # the recursion claims convergence ...
    true = float(jnp.linalg.norm(a @ x - b))
    assert true > 10 * thresh  # ... on an answer that is not within the tolerance
    np.testing.assert_allclose(float(info.true_residual_norm), true, rtol=1e-6)
    assert not bool(info.converged)


@pytest.mark.parametrize(
    "b, why",
    [(jnp.array([1.0, 1.0, 1.0]), "inconsistent"), (jnp.array([0.0, 0.0, 1.0]), "null space: 0/0")],
)
def test_singular_system_is_not_converged(b, why):
    a = jnp.diag(jnp.array([2.0, 1.0, 0.0]))
    x, info = cg(lambda v: a @ v, b, tol=1e-8, maxiter=30)
    assert not bool(info.converged), (why, x, info)


def test_maxiter_too_small_and_nan_are_not_converged():
    a, b = spd(20, 7), rhs(20, 8)
    _, info = cg(lambda v: a @ v, b, tol=1e-12, maxiter=2)
    assert int(info.iterations) == 2 and not bool(info.converged)
    _, info = cg(lambda v: a @ v * jnp.nan, b, tol=1e-12, maxiter=50)
    assert not bool(info.converged)
    # a zero right-hand side is solved by x = 0 at once, truly
    x, info = cg(lambda v: a @ v, jnp.zeros(20), maxiter=5)
    assert bool(info.converged) and int(info.iterations) == 0 and not jnp.any(x)


def test_true_residual_costs_one_product_and_only_when_claimed():
    """Products run: k in the loop, plus one for the true residual only if the recursion met the
    tolerance (a solve stopped by maxiter costs no more than k). One device: host callbacks."""
    a, b = spd(10, 9), rhs(10, 10)
    calls = []

    def matvec(v):
        jax.debug.callback(lambda: calls.append(1))
        return a @ v

    solve = jax.jit(lambda b, tol, maxiter: cg(matvec, b, tol=tol, maxiter=maxiter))
    jax.block_until_ready(solve(b, 0.0, 3))
    assert len(calls) == 3
    calls.clear()
    _, info = jax.block_until_ready(solve(b, 1e-10, 100))
    assert bool(info.converged) and len(calls) == int(info.iterations) + 1


# --- QGT.solve ---------------------------------------------------------------------------------


def dense_qgt(fun, params, samples):
    """S = ΔO^T ΔO / N for real parameters and a real output, from jax.jacrev (ravel order)."""
    flat, unravel = ravel_pytree(params)
    o = jax.jacrev(lambda f: fun(unravel(f), samples))(flat)
    do = o - o.mean(0)
    return do.T @ do / o.shape[0]


def with_unused_leaf(fun, params):
    """A parameter leaf the output does not depend on: S has a zero row and column there."""
    return (lambda p, x: fun({k: v for k, v in p.items() if k != "unused"}, x)), {
        **params,
        "unused": jnp.zeros(2),
    }


@pytest.mark.heavy
def test_diag_scale_zero_is_no_scaling():
    """diag_scale=0 is diag_scale=None (it returned x = 0 with converged=True)."""
    fun, params, samples = make_case("r2r", N)
    b = jax.tree.map(lambda p: random_like(jax.random.key(1), p.shape, p.dtype), params)
    with setup("netket") as place:
        S0 = vmcgrad.QGT(fun, params, place(samples), chunk_size=3, diag_shift=1e-2, diag_scale=0.0)
        S_none = vmcgrad.QGT(fun, params, place(samples), chunk_size=3, diag_shift=1e-2)
        assert S0.diag_scale is None and S0.diag_s is None
        x, info = S0.solve(b, tol=1e-12)
        x_none, _ = S_none.solve(b, tol=1e-12)
        assert S_none.replace(diag_scale=0.0).diag_scale is None
    a = dense_qgt(fun, params, samples) + 1e-2 * jnp.eye(ravel_pytree(params)[0].size)
    x_ref = jnp.linalg.solve(a, ravel_pytree(b)[0])
    assert bool(info.converged)
    np.testing.assert_allclose(ravel_pytree(x)[0], x_ref, rtol=1e-8, atol=1e-10)
    assert_tree_allclose(x, x_none, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("diag_scale", [None, 0.1])
def test_jacobi_preconditioned_solve_iterates_equal_jax_scipy(diag_scale):
    """QGT.solve with diag_scale is CG preconditioned by D^-1, D = diag_scale diag(S) + diag_shift:
    equal after k iterations to jax.scipy's cg on the dense S_eff with that M."""
    fun, params, samples = make_case("r2c", N)
    shift = 0.02
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=4, diag_shift=shift, diag_scale=diag_scale)
        a = S.to_dense()
        b = jax.random.normal(jax.random.key(3), (S.dim,))
        xs = [S.solve(b, tol=0.0, maxiter=k)[0] for k in (1, 3, 6)]
        x_conv, info = S.solve(b, tol=1e-12)
    s_diag = (jnp.diag(a) - shift) / (1 + (diag_scale or 0.0))
    m = None if diag_scale is None else (lambda r: r / (diag_scale * s_diag + shift))
    for k, x in zip((1, 3, 6), xs):
        x_ref, _ = jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, tol=0.0, maxiter=k, M=m)
        np.testing.assert_allclose(x, x_ref, rtol=1e-9, atol=1e-11)
    assert bool(info.converged)
    np.testing.assert_allclose(x_conv, jnp.linalg.solve(a, b), rtol=1e-8, atol=1e-10)


def test_singular_qgt_without_shift():
    """diag_shift=0 and N < P: S is singular. Consistent b: a true solution, converged; b outside the
    range (inconsistent): not converged; b in the null space only (0/0 in CG): not converged."""
    fun, params, samples = make_case("r2r", N)
    fun, params = with_unused_leaf(fun, params)
    flat, _ = ravel_pytree(params)
    a = dense_qgt(fun, params, samples)
    assert jnp.linalg.matrix_rank(a) < flat.size
    x_true = random_like(jax.random.key(5), flat.shape, flat.dtype)
    b_in = a @ x_true
    b_out = b_in + jnp.zeros_like(flat).at[-1].set(1.0)  # the unused leaf: no column of S reaches it
    b_null = jnp.zeros_like(flat).at[-1].set(1.0)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=3)
        x, info = S.solve(b_in, tol=1e-10)
        _, info_out = S.solve(b_out, tol=1e-10)
        _, info_null = S.solve(b_null, tol=1e-10)
    assert bool(info.converged)
    assert float(jnp.linalg.norm(a @ x - b_in)) <= 1e-10 * float(jnp.linalg.norm(b_in)) * 1.0001
    assert not bool(info_out.converged)
    assert not bool(info_null.converged)


def test_diag_scale_without_shift_and_a_zero_diagonal():
    """Jacobi with diag(S)_kk = 0 and no shift: that entry is left unscaled (it was 0/0 = NaN)."""
    fun, params, samples = make_case("r2r", N)
    fun, params = with_unused_leaf(fun, params)
    flat, _ = ravel_pytree(params)
    s = dense_qgt(fun, params, samples)
    a = s + 0.1 * jnp.diag(jnp.diag(s))
    b = a @ random_like(jax.random.key(6), flat.shape, flat.dtype)
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=3, diag_scale=0.1)
        x, info = S.solve(b, tol=1e-10)
    assert bool(info.converged) and bool(jnp.all(jnp.isfinite(x)))
    assert float(jnp.linalg.norm(a @ x - b)) <= 1e-10 * float(jnp.linalg.norm(b)) * 1.0001


# --- argument checks (before tracing) --------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    fun, params, samples = make_case("r2r", 8)
    return fun, params, samples, vmcgrad.QGT(fun, params, samples, diag_shift=0.1)


@pytest.mark.parametrize("name", ["diag_shift", "diag_scale"])
@pytest.mark.parametrize(
    "value, error, text",
    [
        (-1.0, ValueError, "must be a finite number >= 0; got -1.0"),
        (float("nan"), ValueError, "must be a finite number >= 0; got nan"),
        (float("inf"), ValueError, "must be a finite number >= 0; got inf"),
        (np.float32(-0.5), ValueError, "got -0.5"),
        ("a", TypeError, "must be a real scalar; got 'a' (str)"),
        (True, TypeError, "must be a real scalar; got True (bool)"),
        (1j, TypeError, "must be a real scalar"),
        (jnp.ones(3), TypeError, "must be a real scalar; got shape (3,)"),
    ],
)
def test_bad_shifts(small, name, value, error, text):
    fun, params, samples, S = small
    build = lambda: vmcgrad.QGT(fun, params, samples, **{name: value})
    for call in (build, lambda: S.replace(**{name: value})):
        with pytest.raises(error, match=f"`{name}`") as info:
            call()
        assert text in str(info.value) and "Fix:" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"tol": "a"}, TypeError, "`tol` must be a real scalar; got 'a' (str)"),
        ({"tol": -1e-5}, ValueError, "`tol` must be a finite number >= 0"),
        ({"tol": float("nan")}, ValueError, "`tol` must be a finite number >= 0; got nan"),
        ({"atol": float("inf")}, ValueError, "`atol` must be a finite number >= 0; got inf"),
        ({"atol": None}, TypeError, "`atol` must be a real scalar; got None"),
        ({"maxiter": -1}, ValueError, "`maxiter` must be an int >= 0; got -1"),
        ({"maxiter": 1.5}, TypeError, "`maxiter` must be an int >= 0 or None; got 1.5 (float)"),
        ({"maxiter": 2.0}, TypeError, "got 2.0 (float)"),
        ({"maxiter": True}, TypeError, "got True (bool)"),
        ({"maxiter": "10"}, TypeError, "got '10' (str)"),
    ],
)
def test_bad_solve_arguments(small, kwargs, error, text):
    _, params, _, S = small
    with pytest.raises(error, match=r"vmcgrad\.QGT\.solve: ") as info:
        S.solve(params, **kwargs)
    assert text in str(info.value) and "Fix:" in str(info.value)
    # the same clear error under the user's jit (checked before tracing)
    with pytest.raises(error, match=r"vmcgrad\.QGT\.solve: "):
        jax.jit(lambda S, b: S.solve(b, **kwargs))(S, params)


def test_long_vector_message_is_abbreviated(small):
    *_, S = small
    with pytest.raises(TypeError, match="`b` must be a pytree like `params`") as info:
        S.solve([1.0] * 10**4)
    assert "got a list of 10000 elements [1.0, 1.0, 1.0, ...]" in str(info.value)
    assert len(str(info.value)) < 600


def test_good_solve_arguments(small):
    _, params, _, S = small
    x, info = S.solve(params, maxiter=np.int64(3), tol=np.float32(0.0), atol=0)
    assert int(info.iterations) == 3
    x, info = S.solve(params, maxiter=0)  # no iteration: x0 (zeros) is returned, not converged
    assert int(info.iterations) == 0 and not bool(info.converged)
    assert not any(map(jnp.any, jax.tree.leaves(x)))
    # traced shifts, tolerances and maxiter (an operator rebuilt inside jit) are accepted
    out = jax.jit(lambda S, s, t, k: S.replace(diag_shift=s).solve(params, tol=t, maxiter=k))(
        S, 0.2, 1e-10, jnp.int32(50)
    )
    assert bool(out[1].converged)


@pytest.mark.parametrize("case", ["r2c", "c2c_holo"])
@pytest.mark.parametrize("solver", ["cg", "gmres"])
def test_jax_scipy_solvers_run_on_the_qgt_product(case, solver):
    """``jax.scipy.sparse.linalg.cg``/``gmres`` on ``lambda v: S @ v`` (jitted, the operator a traced
    argument) solve S_eff x = b: what vmcgrad/_sr/solve.py and vmcgrad/netket/_qgt.py say; and the
    product's transpose is :math:`\\overline{S_\\text{eff} \\bar v}` (``jax.linear_transpose``)."""
    fun, params, samples = make_case(case, N)
    holomorphic = True if case == "c2c_holo" else None
    with setup("netket") as place:
        S = vmcgrad.QGT(fun, params, place(samples), chunk_size=4, diag_shift=0.05, holomorphic=holomorphic)
        a = S.to_dense()
        b = jax.random.normal(jax.random.key(5), (S.dim,)).astype(a.dtype)
        run = getattr(jax.scipy.sparse.linalg, solver)
        x = jax.jit(lambda S, b: run(lambda v: S @ v, b, tol=1e-13, atol=0.0)[0])(S, b)
        transposed = jax.linear_transpose(lambda v: S @ v, b)(b)[0]
    # residual <= 1e-13 |b|, so |x - x*| <= cond(S_eff) 1e-13 |x*| (and the dense solve's own cond * eps)
    x_ref = jnp.linalg.solve(a, b)
    bound = 10 * float(np.linalg.cond(a)) * (1e-13 + np.finfo(np.float64).eps)
    assert float(jnp.linalg.norm(x - x_ref)) <= bound * float(jnp.linalg.norm(x_ref))
    np.testing.assert_allclose(transposed, a.T @ b, rtol=1e-12, atol=1e-13)
