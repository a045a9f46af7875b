"""``vmcgrad.NTK`` and ``vmcgrad.minsr_update`` against NetKet's ``srt`` / ``srt_onthefly`` and jacrev.

References: the kernel against ΔJ ΔJ†/N from ``jax.jacrev``; the update against NetKet's own sample-space
SR functions (``netket._src.ngd``), the ones ``nk.driver.VMC_SR`` calls, at float64 and 1e-10.
N = 18 divides neither the 4 devices nor the chunk 5 (NetKet's dense ``srt`` takes it); NetKet's
``srt_onthefly`` needs a per-device divisor, so it is compared at N = 20 (5 per device, vmcgrad at chunk 3).

The default tier covers every mode (real, complex, holomorphic) for the kernel and the update, the
NetKet equality with SPRING momentum and ``proj_reg`` in one call each (a given ``old_updates``), dense
and CG; the ``slow`` tier adds the other model/mode pairs and the two-step momentum chains. Every
program here is tiny: the cost is compilation, so the default tier keeps the number of programs low.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NK_L as L
from helpers import NK_MODELS as MODELS
from helpers import assert_tree_allclose
from helpers import nk_data as _data
from helpers import nk_logpsi as _logpsi
from helpers import nk_params as _params
from jax.sharding import AxisType, Mesh

import vmcgrad

# The README command's 1-device pass runs this module's first instances (tests/conftest.py).
pytestmark = [pytest.mark.one_device_smoke, pytest.mark.usefixtures("netket_mesh")]

with jax.set_mesh(None):
    import netket as nk  # noqa: F401  (sets NetKet's sharding up before its ngd modules)
    from netket._src.ngd.sr_srt_common import srt
    from netket._src.ngd.srt_onthefly import srt_onthefly

DIAG = 1e-3


def solve(a, b):
    return jnp.linalg.solve(a, b)


def _dense_reference(apply, params, x, mode):
    """ΔJ ΔJ†/N from jax.jacrev, in the mode's representation."""
    n = x.shape[0]
    if mode == "holomorphic":
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        j = jax.jacrev(lambda f: apply({"params": unravel(f)}, x), holomorphic=True)(flat)
    else:
        re, unravel = jax.flatten_util.ravel_pytree(jax.tree.map(jnp.real, params))
        im, unravel_im = jax.flatten_util.ravel_pytree(jax.tree.map(jnp.imag, params))
        cplx = jnp.iscomplexobj(jax.tree.leaves(params)[0])

        def f(t):
            p = unravel(t[: re.size])
            if cplx:
                p = jax.tree.map(lambda a, b: a + 1j * b, p, unravel_im(t[re.size :]))
            out = apply({"params": p}, x)
            if mode == "complex":
                return jnp.stack([out.real, out.imag], -1).reshape(-1)
            return out.real

        j = jax.jacrev(f)(jnp.concatenate([re, im]) if cplx else re)
        if mode == "complex":
            j = j.reshape(n, 2, -1)
    dj = j - j.mean(0)
    dj = dj.reshape(-1, dj.shape[-1])
    return dj @ dj.conj().T / n


slow = pytest.mark.slow

#: (model, mode, chunk, transformations): the three modes in the default tier (one block, and a chunk
#: dividing neither N = 18 nor its 4 device shards); vmap/jit of ``T @ v`` checked once.
KERNELS = [
    ("real", "real", None, False),
    ("nonholo", "complex", 5, True),
    ("holo", "holomorphic", 5, False),
    pytest.param("r2c", "complex", 5, False, marks=slow),
    pytest.param("r2c", "real", 5, False, marks=slow),
    pytest.param("nonholo", "real", 40, False, marks=slow),
]


@pytest.mark.quick_cover("mode")
@pytest.mark.parametrize("model,mode,chunk,transforms", KERNELS)
def test_kernel_dense_and_matvec(model, mode, chunk, transforms):
    apply, cplx = MODELS[model]
    params = _params(cplx)
    x, _ = _data(18)
    T = vmcgrad.NTK(_logpsi(apply), params, x, chunk_size=chunk, mode=mode, diag_shift=DIAG)
    ref = _dense_reference(apply, params, x, mode) + DIAG * jnp.eye(T.dim)
    dense = T.to_dense()
    assert dense.shape == (T.dim, T.dim) and dense.dtype == ref.dtype
    np.testing.assert_allclose(dense, ref, rtol=0, atol=1e-12)
    v = jax.random.normal(jax.random.key(3), (T.dim,)).astype(T.dtype)
    np.testing.assert_allclose(T @ v, ref @ v, rtol=0, atol=1e-12)
    if transforms:  # vmap over right-hand sides, jit with the operator as an argument
        V = jax.random.normal(jax.random.key(4), (3, T.dim)).astype(T.dtype)
        np.testing.assert_allclose(jax.vmap(lambda v: T @ v)(V), V @ ref.T, rtol=0, atol=1e-12)
        np.testing.assert_allclose(jax.jit(lambda T, v: T @ v)(T, v), ref @ v, rtol=0, atol=1e-12)


def _netket(fn, apply, params, x, e, mode, **kw):
    return fn(apply, e, params, {}, x, diag_shift=DIAG, solver_fn=solve, mode=mode, **kw)


#: (model, mode, solver, steps): the first ``steps`` calls of a SPRING chain (momentum 0.8 and proj_reg
#: 0.5 from ``old_updates=None``; the second call, with the first's ``old_updates``, is a second program).
SRT_CASES = [
    ("real", "real", "dense", 2),
    ("nonholo", "complex", "dense", 1),
    ("r2c", "complex", "cg", 1),
    pytest.param("r2c", "complex", "dense", 2, marks=slow),
    pytest.param("r2c", "real", "dense", 2, marks=slow),
    pytest.param("nonholo", "complex", "dense", 2, marks=slow),
    pytest.param("holo", "complex", "dense", 2, marks=slow),
    pytest.param("holo", "complex", "cg", 2, marks=slow),
]


