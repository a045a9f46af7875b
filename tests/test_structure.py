"""Structural claims, tested: one reduction after the loop, flat memory in N, no recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_count, make_case, setup
from jax.sharding import AxisType

import vmcgrad
from vmcgrad import collective_report

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = pytest.mark.one_device_smoke

N_DEV = jax.device_count()
multi = pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")


def seed_program():
    """The seed discussion's naive program: vjp in a scan under Explicit sharding."""

    def mubatch_loss(Ws, xs):
        act, _ = jax.lax.scan(lambda xs, W: (jnp.dot(xs, W), None), xs, Ws)
        return jnp.sum(act, axis=-1)

    @jax.jit
    def process_batch(Ws, xs_batch, dv_batch):
        grad_acc = jax.new_ref(jnp.zeros_like(Ws))

        def process_mubatch(_, args):
            xs, dl = args
            _, f_vjp = jax.vjp(lambda Ws: mubatch_loss(Ws, xs), Ws)
            f_vjp.with_refs(grad_acc)(dl)
            return (), None

        xs = xs_batch.reshape((N_DEV, 5, 7, *xs_batch.shape[1:]), out_sharding=jax.P("S"))
        dv = dv_batch.reshape((N_DEV, 5, 7), out_sharding=jax.P("S"))
        jax.lax.scan(process_mubatch, (), (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(dv, 0, 1)))
        return jax.ref.freeze(grad_acc)

    return mubatch_loss, process_batch


@multi
def test_detector_fires_on_the_seed_program():
    """Companion test: the naive program does reduce inside its loop, and the report sees it."""
    mesh = jax.make_mesh((N_DEV,), ("S",), axis_types=(AxisType.Explicit,))
    loss, naive = seed_program()
    with jax.set_mesh(mesh):
        Ws = jax.sharding.reshard(jnp.ones((3, 4, 4)), jax.P())
        xs = jax.sharding.reshard(jnp.ones((35 * N_DEV, 4)), jax.P("S"))
        dv = jax.sharding.reshard(jax.random.normal(jax.random.key(1), 35 * N_DEV), jax.P("S"))
        bad = collective_report(naive.lower(Ws, xs, dv).compile())
        ours = jax.jit(lambda W, x, d: vmcgrad.batched_vjp(loss, W, x, d, chunk_size=7))
        good = collective_report(ours.lower(Ws, xs, dv).compile())
        assert jnp.allclose(ours(Ws, xs, dv), naive(Ws, xs, dv))
    assert bad.in_loops["all-reduce"] >= 1
    assert good.total_in_loops == 0
    assert good.outside == {"all-reduce": 1}


@multi
@pytest.mark.parametrize("kind", ["netket", "explicit"])
@pytest.mark.parametrize("case", ["r2r", "r2c", "mixed", "layered"])
def test_one_reduction_after_the_loop(kind, case):
    fun, params, samples = make_case(case, 37 * N_DEV)
    out = jax.eval_shape(fun, params, samples)
    ct = jnp.ones(out.shape, out.dtype)
    n_dtypes = len({leaf.dtype for leaf in jax.tree.leaves(params)})
    with setup(kind) as place:
        samples, ct = place(samples), place(ct)
        f = jax.jit(lambda p, x, c: vmcgrad.batched_vjp(fun, p, x, c, chunk_size=5))
        report = collective_report(f.lower(params, samples, ct).compile())
        assert report.total_in_loops == 0, report
        # one all-reduce after the loop; XLA may split it by leaf dtype
        assert set(report.outside) == {"all-reduce"}
        assert 1 <= report.outside["all-reduce"] <= n_dtypes, report


@multi
@pytest.mark.parametrize("kind", ["netket", "explicit"])
def test_jvp_has_no_communication(kind):
    fun, params, samples = make_case("r2c", 37 * N_DEV)
    with setup(kind) as place:
        samples = place(samples)
        f = jax.jit(lambda p, x, t: vmcgrad.batched_jvp(fun, p, x, t, chunk_size=5))
        report = collective_report(f.lower(params, samples, params).compile())
    assert report.total_in_loops == 0 and report.total_outside == 0, report


