"""A pytest plugin: where a test run's time goes in JAX (tracing, lowering to MLIR, XLA's compile).

It sums JAX's own duration events (``jax.monitoring``) over the whole run and prints them at the end,
with the run's wall and CPU time: how tests/conftest.py's compile settings were chosen (compiling is
most of the suite's time). Measure the suite as it runs, and under XLA's defaults, e.g.::

    PYTHONPATH=benchmarks python -m pytest -p pytest_compile_time -p no:xdist tests/test_grad.py
    VMCGRAD_TEST_XLA=default PYTHONPATH=benchmarks \
        python -m pytest -p pytest_compile_time -p no:xdist tests/test_grad.py

One process only (``-p no:xdist``): workers' events do not reach the controller.

It also attributes the time: the tests that spent the most in JAX (tracing, lowering and compile
together, with their number of compiled programs; setup and teardown count with the test) and the
programs that did (by the name of the function JAX traced: ``matmul_program`` is vmcgrad's
``S @ v``, ``add`` an eager ``+`` in a test). ``--compile-time-top=K`` sets how many of each (default 15).
"""

from __future__ import annotations

import collections
import time

import jax
import pytest

#: The events this prints, in this order (JAX's names): tracing, lowering, XLA's compile.
EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_start = {"wall": time.perf_counter(), "cpu": time.process_time()}


#: Per compiled program's name (``fun_name``): seconds over the three events, and compiles.
_program_seconds: collections.Counter = collections.Counter()
_program_counts: collections.Counter = collections.Counter()
#: Per test (node id): seconds over the three events, and compiles.
_test_seconds: dict[str, float] = {}
_test_counts: dict[str, int] = {}


def _listen(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
    if event not in EVENTS:
        return
    _seconds[event] += duration
    _counts[event] += 1
    name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # tracing says "f", the rest "jit(f)"
    _program_seconds[name] += duration
    if event == EVENTS[-1]:
        _program_counts[name] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)

#: JAX's persistent compilation cache, when one is set (JAX_COMPILATION_CACHE_DIR): how many compiles
#: found their program already there. On an empty folder with no thresholds
#: (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0) the hits
#: are the programs the run compiled twice.
CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")
_cache: collections.Counter = collections.Counter()


def _count(event: str, **_: object) -> None:
    if event in CACHE_EVENTS:
        _cache[event] += 1


jax.monitoring.register_event_listener(_count)


def pytest_addoption(parser):
    parser.addoption(
        "--compile-time-top",
        type=int,
        default=15,
        help="pytest_compile_time: how many tests and programs to list (default 15)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = sum(_seconds[e] for e in EVENTS), _counts[EVENTS[-1]]
    yield
    _test_seconds[item.nodeid] = sum(_seconds[e] for e in EVENTS) - before[0]
    _test_counts[item.nodeid] = _counts[EVENTS[-1]] - before[1]


def pytest_terminal_summary(terminalreporter):
    wall = time.perf_counter() - _start["wall"]
    cpu = time.process_time() - _start["cpu"]
    terminalreporter.section("JAX compile time (jax.monitoring)")
    terminalreporter.write_line(f"process: {wall:.1f} s wall, {cpu:.1f} s CPU")
    for event in EVENTS:
        terminalreporter.write_line(f"{event}: {_seconds[event]:.2f} s over {_counts[event]} programs")
    if _cache:
        terminalreporter.write_line(", ".join(f"{e}: {_cache[e]}" for e in CACHE_EVENTS))
    top = terminalreporter.config.getoption("--compile-time-top")
    if top <= 0:
        return
    total = sum(_seconds[e] for e in EVENTS)
    terminalreporter.write_line(f"tests spending the most in JAX (of {total:.1f} s; seconds, programs):")
    for nodeid, secs in sorted(_test_seconds.items(), key=lambda kv: -kv[1])[:top]:
        terminalreporter.write_line(f"{secs:8.2f} s {_test_counts[nodeid]:6d}  {nodeid}")
    terminalreporter.write_line("programs spending the most (trace + lower + compile; seconds, compiles):")
    for name, secs in _program_seconds.most_common(top):
        terminalreporter.write_line(f"{secs:8.2f} s {_program_counts[name]:6d}  {name}")
