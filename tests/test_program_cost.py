"""``vmcgrad.program_cost``: ops in sequence, FLOPs and bytes weighted by trip counts, on hand-built
programs whose counts are known from their structure.

XLA's fusion decisions differ between the suite's fast compile flags and its defaults
(``VMCGRAD_TEST_XLA=default``), so the assertions rest on structure, not on one compile's count: a
loop of k trips costs ``a + k * b`` ops with ``b`` its ``ops_per_trip`` (exactly affine in k), a
nested loop ``a + k1 * (c + k2 * d)``, a conditional the mean of its branches, and FLOPs of a dot
from its shapes.
"""

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vmcgrad
from vmcgrad._hlo.cost import PLATFORMS, Platform, expected_trips

F32 = jnp.float32
DATA = Path(__file__).resolve().parent / "data"


def cost(fun, *args, platform=None):
    return vmcgrad.program_cost(jax.jit(fun).lower(*args).compile(), platform=platform)


def body(y):
    """A small body XLA cannot fold away: a matmul and a transcendental."""
    return jnp.tanh(y @ y) * 0.5


def fori(k):
    return lambda x: lax.fori_loop(0, k, lambda i, y: body(y), x)


X = jnp.ones((8, 8), F32)


@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_a_loop_of_k_trips_costs_its_trip_count_times_its_body(loop):
    def program(k):
        if loop == "fori_loop":
            return fori(k)
        return lambda x: lax.scan(lambda y, _: (body(y), None), x, None, length=k)[0]

    counts = {k: cost(program(k), X) for k in (4, 8, 16)}
    for k, c in counts.items():
        assert c.unknown_trip_loops == () and len(c.loops) == 1, c
        (lp,) = c.loops
        assert lp.trip_count == k and lp.loops == (), lp
        # the body's op(s) and the condition's compare at least, the same body whatever k
        assert lp.ops_per_trip >= 2 and lp.ops_per_trip == counts[4].loops[0].ops_per_trip
    b = counts[4].loops[0].ops_per_trip
    # exactly affine in k, with the body's ops as slope: a loop's ops are counted once per trip
    assert counts[8].ops - counts[4].ops == 4 * b
    assert counts[16].ops - counts[8].ops == 8 * b
    assert counts[4].ops >= 4 * b
    # a dot of 8 x 8 by 8 x 8: 2 * 8**3 FLOPs per trip, and the body's elementwise ops at most
    # 4 * 64 more (tanh, multiply, the counter's add and compare are fewer)
    for k, c in counts.items():
        assert k * 2 * 8**3 <= c.flops <= k * (2 * 8**3 + 4 * 64) + 4 * 64, (k, c.flops)


def test_a_nested_loop_costs_the_product_of_its_trip_counts():
    def program(k1, k2):
        return lambda x: lax.fori_loop(0, k1, lambda i, y: fori(k2)(y) + 1.0, x)

    c = {(k1, k2): cost(program(k1, k2), X) for k1, k2 in ((3, 4), (3, 8), (6, 4))}
    (outer,) = c[3, 4].loops
    (inner,) = outer.loops
    assert (outer.trip_count, inner.trip_count) == (3, 4)
    d = inner.ops_per_trip
    assert d >= 2 and outer.ops_per_trip >= 4 * d + 1  # a trip of the outer runs the inner 4 times
    # k1 * k2 * d: doubling k2 adds k1 * k2 * d ops; doubling k1 adds k1 * (c + k2 * d)
    assert c[3, 8].ops - c[3, 4].ops == 3 * 4 * d
    assert c[6, 4].ops - c[3, 4].ops == 3 * outer.ops_per_trip
    assert c[3, 4].ops >= 3 * 4 * d
    assert c[3, 8].loops[0].loops[0].trip_count == 8
    assert c[6, 4].flops >= 6 * 4 * 2 * 8**3


def test_a_conditional_costs_the_mean_of_its_branches():
    # one branch a loop of k trips, the other a single op: the mean grows by half a trip per trip
    def program(k):
        return lambda x: lax.cond(x[0, 0] > 0, fori(k), lambda y: y * 2.0, x)

    c = {k: cost(program(k), X) for k in (4, 8, 16)}
    b = c[4].loops[0].ops_per_trip
    assert [cc.loops[0].trip_count for cc in c.values()] == [4, 8, 16]
    assert c[8].ops - c[4].ops == 4 * b / 2
    assert c[16].ops - c[8].ops == 8 * b / 2
    # FLOPs too: half of k dots
    assert c[16].flops - c[8].flops >= 8 * 2 * 8**3 / 2


