"""A pytest plugin: where a test run's time goes in JAX (tracing, lowering to MLIR, XLA's compile).

It sums JAX's own duration events (``jax.monitoring``) over the whole run and prints them at the end,
with the run's wall and CPU time: how tests/conftest.py's compile settings were chosen (compiling is
most of the suite's time). Measure the suite as it runs, and under XLA's defaults, e.g.::

    PYTHONPATH=benchmarks python -m pytest -p pytest_compile_time -p no:xdist tests/test_grad.py
    VMCGRAD_TEST_XLA=default PYTHONPATH=benchmarks \
        python -m pytest -p pytest_compile_time -p no:xdist tests/test_grad.py

One process only (``-p no:xdist``): workers' events do not reach the controller.
"""

from __future__ import annotations

import collections
import time

import jax

#: The events this prints, in this order (JAX's names): tracing, lowering, XLA's compile.
EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_start = {"wall": time.perf_counter(), "cpu": time.process_time()}


def _listen(event: str, duration: float, **_: object) -> None:
    _seconds[event] += duration
    _counts[event] += 1


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


def pytest_terminal_summary(terminalreporter):
    wall = time.perf_counter() - _start["wall"]
    cpu = time.process_time() - _start["cpu"]
    terminalreporter.section("JAX compile time (jax.monitoring)")
    terminalreporter.write_line(f"process: {wall:.1f} s wall, {cpu:.1f} s CPU")
    for event in EVENTS:
        terminalreporter.write_line(f"{event}: {_seconds[event]:.2f} s over {_counts[event]} programs")
    if _cache:
        terminalreporter.write_line(", ".join(f"{e}: {_cache[e]}" for e in CACHE_EVENTS))