def temp_bytes(f, *args):
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("chunk", [64, 100])
def test_temp_memory_flat_in_n(chunk):
    """Fixed chunk: temp memory at 16·N within 5% of that at N; the plain vjp grows."""

    def measure(n):
        fun, params, samples = make_case("r2c", n * N_DEV)
        fun_ = lambda p, x: fun(p, jnp.tile(x, (1, 64)))
        params = {"W": jnp.tile(params["W"], (64, 8)) / 64, "phase": jnp.tile(params["phase"], (8, 1))}
        ct = jnp.ones(n * N_DEV, jnp.complex128)
        with setup("netket") as place:
            x, c = place(samples), place(ct)
            ours = jax.jit(lambda p, x, c: vmcgrad.batched_vjp(fun_, p, x, c, chunk_size=chunk))
            plain = jax.jit(lambda p, x, c: jax.vjp(lambda q: fun_(q, x), p)[1](c)[0])
            return temp_bytes(ours, params, x, c), temp_bytes(plain, params, x, c)

    n = 4 * chunk
    ours_n, plain_n = measure(n)
    ours_16n, plain_16n = measure(16 * n)
    assert ours_16n <= 1.05 * ours_n, (ours_n, ours_16n)
    assert plain_16n >= 8 * plain_n, (plain_n, plain_16n)
    assert ours_16n < plain_16n / 4


def test_no_recompilation_on_second_call():
    fun, params, samples = make_case("r2c", 37 * N_DEV)
    ct = jnp.ones(37 * N_DEV, jnp.complex128)
    params2 = jax.block_until_ready(jax.tree.map(lambda a: a + 1, params))  # placed like params
    with setup("netket") as place:
        samples, ct = place(samples), place(ct)
        user = jax.jit(lambda p, x, c: vmcgrad.batched_vjp(fun, p, x, c, chunk_size=5))
        for call in (
            lambda p: vmcgrad.batched_vjp(fun, p, samples, ct, chunk_size=5),
            lambda p: vmcgrad.batched_jvp(fun, p, samples, p, chunk_size=5),
            lambda p: user(p, samples, ct),
        ):
            jax.block_until_ready(call(params))
            before = compile_count()
            jax.block_until_ready(call(params2))
            assert compile_count() == before
    # and the counter is real: a new chunk size compiles again
    before = compile_count()
    with setup("netket") as place:
        jax.block_until_ready(vmcgrad.batched_vjp(fun, params, place(samples), place(ct), chunk_size=6))
    assert compile_count() > before


def test_partial_fun_arrays_are_traced_not_compiled_in():
    """A jax.tree_util.Partial's arrays (e.g. a model state) change without recompiling."""

    def scaled(scale, p, x=None, *, samples=None):
        x = samples if x is None else x
        return scale * jnp.tanh(x @ p["W"]).sum(-1)

    _, params, samples = make_case("r2r", 37 * N_DEV)
    ct = jnp.linspace(-1.0, 1.0, 37 * N_DEV)
    scales = [jnp.float64(0.5), jnp.float64(2.0)]
    ref = [jax.vjp(jax.tree_util.Partial(scaled, s, samples=samples), params)[1](ct)[0] for s in scales]
    with setup("netket") as place:
        x, c = place(samples), place(ct)
        got = [vmcgrad.batched_vjp(jax.tree_util.Partial(scaled, scales[0]), params, x, c, chunk_size=5)]
        before = compile_count()
        got.append(vmcgrad.batched_vjp(jax.tree_util.Partial(scaled, scales[1]), params, x, c, chunk_size=5))
        assert compile_count() == before
        out = vmcgrad.batched_jvp(jax.tree_util.Partial(scaled, scales[1]), params, x, params, chunk_size=5)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g["W"], r["W"], rtol=1e-12)
    expected = jax.jvp(lambda p: scaled(scales[1], p, samples), (params,), (params,))[1]
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def _docstring_control_characters(source: str) -> list[tuple[str, str]]:
    """(name, characters) for every docstring of ``source`` holding a control character — an
    escape like ``\\t`` or ``\\b`` (in ``\\tilde``, ``\\bar``) written in a non-raw string."""
    import ast

    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            chars = sorted({c for c in doc if ord(c) < 32 and c != "\n"})
            if chars:
                bad.append((getattr(node, "name", "<module>"), repr("".join(chars))))
    return bad


def test_no_docstring_holds_a_control_character():
    """A math docstring that is not raw turns ``\\tilde`` into a tab and ``\\bar`` into a backspace."""
    from pathlib import Path

    assert _docstring_control_characters('def f():\n    """:math:`\\bar O \\tilde\\theta`"""\n') == [
        ("f", repr("\b\t"))
    ]  # the detector fires on the bad program
    root = Path(vmcgrad.__file__).parent
    found = {
        str(p.relative_to(root)): bad
        for p in root.rglob("*.py")
        if (bad := _docstring_control_characters(p.read_text()))
    }
    assert not found, found