def test_an_elementwise_chain_fuses_to_one_op():
    x = jnp.linspace(0.1, 1.0, 1000, dtype=F32)

    def chain(n):
        def f(y):
            for _ in range(n):
                y = jnp.sin(y) * 1.5
            return y

        return f

    one, ten = cost(chain(1), x), cost(chain(10), x)
    assert one.ops == ten.ops == 1 and one.loops == ()
    # FLOPs: a sine and a multiply per element and link, counted inside the fusion
    assert ten.flops == 10 * 2 * x.size and one.flops == 2 * x.size
    # bytes: the fusion reads x and writes its result, once, however long the chain
    assert ten.bytes == one.bytes == 2 * 4 * x.size


def test_cost_analysis_counts_a_loop_body_once_and_program_cost_every_trip():
    m, n, p, k = 32, 64, 48, 10
    a, b = jnp.ones((k, m, n), F32), jnp.ones((n, p), F32)

    def f(a, b):
        return lax.scan(lambda acc, ai: (acc + ai @ b, None), jnp.zeros((m, p), F32), a)[0]

    compiled = jax.jit(f).lower(a, b).compile()
    dot = 2 * m * n * p
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list | tuple) else xla
    # XLA: one trip's dot (and a few elementwise FLOPs), whatever the trip count
    assert dot <= xla["flops"] < 2 * dot, xla["flops"]
    c = vmcgrad.program_cost(compiled)
    # program_cost: k dots, and per trip at most a few elementwise ops over the m x p result
    assert k * dot <= c.flops <= k * (dot + 4 * m * p) + 4 * m * p, c.flops
    # bytes: every trip reads its slice of a and all of b, and a copy is counted once per trip
    assert c.bytes >= k * 4 * (m * n + n * p)


def test_a_scan_writes_its_stacked_output_in_place():
    # ys of k rows written one row per trip: bytes affine in k, not k times the whole buffer
    def program(k):
        return lambda x: lax.scan(lambda y, _: (body(y), body(y)[0]), x, None, length=k)

    c = {k: cost(program(k), X) for k in (8, 16, 24)}
    assert c[24].bytes - 2 * c[16].bytes + c[8].bytes == 0
    assert c[24].ops - 2 * c[16].ops + c[8].ops == 0


def test_a_loop_of_unknown_trip_count_is_reported():
    def f(x):
        return lax.while_loop(lambda y: y.sum() < 100.0, body, x)

    c = cost(f, X)
    assert len(c.loops) == 1 and c.loops[0].trip_count is None
    assert c.unknown_trip_loops == (c.loops[0].name,)
    assert c.ops >= c.loops[0].ops_per_trip  # counted as one trip: a lower bound


def test_a_loop_of_unknown_trip_count_counts_the_trips_its_author_expects():
    """Traced inside ``expected_trips(k)``, the same while loop counts k trips, exactly affine in k
    (its body's and condition's counts k times), reported as assumed, not unknown; a loop of known
    trip count in the same scope keeps its own; no scope: one trip."""

    def program(k, known=False):
        def f(x):
            with expected_trips(k):
                y = lax.while_loop(lambda y: y.sum() < 100.0, body, x)
                return fori(3)(y) if known else y

        return f

    c = {k: cost(program(k), X) for k in (10, 20, 30)}
    for k, ck in c.items():
        (lp,) = ck.loops
        assert (lp.trip_count, ck.unknown_trip_loops, ck.assumed_trip_loops) == (k, (), (lp.name,)), ck
    for field in ("ops", "flops", "bytes"):
        v = {k: getattr(ck, field) for k, ck in c.items()}
        assert v[30] - 2 * v[20] + v[10] == 0 and v[20] > v[10], (field, v)
    assert c[20].ops - c[10].ops == 10 * c[10].loops[0].ops_per_trip
    once = cost(lambda x: lax.while_loop(lambda y: y.sum() < 100.0, body, x), X)
    assert c[10].ops - once.ops == 9 * once.loops[0].ops_per_trip
    both = cost(program(10, known=True), X)
    assert sorted(lp.trip_count for lp in both.loops) == [3, 10] and len(both.assumed_trip_loops) == 1
    with pytest.raises(ValueError, match="int >= 0"):
        expected_trips(2.5)