def _compare_steps(fn, model, mode, n, steps, ours, atol):
    """vmcgrad's update against NetKet's ``fn`` (``srt`` or ``srt_onthefly``) with momentum 0.8 and
    proj_reg 0.5, over the first ``steps`` calls of the chain (NetKet's ``old_updates`` is its flat vector,
    vmcgrad's a pytree like the parameters: each is fed back to its own)."""
    apply, cplx = MODELS[model]
    params = _params(cplx)
    kw = dict(proj_reg=0.5, momentum=0.8)
    old_nk = old = None
    for seed in (2, 7)[:steps]:
        x, e = _data(n, seed=seed)
        ref, old_nk, _ = _netket(fn, apply, params, x, e, mode, old_updates=old_nk, **kw)
        u, old, _ = vmcgrad.minsr_update(_logpsi(apply), params, x, e, old_updates=old, **ours, **kw)
        assert_tree_allclose(u, ref, rtol=0, atol=atol)
        assert_tree_allclose(old, u, rtol=0, atol=0)  # SPRING's buffer is the update


@pytest.mark.parametrize("model,mode,solver,steps", SRT_CASES)
def test_update_equals_netket_srt(model, mode, solver, steps):
    """N = 18 (no divisor of the devices or the chunk 5), momentum and proj_reg."""
    mine_solver = solve if solver == "dense" else "cg"
    ours = dict(diag_shift=DIAG, mode=mode, solver=mine_solver, chunk_size=5, tol=1e-14)
    # CG stops at a relative residual 1e-14; the error is at most cond(T + λ) ≤ (‖T‖ + λ)/λ ≈ 1e4 times it
    atol = 1e-10 if solver == "dense" else 1e-8
    _compare_steps(srt, model, mode, 18, steps, ours, atol)


@pytest.mark.parametrize(
    "model,mode,steps",
    [
        ("real", "real", 1),
        pytest.param("real", "real", 2, marks=slow),
        pytest.param("nonholo", "complex", 2, marks=slow),
        pytest.param("nonholo", "real", 2, marks=slow),
    ],
)
def test_update_equals_netket_srt_onthefly(model, mode, steps):
    """N = 20: 5 per device on 4 (NetKet's shard_map needs it); vmcgrad at chunk 3, a divisor of nothing."""
    ours = dict(diag_shift=DIAG, mode=mode, solver=solve, chunk_size=3)
    _compare_steps(srt_onthefly, model, mode, 20, steps, ours, 1e-10)


def test_holomorphic_mode_equals_complex_mode():
    """'holomorphic' (complex N×N kernel) gives NetKet's 'complex' update on a holomorphic model."""
    apply, _ = MODELS["holo"]
    params = _params(True)
    x, e = _data(18)
    ref, _, _ = _netket(srt, apply, params, x, e, "complex")
    u, _, _ = vmcgrad.minsr_update(
        _logpsi(apply), params, x, e, diag_shift=DIAG, mode="holomorphic", chunk_size=5
    )
    assert_tree_allclose(u, ref, rtol=0, atol=1e-10)


def test_dense_blocks_run_no_collective_in_a_loop():
    """The block loop (rows × columns of all samples, gathered once) holds no collective; the centring's
    means and the gather are outside every loop."""
    apply, _ = MODELS["r2c"]
    x, _ = _data(18)
    T = vmcgrad.NTK(_logpsi(apply), _params(False), x, chunk_size=5)
    report = vmcgrad.collective_report(jax.jit(lambda T: T.to_dense()).lower(T).compile())
    assert report.total_in_loops == 0, report
    if jax.device_count() > 1:
        assert report.total_outside > 0, report  # the kernel really is split over the devices


