"""Parameter-sharded (FSDP-like) models and the automatic chunk size."""

import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    DriftingDevice,
    assert_tree_allclose,
    auto_mesh,
    compile_count,
    compiled_names,
    make_case,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vmcgrad
from vmcgrad._chunks import budget as _auto_chunk
from vmcgrad._chunks.retry import run_with_oom_retry
from vmcgrad._sr.qgt import qgt as _qgt

N_DEV = jax.device_count()
N = 37 * N_DEV


def wide_case():
    """R→C model whose parameter leaves divide over the devices (4·H hidden units)."""
    fun, params, samples = make_case("r2c", N)
    params = {"W": jnp.tile(params["W"], (1, 4)) / 2, "phase": jnp.tile(params["phase"], (4, 1)) / 2}
    ct = (jnp.linspace(-1.0, 1.0, N) + 1j * jnp.cos(jnp.arange(N))).astype(jnp.complex128)
    return fun, params, samples, ct


def place_fsdp(mesh, params, samples, ct):
    s = NamedSharding(mesh, P("S"))
    sharded = {
        "W": jax.device_put(params["W"], NamedSharding(mesh, P(None, "S"))),
        "phase": jax.device_put(params["phase"], NamedSharding(mesh, P("S"))),
    }
    return sharded, jax.device_put(samples, s), jax.device_put(ct, s)


@pytest.mark.parametrize("api", ["batched_vjp", "expect_grad"])
def test_parameter_sharded_equals_replicated(api):
    fun, params, samples, ct = wide_case()
    mesh = auto_mesh()
    call = getattr(vmcgrad, api)
    with jax.set_mesh(mesh):
        p_sh, x, c = place_fsdp(mesh, params, samples, ct)
        expected = call(fun, params, x, c, chunk_size=5)
        got = call(fun, p_sh, x, c, chunk_size=5)
    assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-13)
    if api == "batched_vjp":
        ref = jax.vjp(lambda p: fun(p, samples), params)[1](ct)[0]
        assert_tree_allclose(got, ref, rtol=1e-11, atol=1e-12)
    # the gradient comes back sharded like the parameter (specs are moot on one device)
    assert N_DEV == 1 or (got["W"].sharding.spec == P(None, "S") and got["phase"].sharding.spec == P("S"))


@pytest.mark.skipif(N_DEV == 1, reason="collectives need more than one device")
def test_parameter_sharded_hlo_gathers_once_and_reduce_scatters_after_the_loop():
    fun, params, samples, ct = wide_case()
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        p_sh, x, c = place_fsdp(mesh, params, samples, ct)
        compiled = vmcgrad.lower(vmcgrad.batched_vjp, fun, p_sh, x, c, chunk_size=5).compile()
    report = vmcgrad.collective_report(compiled)
    assert report.total_in_loops == 0, report
    assert report.outside == {"all-gather": 2, "reduce-scatter": 2}, report


def split_vjp_case(mesh):
    """The r2c case of 512 samples per device, split over ``mesh``'s samples axis (parameters
    replicated), a cotangent of ones, and ``need(c)``: the compiled bytes of its ``batched_vjp`` at
    chunk ``c``. Call within ``jax.set_mesh(mesh)``."""
    fun, params, samples = make_case("r2c", 512 * N_DEV)
    x = jax.device_put(samples, NamedSharding(mesh, P("S")))
    ct = jax.device_put(jnp.ones(512 * N_DEV, jnp.complex128), NamedSharding(mesh, P("S")))
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def need(c):
        lowered = vmcgrad.lower(vmcgrad.batched_vjp, fun, params, x, ct, chunk_size=c)
        return vmcgrad.program_bytes(lowered.compile())

    return fun, params, x, ct, need


def test_auto_chunk_is_the_largest_power_of_two_that_fits():
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        fun, params, x, _, need = split_vjp_case(mesh)
        b64, b128 = need(64), need(128)
        assert b64 < b128  # temp memory grows with the chunk
        budget = (b64 + b128) // 2
        chosen = vmcgrad.auto_chunk_size(fun, params, x, memory_budget=budget)
        assert chosen == 64
        assert need(chosen) <= budget < need(2 * chosen)
        # cached: asking again compiles nothing
        before = compile_count()
        assert vmcgrad.auto_chunk_size(fun, params, x, memory_budget=budget) == 64
        assert compile_count() == before
        # everything fits a huge budget: one chunk of all local samples
        assert vmcgrad.auto_chunk_size(fun, params, x, memory_budget=2**40) == 512