def test_the_model_and_its_platforms():
    c = cost(fori(8), X)
    assert c.platform == jax.devices()[0].platform == "cpu"
    for name, p in PLATFORMS.items():
        want = c.ops * p.t_op + c.flops / p.peak_flops + c.bytes / p.bandwidth
        assert c.time(name) == pytest.approx(want, rel=1e-12)
        assert p.name == name and p.source
    assert c.modelled_seconds == pytest.approx(c.time("cpu"), rel=1e-12)
    # the constants: H200 and TPU v5e
    assert PLATFORMS["gpu"][1:4] == (5e-6, 60e12, 4.8e12)
    assert PLATFORMS["tpu"][1:4] == (10e-6, 50e12, 819e9)
    tpu = cost(fori(8), X, platform="tpu")
    assert tpu.platform == "tpu" and tpu.modelled_seconds == pytest.approx(c.time("tpu"), rel=1e-12)
    assert vmcgrad.program_cost(jax.jit(fori(8)).lower(X).compile(), "cuda").platform == "gpu"
    own = Platform("mine", 1.0, 1.0, 1.0, "a test")
    assert c.time(own) == c.ops + c.flops + c.bytes
    # the text of the compiled program gives the same counts
    text = jax.jit(fori(8)).lower(X).compile().as_text()
    assert vmcgrad.program_cost(text)[:5] == c[:5]
    with pytest.raises(ValueError, match="platform 'abacus'"):
        c.time("abacus")
    with pytest.raises(AttributeError):
        c.ops = 0  # immutable


def test_a_dot_of_complex_numbers_counts_real_flops():
    a = jnp.ones((16, 32), jnp.complex64)
    b = jnp.ones((32, 8), jnp.complex64)
    c = cost(lambda a, b: a @ b, a, b)
    assert c.flops == 8 * 16 * 32 * 8  # 4 real multiplies and 4 adds per complex multiply-add
    assert c.bytes == 8 * (a.size + b.size + 16 * 8)


def test_an_fft_counts_five_n_log_n_per_transform():
    x = jnp.ones((4, 64), jnp.complex64)
    c = cost(jnp.fft.fft, x)
    assert c.flops == 4 * 5 * 64 * math.log2(64)
    assert c.ops >= 1 and np.isfinite(c.modelled_seconds)


def test_a_loop_without_a_known_trip_count_has_it_read_from_its_condition():
    # XLA:TPU writes no known_trip_count: the count is read from the counter, as fori_loop compiles
    text = jax.jit(fori(12)).lower(X).compile().as_text()
    stripped = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
    assert '"known_trip_count"' in text and '"known_trip_count"' not in stripped
    c, want = vmcgrad.program_cost(stripped), vmcgrad.program_cost(text)
    assert c.loops[0].trip_count == 12 and c.unknown_trip_loops == ()
    assert c[:3] == want[:3]
    # a loop from 3 to 12 by steps of 1, and a scan in reverse (its counter counts down in the body
    # or up, as JAX lowers it): the same count from the condition as from the backend config
    for f in (
        lambda x: lax.fori_loop(3, 12, lambda i, y: body(y), x),
        lambda x: lax.scan(lambda y, _: (body(y), None), x, None, length=7, reverse=True)[0],
    ):
        text = jax.jit(f).lower(X).compile().as_text()
        stripped = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
        assert vmcgrad.program_cost(stripped)[:3] == vmcgrad.program_cost(text)[:3]


def test_a_program_compiled_for_a_tpu():
    """``jax.jit(lambda x, w: lax.fori_loop(0, 16, lambda i, y: jnp.tanh(y @ w), x))`` on an 8 x 16
    and a 16 x 16 float32 array, compiled by jax 0.10.2 for one TPU v5e chip: its ``as_text()``."""
    text = (DATA / "tpu-v5e-fori-loop-16.hlo").read_text()
    assert '"known_trip_count"' not in text and "T(8,128)" in text  # TPU layouts, no trip count
    c = vmcgrad.program_cost(text, platform="tpu")
    (lp,) = c.loops
    # a trip: a copy, the dot fused with the tanh (a convolution fusion), the counter's add, the
    # compare; the entry: three copy-starts (their copy-dones free), a copy and a convert
    assert (lp.trip_count, lp.ops_per_trip, c.unknown_trip_loops) == (16, 4, ())
    assert c.ops == 16 * 4 + 5
    # the dot, 2 * 8 * 16 * 16, the tanh's 8 * 16 and the counter's add and compare, 16 times
    assert c.flops == 16 * (2 * 8 * 16 * 16 + 8 * 16 + 2)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128])