def _jacobians_derived(n, devices, chunk, batch=None):
    """Samples whose Jacobian ``to_dense`` derives: NetKet's mean-Jacobian subset, each row chunk's rows (in
    batches, the last shifted back onto the one before: a batch that does not divide the chunk derives
    the overlap twice), and,
    per row chunk, the column blocks (a sixteenth of the chunk wide on the CPU, or all N for one block)
    from the one holding its first counted row to the last, except the blocks that are the chunk's own
    rows, in order and short of the padding (reused); ``batch``: a Jacobian batch fixed by the chunk
    choice, the column blocks' width. The plan and the row weights follow vmcgrad._chunks.plan:
    balanced chunks, the last shifted back, padded and re-read rows not counted. Also returns the cost
    of walking every column block, a chunk wide, for every chunk (before)."""
    n_local = -(-n // devices)
    count = -(-n_local // (chunk or n_local))
    size = -(-n_local // count)
    cols = n if size >= n else (min(size, batch) if batch else max(1, size // 16))
    rb = min(size, batch) if batch else max(1, size // 16)  # the rows' batch; the last one shifted back
    rows = -(-size // rb) * rb  # (a batch that does not divide the chunk derives the overlap twice)
    blocks = -(-n // cols)
    new = old = min(n, 32, size)
    for d in range(devices):
        for k in range(count):
            start = min(k * size, n_local - size)
            g0 = d * n_local + start
            counted = [d * n_local + r for r in range(k * size, start + size) if d * n_local + r < n]
            own = lambda b, g0=g0: 0 <= b * cols - g0 <= size - cols and (b + 1) * cols <= n
            first = min(counted, default=n) // cols
            new += rows + cols * sum(not own(b) for b in range(first, blocks))
            old += size + size * -(-n // size)
    return new, old


@pytest.mark.parametrize("chunk", [4, None])
def test_dense_blocks_derive_each_pair_once(chunk):
    """The kernel is Hermitian: each row chunk derives only the column blocks on or above the diagonal
    (its own from its rows) and the rest is filled by symmetry. Counted at run time (the samples the
    model is evaluated on); N = 18 with chunk 4 has a shifted last chunk on 1 device, and padded rows,
    aligned and unaligned chunks on 4; the kernel and its gradient are checked against jax.jacrev."""
    apply, _ = MODELS["r2c"]
    seen = []

    def counted(v, x):
        jax.debug.callback(lambda x: seen.append(x.size // L), x)
        return apply(v, x)

    params = _params(False)
    x, _ = _data(18)
    T = vmcgrad.NTK(_logpsi(counted), params, x, chunk_size=chunk, mode="complex")
    dense = jax.block_until_ready(T.to_dense())
    new, old = _jacobians_derived(18, jax.device_count(), chunk)
    assert sum(seen) == new < old, (sum(seen), new, old)
    np.testing.assert_allclose(dense, _dense_reference(apply, params, x, "complex"), rtol=0, atol=1e-12)
    if chunk is not None:  # the skipped blocks keep the kernel reverse-differentiable (static loop bounds)
        g = lambda p, dense: jax.grad(lambda p: jnp.sum(jnp.sin(dense(p))))(p)
        ours = g(
            params, lambda p: vmcgrad.NTK(_logpsi(apply), p, x, chunk_size=chunk, mode="complex").to_dense()
        )
        assert_tree_allclose(
            ours, g(params, lambda p: _dense_reference(apply, p, x, "complex")), rtol=0, atol=1e-10
        )


def test_blocked_kernel_lowers_the_model_derivative_once(monkeypatch):
    """The blocked kernel's rows (a loop over the chunk's Jacobian batches, the last shifted back) and
    its column blocks call one jitted derivative at one shape (ntk_dense.batch_derivative), and the
    update's pullback pass runs at a chunk that tiles the rows (minsr.pullback_tiling: no stand-in
    search for re-read rows), so that the program holds the model's derivative once per form:
    counted as the model's one ``tanh`` per lowered evaluation in the StableHLO, ``to_dense`` holds 2
    (NetKet's mean-Jacobian estimate, a vjp, and the kernel's per-sample derivative) and the update 3
    (and the pullback). Red before (rows derived at the chunk, columns at the batch: 3 and 4; on one
    device the pullback at the shifted chunk 5 of 24 rows adds its stand-ins' forward pass: 5). Chunk
    5 at a batch of 2 (a split of 2) on one device: the rows' last batch overlaps the one before. The
    kernel against jax.jacrev, the update against the parameter-space route."""
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 2)
    apply, _ = MODELS["real"]  # one tanh per evaluation
    params = _params(False)
    x, e = _data(24)
    T = vmcgrad.NTK(_logpsi(apply), params, x, chunk_size=5, mode="real")
    dense = jax.jit(lambda T: T.to_dense())
    assert dense.lower(T).as_text().count("stablehlo.tanh") == 2
    np.testing.assert_allclose(dense(T), _dense_reference(apply, params, x, "real"), rtol=0, atol=1e-12)
    # (a budget below the Jacobian's bytes: one device blocks too, it does not keep the Jacobian)
    kw = dict(diag_shift=DIAG, chunk_size=5, mode="real", memory_budget=1024)
    update = jax.jit(
        lambda p, route: vmcgrad.minsr_update(_logpsi(apply), p, x, e, route=route, **kw)[0], static_argnums=1
    )
    assert update.lower(params, "dense").as_text().count("stablehlo.tanh") == 3
    assert_tree_allclose(update(params, "dense"), update(params, "parameter"), rtol=0, atol=1e-10)


@pytest.mark.heavy
def test_auto_chunk_takes_fewer_larger_chunks_at_the_batch_the_budget_bought(monkeypatch):
    """chunk_size="auto" on the dense kernel (ntk_dense.choose_dense): one block where every sample's
    rows are on the device and a batch fits; else the powers of two at the whole chunk fix the
    Jacobian batch b (b fits, 2b does not), and with b held the fewer, larger chunks are searched
    (the chosen one fits, the next larger does not). At the budget of a chunk of 32 at batch 1: within
    it, the Jacobians derived counted at run time equal the reference count of the chunk and the
    batch, the kernel equal to jax.jacrev's. 64 samples per device on any device count; the r2c model
    with 256 hidden units (P = 1 541), so that the rows' Jacobians, not the kernel, grow with the
    chunk. The search as an accelerator runs it (``JACOBIAN_SPLIT = 1``: a batch up to the chunk)."""
    import dataclasses

    from vmcgrad._sr.ntk import dense as ntk_dense
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)

    apply, _ = MODELS["r2c"]
    k = jax.random.split(jax.random.key(8), 3)
    params = {
        "w": 0.3 * jax.random.normal(k[0], (L, 256)),
        "b": 0.1 * jax.random.normal(k[1], (256,)),
        "a": 0.2 * jax.random.normal(k[2], (L,)),
    }
    devices = jax.device_count()
    n = 64 * devices
    x, _ = _data(n)
    seen = []

    def counted(v, x):
        jax.debug.callback(lambda x: seen.append(x.size // L), x)
        return apply(v, x)

    def program_bytes(op, chunk):
        lowered = ntk_dense.dense_program.lower(op.problem.at_chunk(chunk), op)
        return vmcgrad.program_bytes(lowered.compile())

    T = vmcgrad.NTK(_logpsi(counted), params, x, chunk_size=32, mode="complex")
    budget = program_bytes(dataclasses.replace(T, jacobian_batch=1), 32)
    auto = vmcgrad.NTK(_logpsi(counted), params, x, chunk_size="auto", mode="complex", memory_budget=budget)
    chunk, (op,) = ntk_dense.choose_dense(*auto._sizing_call())
    b = op.jacobian_batch
    assert auto.chunk_size == chunk and program_bytes(op, chunk) <= budget, (chunk, b)
    at = lambda batch, c: program_bytes(dataclasses.replace(T, jacobian_batch=batch), c)
    if chunk == n:  # one block: the largest batch that fits (the powers of two, then n)
        assert b == n or at(min(2 * b, n), n) > budget, (chunk, b)
    else:
        assert b == chunk or at(2 * b, 2 * b) > budget, (chunk, b)  # the powers at the whole chunk
        fewer = sorted({-(-64 // m) for m in range(1, 64 // b + 1)})
        i = fewer.index(chunk)
        assert i == len(fewer) - 1 or program_bytes(op, fewer[i + 1]) > budget, (chunk, b)
    seen.clear()
    dense = jax.block_until_ready(auto.to_dense())
    derived, _ = _jacobians_derived(n, devices, chunk, batch=b)
    assert sum(seen) == derived, (sum(seen), derived, chunk, b)
    np.testing.assert_allclose(dense, _dense_reference(apply, params, x, "complex"), rtol=0, atol=1e-12)


def test_auto_chunk_takes_one_block_at_a_smaller_jacobian_batch(monkeypatch):
    """On one device, where the powers of two and the fewer chunks leave several chunks, chunk_size=
    "auto" tries one block at the Jacobian batches below theirs (ntk_dense.choose_dense). The update
    of a model with many intermediates per sample (5 × 16 × 64) and P = 4 240 fits a budget between
    its one-block bytes at batch 1 and at 2 in one block at batch 1 only; the powers of two stop at 32
    (batch 2). Chosen: one block at batch 1, which keeps its Jacobian: the model evaluated on exactly
    N samples (counted at run time; the chunks would derive more), the update equal to the one of
    chunk_size=None. Red with the one-block step off: (32, 2)."""
    import dataclasses

    from vmcgrad._sr.ntk import dense as ntk_dense
    from vmcgrad._sr.ntk import routes

    def apply(v, x):
        h = jnp.tanh(x[:, :, None, None] * v["params"]["w"][None, :, :, None] + v["params"]["u"])
        return jnp.mean(h, axis=(1, 2, 3)) + 1e-3 * jnp.sum(v["params"]["c"])

    k = jax.random.split(jax.random.key(4), 2)
    params = {"w": 0.3 * jax.random.normal(k[0], (L, 16)), "u": 0.1 * jax.random.normal(k[1], (64,))}
    params["c"] = jnp.ones(4096)  # P grows, the intermediates do not
    n = 64
    params, (x, e) = jax.device_put((params, _data(n)), jax.devices()[0])
    seen, choices = [], []

    def counted(v, x):
        jax.debug.callback(lambda x: seen.append(x.size // L), x)
        return apply(v, x)

    def choose(program, prob, op, *args):
        choices.append(ntk_dense.choose_dense(program, prob, op, *args))
        return choices[-1]

    def program_bytes(program, prob, op, *args, batch):
        lowered = program.lower(prob.at_chunk(n), dataclasses.replace(op, jacobian_batch=batch), *args)
        return vmcgrad.program_bytes(lowered.compile())

    monkeypatch.setattr(routes, "choose_dense", lambda *a: choices.append(a) or ntk_dense.choose_dense(*a))
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, route="dense", solver=solve)
        whole, _, _ = vmcgrad.minsr_update(_logpsi(counted), params, x, e.real, chunk_size=None, **kw)
        vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=2**40, **kw)
        sizing = choices[-1]  # (program, problem, operator, *arguments)
        at_1, at_2 = program_bytes(*sizing, batch=1), program_bytes(*sizing, batch=2)
        assert at_2 > at_1
        budget = (at_1 + at_2) // 2  # one block fits at batch 1, not at 2 (nor at the powers' 4)
        monkeypatch.setattr(routes, "choose_dense", choose)
        seen.clear()
        ours, _, _ = vmcgrad.minsr_update(
            _logpsi(counted), params, x, e.real, chunk_size="auto", memory_budget=budget, **kw
        )
    chunk, (op, *_) = choices[-1]
    assert (chunk, op.jacobian_batch) == (n, 1), (chunk, op.jacobian_batch)
    assert sum(seen) == n, sum(seen)
    assert_tree_allclose(ours, whole, rtol=0, atol=1e-12)


def _spy_dense(monkeypatch):
    """``routes.choose_dense`` watched: ``spy.calls`` its arguments ``(program, problem, operator,
    *args)`` and ``spy.chosen`` its ``(chunk, (operator, *args))``, call by call."""
    import types

    from vmcgrad._sr.ntk import dense as ntk_dense
    from vmcgrad._sr.ntk import routes

    spy = types.SimpleNamespace(calls=[], chosen=[])

    def choose(*args):
        spy.calls.append(args)
        spy.chosen.append(ntk_dense.choose_dense(*args))
        return spy.chosen[-1]

    monkeypatch.setattr(routes, "choose_dense", choose)
    return spy


def _dense_bytes(sizing, chunk, **op_fields):
    """Compiled bytes of a sizing call's program (``_spy_dense``'s ``calls``) at ``chunk``, with the
    operator's ``op_fields`` replaced."""
    import dataclasses

    program, prob, op, *args = sizing
    op = dataclasses.replace(op, **op_fields)
    return vmcgrad.program_bytes(program.lower(prob.at_chunk(chunk), op, *args).compile())


def _kept_jacobian_case(n):
    """``(apply, params, x, e)`` of the kept-Jacobian chunk tests: a NetKet-style model whose
    per-sample derivative intermediates (L × 16 × 64 values) outweigh its Jacobian row
    (P = 16 L + 576), and n samples with their local energies, on the first device."""

    def apply(v, x):
        h = jnp.tanh(x[:, :, None, None] * v["params"]["w"][None, :, :, None] + v["params"]["u"])
        return jnp.mean(h, axis=(1, 2, 3)) + 1e-3 * jnp.sum(v["params"]["c"])

    k = jax.random.split(jax.random.key(4), 2)
    params = {"w": 0.3 * jax.random.normal(k[0], (L, 16)), "u": 0.1 * jax.random.normal(k[1], (64,))}
    params["c"] = jnp.ones(512)
    params, (x, e) = jax.device_put((params, _data(n)), jax.devices()[0])
    return apply, params, x, e


def test_auto_chunk_keeps_the_jacobian_over_fewer_trips_on_an_accelerator(monkeypatch):
    """On an accelerator (the chunk's Jacobians at once) each trip of the model's derivative costs
    its ops whatever its size, so where one block fits at a batch b but not at 2b, the update's
    chunk_size="auto" also tries the chunks ceil(N/m) between b and 2b with the Jacobian kept
    (ntk_dense.choose_dense, KEPT_JACOBIAN_PROGRAMS): N = 64 and a budget halfway between one
    block's bytes at batch 8 and at 16 take a chunk c in (8, 16), ceil(64/c) trips instead of 8,
    that fits the budget; the model evaluated once on each of the chunks' rows (counted at run time:
    N and the rows the shifted last chunk reads again), the update equal to chunk_size=None's.
    Red with the step off: one block at batch 8."""
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)

    n = 64
    apply, params, x, e = _kept_jacobian_case(n)
    seen = []

    def counted(v, x):
        jax.debug.callback(lambda x: seen.append(x.size // L), x)
        return apply(v, x)

    spy = _spy_dense(monkeypatch)
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, route="dense", solver=solve)
        whole, _, _ = vmcgrad.minsr_update(_logpsi(counted), params, x, e.real, chunk_size=None, **kw)
        vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=2**40, **kw)
        sizing = spy.calls[-1]
        at_8, at_16 = _dense_bytes(sizing, n, jacobian_batch=8), _dense_bytes(sizing, n, jacobian_batch=16)
        assert at_16 > at_8
        budget = (at_8 + at_16) // 2
        seen.clear()
        ours, _, _ = vmcgrad.minsr_update(
            _logpsi(counted), params, x, e.real, chunk_size="auto", memory_budget=budget, **kw
        )
        chunk, (op, *rest) = spy.chosen[-1]
        program, prob = sizing[:2]
        held = vmcgrad.program_bytes(program.lower(prob.at_chunk(chunk), op, *rest).compile())
    assert 8 < chunk < 16 and op.jacobian_batch is None and op.keep_jacobian, (chunk, op)
    assert held <= budget, (held, budget)
    trips = -(-n // chunk)
    assert sum(seen) == trips * chunk, (sum(seen), trips, chunk)
    assert_tree_allclose(ours, whole, rtol=0, atol=1e-12)


def test_auto_chunk_kept_jacobian_takes_every_trip_count(monkeypatch):
    """The kept Jacobian's chunk under chunk_size="auto" on an accelerator is the largest that fits
    among every trip count between N/2b and N/b (ntk_dense.choose_dense), not only a few of them: each
    trip fewer is one trip of the model's derivative saved, and a sample's derivative intermediates
    set how many a trip holds. N = 128, one block fitting at batch b = 8 and not at 16, and a budget
    of exactly the kept chunk of 15's bytes (9 trips): the chunk taken is 15, and the update equal
    to chunk_size=None's. Red with the candidates of about 1.25, 1.5 and 1.75 b (10, 12, 13: 13)."""
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)

    n = 128
    apply, params, x, e = _kept_jacobian_case(n)
    spy = _spy_dense(monkeypatch)
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, route="dense", solver=solve)
        whole, _, _ = vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size=None, **kw)
        vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=2**40, **kw)
        sizing = spy.calls[-1]
        budget = _dense_bytes(sizing, 15, jacobian_batch=None, keep_jacobian=True)
        assert _dense_bytes(sizing, n, jacobian_batch=8, keep_jacobian=True) <= budget  # one block at b = 8
        assert _dense_bytes(sizing, n, jacobian_batch=16, keep_jacobian=True) > budget  # not at 16
        assert _dense_bytes(sizing, 16, jacobian_batch=None, keep_jacobian=True) > budget  # nor 8 trips
        ours, _, _ = vmcgrad.minsr_update(
            _logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=budget, **kw
        )
    chunk, (op, *_) = spy.chosen[-1]
    assert (chunk, op.jacobian_batch, op.keep_jacobian) == (15, None, True), (chunk, op)
    assert_tree_allclose(ours, whole, rtol=0, atol=1e-12)


def test_auto_chunk_kept_jacobian_search_lines_start_at_the_bytes_every_chunk_holds(monkeypatch):
    """The kept Jacobian's chunk search on an accelerator (ntk_dense._kept_choice) compiles one block
    first (N = 128: over the budget), then the chunk where the line from the bytes every chunk holds
    (the Jacobian and the kernel: its ``held``) through one block's crosses the budget, and, once the
    line puts the answer at a chunk known to fit, the next one up, whose compilation over the budget
    ends the search: a budget of exactly the kept chunk of 12's bytes (11 trips) takes 12 in four
    compilations, one block's among them (where one block's Jacobian batches were searched first,
    then the kept chunks: five). Red with ``held`` 0 (six: the line from the arguments and outputs
    alone lands far) and with the search bisecting after three probes (six)."""
    from vmcgrad._problem import problem as problem_module
    from vmcgrad._sr.ntk import dense as ntk_dense
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)
    n = 128
    apply, params, x, e = _kept_jacobian_case(n)
    spy = _spy_dense(monkeypatch)
    searches = []

    def knob(*args, name, **kw):
        found = problem_module.auto_knob(*args, name=name, **kw)
        searches.append((name, found))
        return found

    monkeypatch.setattr(ntk_dense, "auto_knob", knob)
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, route="dense", solver=solve)
        vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=2**40, **kw)
        sizing = spy.calls[-1]
        budget = _dense_bytes(sizing, 12, jacobian_batch=None, keep_jacobian=True)
        assert _dense_bytes(sizing, 13, jacobian_batch=None, keep_jacobian=True) > budget
        searches.clear()
        vmcgrad.minsr_update(_logpsi(apply), params, x, e.real, chunk_size="auto", memory_budget=budget, **kw)
    ((name, kept),) = searches
    probes = [c for c, _ in kept.probes]
    assert name == "the kept Jacobian's chunk" and kept.value == 12, (name, kept)
    assert probes[0] == n and 13 in probes and len(probes) <= 4 and kept.compiled == len(probes), probes


def _small_gcnn(n):
    """NetKet's GCNN on the 8-site chain (16 symmetries, 2 layers of 4 features, P = 296, float64),
    its parameters and n samples with complex local energies: a model whose kernel is expanded over
    the group and FFT'd in its forward pass, so that a sample's reverse pass holds several times its
    Jacobian row (as the race's GCNN does)."""
    import netket as nk

    model = nk.models.GCNN(symmetries=nk.graph.Chain(8), layers=2, features=(4, 4), param_dtype=jnp.float64)
    k = jax.random.split(jax.random.key(5), 4)
    x = jnp.where(jax.random.bernoulli(k[0], 0.5, (n, 8)), 1.0, -1.0)
    e = jax.random.normal(k[1], (n,)) + 1j * jax.random.normal(k[2], (n,))
    params = model.init(k[3], x[:2])["params"]
    return (lambda w, x: model.apply({"params": w}, x)), params, x, e


def test_jacobian_components_in_turn_halve_a_samples_bytes():
    """A per-sample Jacobian's K components' pullbacks in turn (vmcgrad._sr.jacobian.jacobian's
    in_turn; the kept Jacobian's rows under NTKOperator.components_in_turn) hold one component's
    reverse-pass intermediates at a time: on the small GCNN in 'complex' mode (K = 2) the compiled
    temporaries per sample (the slope between 4 and 8 samples derived at once) are at most 0.7 of
    those with the components at once (measured 0.62; the forward pass's residuals are shared, so
    not 1/2), its ops fewer than twice (one forward pass, two reverse passes), and the rows equal
    jacrev's to rounding. Red with the ordering dependence (_after) taken out: XLA runs the two
    reverse passes side by side, 0.84 of the bytes."""
    import vmcgrad._sr.jacobian as jac
    from vmcgrad._sr.ntk.modes import rows_fun, theta_of

    apply, params, x, _ = _small_gcnn(8)
    f = rows_fun(apply, "complex", params)
    theta = theta_of("complex", params)

    def compiled(b, in_turn):
        program = jax.jit(lambda t, x: jac.flat_jacobian(f, t, x, "complex", None, in_turn=in_turn))
        return program.lower(theta, x[:b]).compile()

    def per_sample(in_turn):
        small, large = (compiled(b, in_turn).memory_analysis().temp_size_in_bytes for b in (4, 8))
        return (large - small) / 4

    at_once, in_turn = per_sample(False), per_sample(True)
    assert in_turn <= 0.7 * at_once, (in_turn, at_once)
    ops = [vmcgrad.program_cost(compiled(8, t), "tpu").ops for t in (False, True)]
    assert ops[1] < 2 * ops[0], ops
    rows, ref = (jac.flat_jacobian(f, theta, x, "complex", 4, in_turn=t) for t in (True, False))
    scale = float(jnp.max(jnp.abs(ref)))
    assert_tree_allclose(rows, ref, rtol=0, atol=64 * np.finfo(np.float64).eps * scale)


@pytest.mark.heavy
def test_auto_chunk_takes_the_components_in_turn_where_faster(monkeypatch):
    """Under a budget that binds (one block of the small GCNN's N = 64 fits at batch 4, not at 8),
    chunk_size="auto" on an accelerator searches the kept Jacobian's chunks with the K = 2 components
    in turn too (ntk_dense.choose_dense) and takes the faster by modelled time: the chosen program
    within the budget, the Jacobian kept, the update equal to chunk_size=None's. Under XLA's own
    compiler (VMCGRAD_TEST_XLA=default, .ci/run; users' programs) the components in turn are the
    faster here (42 -> 68 ops a trip for 0.62 of the bytes a sample) and taken: a chunk above 8.
    Under the suite's fast compile flags nothing is fused (330 -> 644 ops a trip) and the
    components at once are the faster. Red (default compiler) with the search in turn off."""
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 1)
    n = 64
    apply, params, x, e = _small_gcnn(n)
    params, x, e = jax.device_put((params, x, e), jax.devices()[0])
    spy = _spy_dense(monkeypatch)
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, route="dense", mode="complex", solver=solve)
        whole, _, _ = vmcgrad.minsr_update(apply, params, x, e, chunk_size=None, **kw)
        vmcgrad.minsr_update(apply, params, x, e, chunk_size="auto", memory_budget=2**40, **kw)
        sizing = spy.calls[-1]
        at_4, at_8 = _dense_bytes(sizing, n, jacobian_batch=4), _dense_bytes(sizing, n, jacobian_batch=8)
        assert at_8 > at_4
        budget = (at_4 + at_8) // 2
        ours, _, _ = vmcgrad.minsr_update(apply, params, x, e, chunk_size="auto", memory_budget=budget, **kw)
        chunk, (op, *rest) = spy.chosen[-1]
        program, prob = sizing[:2]
        held = vmcgrad.program_bytes(program.lower(prob.at_chunk(chunk), op, *rest).compile())
    assert op.keep_jacobian and op.jacobian_batch is None and held <= budget, (op, held, budget)
    if os.environ.get("VMCGRAD_TEST_XLA") == "default":
        assert op.components_in_turn and chunk > 8, (chunk, op)
    assert_tree_allclose(ours, whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "model,mode,chunk",
    [
        ("real", "real", None),
        ("r2c", "complex", None),
        ("nonholo", "complex", None),
        ("holo", "holomorphic", None),
        ("r2c", "complex", 5),
        pytest.param("holo", "holomorphic", 5, marks=slow),
    ],
)
def test_one_device_keeps_its_jacobian(model, mode, chunk):
    """Where one device holds every sample (chunk_size None: one chunk; or a chunk given and the
    N×P Jacobian within the budget), the dense route keeps the Jacobian it derives
    (minsr._whole_jacobian), as NetKet's srt: the model is evaluated on exactly the rows of the
    chunks, counted at run time (N; 4 chunks of 5 for N = 18, the last shifted back over two rows
    read again: 20), each once (the blocked route adds column blocks, NetKet's mean-Jacobian
    estimate on min(N, 32) samples and a pullback pass over all N: red with the route off), and two
    calls of a SPRING chain (momentum, proj_reg) equal NetKet's srt (the blocked route's in
    holomorphic mode, which srt lacks)."""
    apply, cplx = MODELS[model]
    params, (x, e) = jax.device_put((_params(cplx), _data(18)), jax.devices()[0])
    n = 18
    seen = []

    def counted(v, x):
        jax.debug.callback(lambda x: seen.append(x.size // L), x)
        return apply(v, x)

    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        ours = dict(diag_shift=DIAG, mode=mode, solver=solve, chunk_size=chunk, route="dense")
        jax.block_until_ready(vmcgrad.minsr_update(_logpsi(counted), params, x, e, **ours))
        rows = n if chunk is None else -(-n // chunk) * chunk
        assert sum(seen) == rows, (sum(seen), rows)
        if mode != "holomorphic":
            _compare_steps(srt, model, mode, n, 2, ours, 1e-10)
            return
        # NetKet's srt has no holomorphic mode: against the blocked route (chunk 5, a budget below
        # the Jacobian's bytes), itself equal to NetKet's in 'complex' mode and to 'complex' for this
        # model (tests above)
        kw, old, old_blocked = dict(proj_reg=0.5, momentum=0.8), None, None
        for seed in (2, 7):
            x, e = _data(n, seed=seed)
            u, old, _ = vmcgrad.minsr_update(_logpsi(apply), params, x, e, old_updates=old, **ours, **kw)
            blocked = dict(ours, chunk_size=5, memory_budget=1024)
            ref, old_blocked, _ = vmcgrad.minsr_update(
                _logpsi(apply), params, x, e, old_updates=old_blocked, **blocked, **kw
            )
            assert_tree_allclose(u, ref, rtol=0, atol=1e-10)


def test_one_block_holds_one_copy_of_the_jacobian(monkeypatch):
    """The kept Jacobian (one chunk of every sample, one device) is held once: its rows are derived at
    the flat θ (no concatenation of the leaves' rows), the runner returns a single chunk's rows as
    they are, and ΔJ is centred in J's own buffer (minsr._centred_in_place), in a few blocks.
    A wide model whose intermediates are small next to J (P = 49 152, N = 64: J = 24 MiB), its
    Jacobians derived 4 at a time (a batch of all 64 holds its own rows' leaves, a second J, before
    they are joined: the budget search sees that): the compiled update holds J and less than half as
    much again. Red with any of the three copies back (the leaves' rows concatenated, the rows copied
    into the runner's buffer, or ``j - mean(j)`` as one expression): 2.03 J each."""
    from vmcgrad._sr.ntk import modes as ntk_modes

    monkeypatch.setattr(ntk_modes, "JACOBIAN_SPLIT", 16)
    n, width = 64, 4096
    w = 0.01 * jax.random.normal(jax.random.key(3), (L, width))
    params = {"w": w, "c": jnp.ones((width, 7))}  # "c": P grows, the intermediates do not
    params, (x, e) = jax.device_put((params, _data(n)), jax.devices()[0])
    logpsi = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]), -1) + jnp.sum(p["c"]) * 1e-3
    one = Mesh(np.array(jax.devices()[:1]), ("S",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(one):
        kw = dict(diag_shift=DIAG, chunk_size=None, route="dense")
        update = jax.jit(lambda p, x, e: vmcgrad.minsr_update(logpsi, p, x, e, **kw)[0])
        held = vmcgrad.program_bytes(update.lower(params, x, e.real).compile())
    jac = n * sum(v.size for v in jax.tree.leaves(params)) * 8
    assert jac <= held < 1.5 * jac, (held / jac, jac)


def test_jit_of_update_and_grad_refused():
    apply, _ = MODELS["real"]
    params = _params(False)
    x, e = _data(18)
    e = e.real
    f = lambda p, e: vmcgrad.minsr_update(_logpsi(apply), p, x, e, diag_shift=DIAG, chunk_size=5)[0]
    assert_tree_allclose(jax.jit(f)(params, e), f(params, e), rtol=0, atol=1e-12)
    loss = lambda p: jnp.sum(f(p, e)["a"])
    with pytest.raises(TypeError, match=r"vmcgrad\.QGT"):
        jax.grad(loss)(params)


def test_solve_dense_cg_and_vmap():
    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, _ = _data(18)
    T = vmcgrad.NTK(_logpsi(apply), params, x, chunk_size=5, diag_shift=1e-2)
    A = T.to_dense()
    B = jax.random.normal(jax.random.key(5), (2, T.dim))
    xs = jax.vmap(lambda b: T.solve(b)[0])(B)  # the dense solve, vmapped over right-hand sides
    np.testing.assert_allclose(xs, jnp.linalg.solve(A, B.T).T, rtol=0, atol=1e-10)
    np.testing.assert_allclose(A @ xs[0], B[0], rtol=0, atol=1e-10)
    xc, info = T.solve(B[0], solver="cg", tol=1e-13)
    assert bool(info.converged)
    np.testing.assert_allclose(xc, xs[0], rtol=0, atol=1e-9)


def test_cg_solve_traces_the_product_once():
    """CG calls T v in its loop, for the residual of x0 and in its final residual check: the solve
    traces the model as often as one product does (the product is a function of its own, traced
    once per shapes). Counted at trace time, on a model no other test has traced."""
    apply, _ = MODELS["r2c"]
    traced = []

    def counted(v, x):
        traced.append(x.shape)
        return apply(v, x)

    x, _ = _data(18)
    T = vmcgrad.NTK(_logpsi(counted), _params(False), x, chunk_size=5, diag_shift=1e-2)
    b = jax.random.normal(jax.random.key(6), (T.dim,))
    del traced[:]
    jax.block_until_ready(T @ b)
    product = len(traced)
    del traced[:]
    xc, info = T.solve(b, solver="cg", x0=b, tol=1e-12)
    assert product > 0 and len(traced) == product, (len(traced), product)
    assert bool(info.converged)
    np.testing.assert_allclose(T @ xc, b, rtol=0, atol=1e-9)


def test_bad_input_before_tracing():
    apply, _ = MODELS["real"]
    params = _params(False)
    x, e = _data(18)
    lp = _logpsi(apply)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        vmcgrad.NTK(lp, params, x, mode="jacobian")
    with pytest.raises(ValueError, match="holomorphic"):
        vmcgrad.NTK(lp, params, x, mode="holomorphic")
    with pytest.raises(ValueError, match="diag_shift"):
        vmcgrad.NTK(lp, params, x, diag_shift=-1.0)
    T = vmcgrad.NTK(lp, params, x)
    with pytest.raises(ValueError, match=r"shape \(18,\)"):
        T @ jnp.ones(17)
    with pytest.raises(TypeError, match="real floating"):
        T @ jnp.ones(18, complex)
    with pytest.raises(TypeError, match="`solver`"):
        T.solve(jnp.ones(18), solver="lu")
    with pytest.raises(ValueError, match="local_values"):
        vmcgrad.minsr_update(lp, params, x, e[:10], diag_shift=DIAG)
    with pytest.raises(TypeError, match="diag_shift"):
        vmcgrad.minsr_update(lp, params, x, e, diag_shift="big")
    with pytest.raises((TypeError, ValueError), match=r"old_updates|tangent"):
        vmcgrad.minsr_update(lp, params, x, e, diag_shift=DIAG, momentum=0.5, old_updates={"a": jnp.ones(L)})


def test_samples_split_on_an_explicit_mesh():
    """Samples split on an Explicit-axis mesh (the split is in their type): the kernel, its product and
    the update equal the unsplit ones. The mean-Jacobian subset and the padded copy of all samples
    slice the split axis, and the symmetric fill selects between differently typed halves: before
    these were replicated and resharded, to_dense raised JAX's ShardingTypeError."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    apply, _ = MODELS["r2c"]
    params = _params(False)
    x, e = _data(4 * jax.device_count())
    x, e = np.asarray(x), np.asarray(e)  # not on the fixture's Auto-axis mesh
    T = vmcgrad.NTK(_logpsi(apply), params, x, chunk_size=3, mode="complex", diag_shift=DIAG)
    v = np.cos(np.arange(T.dim) + 0.5)
    cg = dict(diag_shift=DIAG, route="cg", tol=1e-12)
    ref = (
        T.to_dense(),
        T @ v,
        vmcgrad.minsr_update(_logpsi(apply), params, x, e, diag_shift=DIAG)[0],
        vmcgrad.minsr_update(_logpsi(apply), params, x, e, **cg)[0],
    )
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("S")))
        Ts = vmcgrad.NTK(_logpsi(apply), params, xs, chunk_size=3, mode="complex", diag_shift=DIAG)
        got = (
            Ts.to_dense(),
            Ts @ v,
            vmcgrad.minsr_update(_logpsi(apply), params, xs, e, diag_shift=DIAG)[0],
            # CG's carry keeps one type: the kernel's product comes back split, dv replicated
            vmcgrad.minsr_update(_logpsi(apply), params, xs, e, **cg)[0],
        )
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(got[1], ref[1], rtol=0, atol=1e-12)
    assert_tree_allclose(got[2], ref[2], rtol=0, atol=1e-12)
    assert_tree_allclose(got[3], ref[3], rtol=0, atol=1e-12)
