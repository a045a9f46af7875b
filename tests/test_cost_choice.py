"""Automatic choices priced for a platform (issue 47 item 2): the platform a choice is for (the
devices' own, an argument, ``vmcgrad.cost_platform``, ``$VMCGRAD_COST_PLATFORM``), the chooser
``cheapest`` (least modelled time among the candidates that fit the budget), and the record of a
choice (``auto_chunk_size(..., info=True)``, ``QGTOperator.choice``). The QGT design's route test on
a real model: ``test_qgt_design.py::test_auto_chooses_design_and_chunk_from_the_budget_and_the_platform``."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_count

import vmcgrad
from vmcgrad._chunks import budget as _budget
from vmcgrad._hlo.cost import PLATFORMS
from vmcgrad._hlo.platform import ENV, resolve_platform

N = 1024  # rows walked by the synthetic program


def _square_blocks(chunk):
    """A chunked program whose bytes grow faster than its rows: ``N / chunk`` trips, each three
    elementwise ops on a ``chunk x chunk`` block (bytes ~ N chunk, ops ~ N / chunk, temporaries
    ~ chunk^2). On the CPU's constants (t_op 1 us, 20 GB/s) the bytes dominate from chunk 64 on, so
    a middle chunk is cheapest; on the TPU's (t_op 10 us, 819 GB/s) the ops do, so the largest that
    fits is."""

    def body(i, acc):
        block = jnp.sin(acc * (i + 1.0))
        return jnp.cos(block) + block * block

    fun = jax.jit(lambda x: jax.lax.fori_loop(0, N // chunk, body, x))
    return fun.lower(jax.ShapeDtypeStruct((chunk, chunk), jnp.float32)).compile()


CHUNKS = (8, 16, 32, 64, 128, 256, 512)


@pytest.fixture(scope="module")
def programs():
    return {c: _square_blocks(c) for c in CHUNKS}


def test_on_the_tpu_the_cheapest_chunk_is_larger_than_on_the_cpu_within_the_same_budget(programs):
    """The route test of the chooser: one budget (the 256 block fits, the 512 one does not), two
    platforms: the TPU's constants take the largest fitting chunk (fewest, largest ops), the CPU's a
    smaller one (its bytes cost more than its ops). Each choice is the least modelled time among the
    fitting candidates, recomputed here from ``program_cost``."""
    budget = _budget.program_bytes(programs[256])
    assert _budget.program_bytes(programs[512]) > budget
    choices = {}
    for platform in ("cpu", "tpu"):
        choice = _budget.cheapest(CHUNKS, programs.__getitem__, budget, platform)
        fitting = [c for c in CHUNKS if _budget.program_bytes(programs[c]) <= budget]
        seconds = {c: vmcgrad.program_cost(programs[c], platform).modelled_seconds for c in fitting}
        assert choice.value == min(fitting, key=lambda c: (seconds[c], -c)), (platform, seconds)
        assert choice.seconds == pytest.approx(seconds[choice.value], rel=1e-12)
        assert choice.platform == platform and choice.compiled == len(CHUNKS)
        assert dict(choice.priced) == pytest.approx(seconds, rel=1e-12)
        choices[platform] = choice
    cpu, tpu = choices["cpu"], choices["tpu"]
    assert tpu.value == 256 and cpu.value < tpu.value, (cpu.value, tpu.value)
    assert tpu.ops < cpu.ops  # fewer ops in sequence, each larger
    assert max(cpu.memory, tpu.memory) <= budget
    # the same choice through the context manager (the default platform of ``cheapest``)
    with vmcgrad.cost_platform("tpu"):
        assert _budget.cheapest(CHUNKS, programs.__getitem__, budget).value == 256


def test_cheapest_skips_what_its_bound_rules_out_and_none_fits(programs):
    compiled = []

    def at(c):
        compiled.append(c)
        return programs[c]

    budget = _budget.program_bytes(programs[512])
    largest_first = CHUNKS[::-1]
    choice = _budget.cheapest(largest_first, at, budget, "tpu", bound=lambda c, best: best.seconds * 512 / c)
    assert choice.value == 512 and compiled == [512]  # the bound rules every smaller chunk out
    assert _budget.cheapest(CHUNKS, programs.__getitem__, 1, "cpu") is None


def test_the_platform_is_the_devices_own_unless_overridden(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    own = jax.devices()[0].platform
    assert resolve_platform().name == own
    assert resolve_platform("tpu") == PLATFORMS["tpu"]
    monkeypatch.setenv(ENV, "gpu")
    assert resolve_platform().name == "gpu"
    with vmcgrad.cost_platform("cuda") as p:  # an alias; the context wins over the environment
        assert p == PLATFORMS["gpu"] and resolve_platform().name == "gpu"
        with vmcgrad.cost_platform("tpu"):
            assert resolve_platform().name == "tpu"
            assert resolve_platform("cpu").name == "cpu"  # an argument wins over both
        with vmcgrad.cost_platform(None):
            assert resolve_platform().name == "gpu"  # back to the environment's
    monkeypatch.delenv(ENV)
    assert resolve_platform().name == own
    mesh = jax.make_mesh((jax.device_count(),), ("S",))
    assert resolve_platform(mesh=mesh).name == mesh.devices.flat[0].platform


def test_a_bad_platform_fails_in_the_callers_terms(monkeypatch):
    with pytest.raises(ValueError, match=r"vmcgrad.cost_platform: unknown platform 'gpx'; expected one of"):
        with vmcgrad.cost_platform("gpx"):
            pass
    with pytest.raises(TypeError, match="expected a platform name"):
        with vmcgrad.cost_platform(3):
            pass
    monkeypatch.setenv(ENV, "h100")
    with pytest.raises(ValueError, match=r"\$VMCGRAD_COST_PLATFORM: unknown platform 'h100'"):
        resolve_platform()
    monkeypatch.delenv(ENV)
    fun, w, x = _case()
    with pytest.raises(ValueError, match=r"vmcgrad.auto_chunk_size: `platform`: unknown platform 'gpx'"):
        vmcgrad.auto_chunk_size(fun, w, x, platform="gpx")


def _case():
    fun = lambda w, x: jnp.tanh(x @ w).sum(-1)
    return fun, jnp.ones((8, 16)) / 8, jnp.linspace(-1, 1, 256 * 8).reshape(256, 8)


def test_the_record_of_a_choice_is_readable_and_cached_per_platform():
    """``auto_chunk_size(..., info=True)``: the chunk, its modelled time and platform, JSON-able;
    asking again on the same platform compiles nothing; another platform is a choice of its own."""
    fun, w, x = _case()
    budget = 2**40
    record = vmcgrad.auto_chunk_size(fun, w, x, memory_budget=budget, info=True, platform="tpu")
    assert record.value == vmcgrad.auto_chunk_size(fun, w, x, memory_budget=budget, platform="tpu")
    assert record.platform == "tpu" and record.seconds > 0 and record.memory > 0
    assert record.priced[-1] == (record.value, record.seconds)
    assert json.loads(json.dumps(record.as_dict()))["value"] == record.value
    before = compile_count()
    with vmcgrad.cost_platform("tpu"):
        again = vmcgrad.auto_chunk_size(fun, w, x, memory_budget=budget, info=True)
    assert again == record and compile_count() == before
    cpu = vmcgrad.auto_chunk_size(fun, w, x, memory_budget=budget, info=True, platform="cpu")
    assert cpu.platform == "cpu" and cpu.seconds != record.seconds
    S = vmcgrad.QGT(fun, w, x, chunk_size="auto", memory_budget=budget)
    assert S.choice.value == (S.design, S.chunk_size)
    assert vmcgrad.auto_chunk_size(fun, w, x, estimator="QGT", memory_budget=budget, info=True) == S.choice
    assert vmcgrad.QGT(fun, w, x, chunk_size=8).choice is None