def test_the_auto_call_runs_the_program_its_search_compiled():
    """Compile time (issue 47): an eager ``chunk_size="auto"`` call compiles only the candidates its
    search compiled (``Choice.compiled``, here several: the budget lies between chunks 64 and 128):
    the run reuses the chosen candidate's executable, and its result is the call's at that chunk."""
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        fun, params, x, ct, need = split_vjp_case(mesh)
        budget = (need(64) + need(128)) // 2
        with compiled_names() as names:
            got = jax.block_until_ready(
                vmcgrad.batched_vjp(fun, params, x, ct, chunk_size="auto", memory_budget=budget)
            )
        choice = vmcgrad.auto_chunk_size(fun, params, x, memory_budget=budget, info=True)
        assert choice.value == 64 and choice.compiled >= 2, choice
        assert names.count("jit(vjp_program)") == choice.compiled, (names, choice)
        want = vmcgrad.batched_vjp(fun, params, x, ct, chunk_size=64)
    assert_tree_allclose(got, want, rtol=0)


class _Analysis:
    """A stand-in for ``jax.stages.Compiled``: ``memory_analysis()`` from a bytes curve, and an empty
    program (no ops: every fitting chunk is priced the same, so the least modelled time is the
    largest, by the tie rule)."""

    def __init__(self, temp, fixed):
        self.temp, self.fixed = temp, fixed

    def as_text(self):
        return ""

    def memory_analysis(self):
        return types.SimpleNamespace(
            temp_size_in_bytes=self.temp, argument_size_in_bytes=self.fixed, output_size_in_bytes=0
        )