def test_a_dense_factorisation_counts_its_flops(dtype):
    """XLA:CPU calls LAPACK for Cholesky, LU and the symmetric eigendecomposition (a custom-call, no
    HLO to count): program_cost counts n³/3, 2n³/3 and 9n³ per matrix (4 times as many complex),
    batched, and a triangular solve n² per right-hand side; the rest of the program is a few
    elementwise ops over the n x n matrix, O(n²)."""
    cplx = 4 if jnp.issubdtype(dtype, jnp.complexfloating) else 1

    def flops(f, n, batch=()):
        a = jnp.eye(n, dtype=dtype) * 2.0 + 0.1
        return cost(f, jnp.broadcast_to(a, (*batch, n, n)), platform="cpu").flops

    for f, per_n3 in ((jnp.linalg.cholesky, 1 / 3), (lambda a: jax.lax.linalg.lu(a)[0], 2 / 3)):
        f64, f128 = flops(f, 64), flops(f, 128)
        # the n³ term exactly (n² terms cancel in the third difference's stand-in: f(2n) - 4 f(n) = 4 c n³)
        assert f128 - 4 * f64 == pytest.approx(4 * per_n3 * cplx * 64**3, rel=0.05), (f64, f128)
        assert flops(f, 64, (3,)) == pytest.approx(3 * f64, rel=0.05)
    if cplx == 1:
        e64 = flops(lambda a: jnp.linalg.eigh(a)[1], 64)
        assert 9 * 64**3 <= e64 <= 9 * 64**3 + 50 * 64**2, e64
    b = jnp.ones((64, 5), dtype)
    tri = cost(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True), jnp.eye(64, dtype=dtype), b)
    assert 64 * 64 * 5 * cplx <= tri.flops <= 64 * 64 * 5 * cplx + 20 * 64 * 5 * cplx, tri.flops


def test_a_slice_moves_the_bytes_it_slices():
    """A static ``slice`` reads and writes its part of the operand, on its own or fused: the bytes of
    ``x[:, :16] * 2`` and of ``x[:, :16]`` on a 256 x 512 float32 array are those of the 256 x 16
    part, read once and written once, not of all of ``x`` (512 KiB)."""
    x = jnp.ones((256, 512), F32)
    part = 256 * 16 * 4
    for f in (lambda x: x[:, :16] * 2.0, lambda x: x[:, 16:32]):
        c = cost(f, x, platform="tpu")
        assert c.bytes == 2 * part, (c.bytes, 2 * part)


def test_asynchronous_copies_and_slices_of_a_tpu_move_their_destination():
    """XLA:TPU's ``copy-start`` and ``slice-start`` return (the operand, the destination, a context):
    each reads and writes the destination's bytes, not the tuple's. The TPU program of
    ``test_a_program_compiled_for_a_tpu`` copies its arguments (8 x 16 and 16 x 16 float32); a
    hand-written ``slice-start`` takes 128 of 512 rows of a 512 x 512 float32 matrix."""
    from vmcgrad._hlo.ops import OpCosts

    text = (DATA / "tpu-v5e-fori-loop-16.hlo").read_text()
    program = OpCosts(text)
    starts = [i for i in program.comps[program.entry] if i.opcode == "copy-start"]
    got = sorted(program.op_bytes(i, program.entry) for i in starts)
    # x and w into the memory the loop reads (S(1)), and the result back out
    assert got == [2.0 * 8 * 16 * 4, 2.0 * 8 * 16 * 4, 2.0 * 16 * 16 * 4], got
    hlo = """\
HloModule m, is_scheduled=true

ENTRY %main (a: f32[512,512]) -> f32[128,512] {
  %a = f32[512,512]{1,0:T(8,128)} parameter(0)
  %slice-start = ((f32[512,512]{1,0:T(8,128)}), f32[128,512]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) \
slice-start(%a), slice={[0:128], [0:512]}
  ROOT %slice-done = f32[128,512]{1,0:T(8,128)S(1)} slice-done(%slice-start)
}
"""
    c = vmcgrad.program_cost(hlo, platform="tpu")
    assert (c.ops, c.bytes) == (1, 2.0 * 128 * 512 * 4), c