#: Temporaries per chunk c: measured curves (RBM, L=32, N=4096, complex128, one device: a VJP and a
#: QGT product; flat for small chunks, then linear), straight lines with and without a part that does
#: not grow with c, and curves no line fits (concave, convex, steps, a jump at the largest chunks).
_MEASURED = {
    "vjp": [35008, 36544, 40640, 46784, 59072, 83584, 134784, 235072, 435776, 837184, 1640000, 3245632],
    "qgt": [51888, 67760, 67760, 67760, 75376, 116592, 233840, 494896, 955696, 1877296, 3720496, 7472432],
}
_CURVES = {
    "measured vjp": lambda c: _MEASURED["vjp"][min(c.bit_length(), 12) - 1] * max(1, c >> 11),
    "measured qgt": lambda c: _MEASURED["qgt"][min(c.bit_length(), 12) - 1] * max(1, c >> 11),
    "proportional": lambda c: 800 * c,
    "line": lambda c: 50_000 + 800 * c,
    "concave": lambda c: int(30_000 * c**0.5),
    "convex": lambda c: 800 * c + c * c // 10,
    "steps": lambda c: 8_000 * (c // 16),
    "jump": lambda c: 800 * c * (2 if c >= 256 else 1),
}


def _search(curve, n, budget, fixed=1_000_000, **options):
    """choose_chunk on a bytes curve, with its keyword ``options`` (candidates, first, held): (the
    chunk or None, the chunks it compiled)."""
    compiled = []

    def compile_at(c):
        compiled.append(c)
        return _Analysis(curve(c), fixed)

    _auto_chunk._cache.clear()
    try:
        return _auto_chunk.choose_chunk(object(), n, compile_at, budget, where="test", **options), compiled
    except MemoryError:
        return None, compiled


def _bisection(curve, n, budget, fixed=1_000_000):
    """The reference: a plain bisection over the powers of two (the answer and its compilations)."""
    candidates = [2**k for k in range(n.bit_length())]
    lo, hi, count = 0, len(candidates) - 1, 0
    while lo <= hi:
        mid, count = (lo + hi) // 2, count + 1
        lo, hi = (mid + 1, hi) if fixed + curve(candidates[mid]) <= budget else (lo, mid - 1)
    return (candidates[hi] if hi >= 0 else None), count


def test_each_candidate_a_search_compiles_is_logged_with_its_bytes():
    """The ``"vmcgrad"`` logger's DEBUG records name each candidate a search compiled, in the order
    compiled, with its bytes per device and the budget: what ``benchmarks/step_regime.py`` records
    as ``first_probes`` (its ``searched()`` collects them here), the bytes a device's compiler gives
    each chunk. The logger's level is put back afterwards."""
    import logging

    import step_regime  # benchmarks/ is on sys.path (pyproject.toml's pythonpath)

    fixed, budget = 1_000_000, 1_000_000 + 800 * 40
    level = logging.getLogger("vmcgrad").level
    with step_regime.searched() as probes:
        chunk, compiled = _search(_CURVES["proportional"], 256, budget, fixed)
    assert chunk == 32 and len(compiled) >= 2, (chunk, compiled)
    assert probes == [["test", c, fixed + 800 * c, budget] for c in compiled], (probes, compiled)
    assert logging.getLogger("vmcgrad").level == level
    with step_regime.searched() as after:
        pass
    assert after == []  # (outside a search: nothing recorded)


def test_auto_chunk_search_finds_what_a_bisection_finds_in_fewer_compilations():
    """On every curve, sample count and budget (from below one sample's bytes to above all
    samples'): the same chunk as a bisection; one compilation where everything fits; at most three
    where the temporaries grow in proportion to the chunk (the line through the first compiled
    point is exact); never more than the three interpolated compilations plus a bisection of what
    is left; and in total at most three quarters of a bisection's compilations."""
    fixed, ours, theirs = 1_000_000, 0, 0
    for name, curve in _CURVES.items():
        for n in (1, 2, 3, 7, 32, 100, 512, 1000, 4096, 65_536, 100_000):
            k = n.bit_length()
            low, high = fixed + curve(1), fixed + curve(2 ** (k - 1))
            budgets = {low - 1, low, high - 1, high, *(low + (high - low) * i // 13 for i in range(1, 13))}
            for budget in sorted(budgets):
                got, compiled = _search(curve, n, budget)
                want, count = _bisection(curve, n, budget)
                case = (name, n, budget, compiled)
                assert got == want, case
                assert len(set(compiled)) == len(compiled), case  # no chunk compiled twice
                if budget >= high:
                    assert compiled == [2 ** (k - 1)], case
                if name == "proportional":
                    assert len(compiled) <= 3, case
                assert len(compiled) <= _auto_chunk.INTERPOLATED_PROBES + k.bit_length(), case
                ours += len(compiled)
                theirs += count + (want is None)  # a bisection compiles chunk 1 again for the error
    assert ours <= 0.75 * theirs, (ours, theirs)


def test_the_search_over_given_candidates_finds_the_largest_that_fits():
    """choose_chunk over candidates of its caller's (the dense kernel's chunks of ``ceil(n / m)``
    samples, m = 1 .. 7: vmcgrad._sr.ntk.dense.choose_dense): on every curve, sample count and
    budget, the largest candidate that fits (what a scan finds), none compiled twice, and where none
    fits a MemoryError that names the smallest candidate's bytes."""
    fixed = 1_000_000
    for name, curve in _CURVES.items():
        for n in (1, 7, 100, 1000, 65_536):
            candidates = sorted({-(-n // m) for m in range(1, 8)})
            low, high = fixed + curve(candidates[0]), fixed + curve(candidates[-1])
            for budget in {low - 1, low, high, *(low + (high - low) * i // 9 for i in range(1, 9))}:
                compiled = []

                def compile_at(c, compiled=compiled, curve=curve):
                    compiled.append(c)
                    return _Analysis(curve(c), fixed)

                _auto_chunk._cache.clear()
                fits = [c for c in candidates if fixed + curve(c) <= budget]
                case = (name, n, budget, compiled)
                if not fits:
                    with pytest.raises(MemoryError, match=f"even ({candidates[0]}|one) sample") as err:
                        _auto_chunk.choose_chunk(
                            object(), n, compile_at, budget, where="t", candidates=candidates
                        )
                    assert err.value.need == low, case
                    continue
                got = _auto_chunk.choose_chunk(
                    object(), n, compile_at, budget, where="t", candidates=candidates
                )
                assert got == fits[-1], case
                assert len(set(compiled)) == len(compiled) <= len(candidates), case


def test_a_predicted_first_probe_keeps_the_search_exact_and_ends_it_in_two():
    """choose_chunk's ``first`` (where the caller predicts the answer: the kept Jacobian's search with
    the components in turn predicts it from the search at once, ntk_dense._predicted_chunks): on
    every curve, sample count, budget and guess (every candidate, one below the smallest, one above
    the largest), the largest candidate that fits, none compiled twice; where the guess is the
    answer, two compilations (it and the next candidate), or one where it is the largest candidate.
    Red with ``first`` ignored (the largest candidate compiled first: more compilations) and with
    the guess taken unchecked."""
    fixed = 1_000_000
    for name, curve in _CURVES.items():
        for n in (7, 100, 1000):
            candidates = sorted({-(-n // m) for m in range(1, 16)})
            low, high = fixed + curve(candidates[0]), fixed + curve(candidates[-1])
            for budget in {low, high, *(low + (high - low) * i // 9 for i in range(1, 9))}:
                fits = [c for c in candidates if fixed + curve(c) <= budget]
                for first in (candidates[0] - 1, *candidates, candidates[-1] + 10):
                    got, compiled = _search(curve, n, budget, fixed, candidates=candidates, first=first)
                    case = (name, n, budget, first, compiled)
                    assert got == fits[-1], case
                    assert len(set(compiled)) == len(compiled) <= len(candidates), case
                    if first == fits[-1]:
                        assert len(compiled) == (1 if first == candidates[-1] else 2), case


def test_the_bytes_every_candidate_holds_start_the_line_and_keep_the_search_exact():
    """choose_chunk's ``held`` (bytes every candidate's program holds besides its arguments and
    outputs: the kept Jacobian's searches pass the Jacobian and the kernel): on every curve, sample
    count, budget and ``held`` (none, half the curve's intercept, all of it, twice it), the largest
    candidate that fits, none compiled twice; on the straight line with ``held`` its intercept, at
    most three compilations (the largest, the line's answer, the next one up), where with ``held``
    0 the chunks of 1 000 samples take more. Red with ``held`` ignored (the last count)."""
    fixed = 1_000_000
    counts = {}
    for name, curve in _CURVES.items():
        for n in (7, 100, 1000):
            candidates = sorted({-(-n // m) for m in range(1, n + 1)})
            low, high = fixed + curve(candidates[0]), fixed + curve(candidates[-1])
            for budget in {low, max(low, high - 1), *(low + (high - low) * i // 9 for i in range(1, 9))}:
                fits = [c for c in candidates if fixed + curve(c) <= budget]
                for held in (0, 25_000, 50_000, 100_000):
                    got, compiled = _search(curve, n, budget, fixed, candidates=candidates, held=held)
                    case = (name, n, budget, held, compiled)
                    assert got == fits[-1], case
                    assert len(set(compiled)) == len(compiled) <= len(candidates), case
                    if name == "line":
                        counts[n, budget, held] = len(compiled)
    assert all(c <= 3 for (_, _, held), c in counts.items() if held == 50_000), counts
    assert sum(c for (n, _, held), c in counts.items() if n == 1000 and held == 0) > sum(
        c for (n, _, held), c in counts.items() if n == 1000 and held == 50_000
    ), counts


def test_the_search_checks_fail_on_a_slow_or_a_wrong_search(monkeypatch):
    """The check above can fail: on a search that scans up from chunk 1 (exact, but compiling every
    chunk below the answer), and on one that answers half the largest fitting chunk."""
    check = test_auto_chunk_search_finds_what_a_bisection_finds_in_fewer_compilations
    with monkeypatch.context() as m:
        m.setattr(_auto_chunk, "_next_probe", lambda candidates, probed, lo, hi, budget: lo)
        with pytest.raises(AssertionError):
            check()
    exact = _auto_chunk.choose_chunk
    monkeypatch.setattr(_auto_chunk, "choose_chunk", lambda *a, **k: max(1, exact(*a, **k) // 2))
    with pytest.raises(AssertionError):
        check()


def test_auto_chunk_compiles_one_candidate_where_all_samples_fit(monkeypatch):
    """Real programs, a budget every chunk fits: one compiled candidate per estimator; for the QGT
    two, the mean pass's (its Ō, at its own automatic chunk) and the fused product's: the
    jvp-then-vjp design, slower at any chunk, is not compiled."""
    measured, sized = [], []
    real = _auto_chunk._measure
    monkeypatch.setattr(_auto_chunk, "_measure", lambda compiled: measured.append(1) or real(compiled))
    size = _qgt.auto_choice  # the designs design_choice sizes
    monkeypatch.setattr(_qgt, "auto_choice", lambda *a: sized.append(a[2].design) or size(*a))
    fun, params, samples = make_case("r2c", 64 * N_DEV)
    ct = jnp.ones(64 * N_DEV, jnp.complex128)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        ct = jax.device_put(ct, NamedSharding(mesh, P("S")))
        for estimator in ("batched_vjp", "batched_jvp", "expect_grad"):
            measured.clear()
            assert vmcgrad.auto_chunk_size(fun, params, x, estimator=estimator, memory_budget=2**40) == 64
            assert len(measured) == 1, estimator
        measured.clear()
        S = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=2**40)
        assert (S.design, S.chunk_size, len(measured), sized) == ("fused", 64, 2, ["fused"])
        # a budget that fits one sample per chunk of the fused design: the jvp-then-vjp design,
        # which holds less per sample, could be faster, and is sized too
        one = vmcgrad.QGT(fun, params, x, chunk_size=1)
        budget = _auto_chunk.program_bytes(jax.jit(lambda S, v: S @ v).lower(one, params).compile())
        sized.clear()
        tight = vmcgrad.QGT(fun, params, x, chunk_size="auto", memory_budget=budget)
        assert sized == ["fused", "jvp_vjp"], sized
        assert tight.design == "jvp_vjp" or tight.chunk_size == 1, tight


@pytest.mark.parametrize("api", ["batched_vjp", "batched_jvp", "expect_grad"])
def test_chunk_size_auto_gives_the_same_result(api):
    fun, params, samples = make_case("r2c", N)
    ct = (jnp.linspace(-1.0, 1.0, N) + 0.5j).astype(jnp.complex128)
    arg = params if api == "batched_jvp" else ct
    call = getattr(vmcgrad, api)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        a = arg if api == "batched_jvp" else jax.device_put(arg, NamedSharding(mesh, P("S")))
        expected = call(fun, params, x, a, chunk_size=None)
        got = call(fun, params, x, a, chunk_size="auto")
        before = compile_count()
        again = call(fun, params, x, a, chunk_size="auto")
        assert compile_count() == before
        under_jit = jax.jit(lambda p, x, a: call(fun, p, x, a, chunk_size="auto"))(params, x, a)
    for out in (got, again, under_jit):
        assert_tree_allclose(out, expected, rtol=1e-11, atol=1e-12)


def test_out_of_memory_halves_and_retries_once_with_a_warning():
    calls, remembered = [], []

    def run(c):
        calls.append(c)
        if c > 8:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return jnp.float64(c)

    with pytest.warns(
        RuntimeWarning, match=r"out of memory at chunk_size=16 .* retrying once with chunk_size=8"
    ):
        out = run_with_oom_retry(run, 16, remembered.append, "vmcgrad.batched_vjp")
    assert float(out) == 8 and calls == [16, 8] and remembered == [8]
    # only once: a second failure propagates
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(jax.errors.JaxRuntimeError):
            run_with_oom_retry(run, 64, remembered.append, "vmcgrad.batched_vjp")

    # other runtime errors are not retried
    def broken(c):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        run_with_oom_retry(broken, 16, remembered.append, "vmcgrad.batched_vjp")


def test_auto_chunk_size_errors():
    fun, params, samples = make_case("r2c", N)
    with pytest.raises(ValueError, match="`memory_budget` must be a positive number of bytes; got -1"):
        vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=-1)
    with pytest.raises(MemoryError, match="found no chunk that fits the memory budget of 10 bytes"):
        vmcgrad.auto_chunk_size(fun, params, samples, memory_budget=10)


def test_auto_chunk_default_budget():
    """Half the free memory where the backend reports it (GPU, TPU), read once per device and kept
    (a budget that followed the memory in use would miss every cached choice); else the documented
    2 GiB (this CPU)."""
    from vmcgrad._chunks.default_budget import DEFAULT_MEMORY_BUDGET, default_memory_budget

    device, other = DriftingDevice(), DriftingDevice(limit=2**31)
    first = default_memory_budget(device)
    assert first == (2**30 - 4096) // 2
    assert [default_memory_budget(device) for _ in range(3)] == [first] * 3 and device.reads == 1
    assert default_memory_budget(other) == (2**31 - 4096) // 2  # (each device its own)
    stats = jax.devices()[0].memory_stats()
    if not (stats and "bytes_limit" in stats):
        assert default_memory_budget() == DEFAULT_MEMORY_BUDGET == 2 * 2**30


def test_qgt_chunk_size_auto():
    fun, params, samples = make_case("r2c", N)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(samples, NamedSharding(mesh, P("S")))
        fixed = vmcgrad.QGT(fun, params, x, chunk_size=5, diag_shift=1e-3, diag_scale=1e-2)
        auto = vmcgrad.QGT(fun, params, x, chunk_size="auto", diag_shift=1e-3, diag_scale=1e-2)
        # the default budget (2 GiB on CPU) fits it all: the largest power of two <= 37 local samples
        assert auto.chunk_size == 32
        assert_tree_allclose(auto @ params, fixed @ params, rtol=1e-11, atol=1e-12)
