"""Test set-up: fake CPU devices (4 by default; VMCGRAD_TEST_DEVICES=1 for one) and float64.

This must run before any JAX computation: ``jax_num_cpu_devices`` raises if set too late.
"""

import gc
import os

# XLA's CPU compiler settings for the suite, set before JAX starts its backend (subprocesses inherit
# them); a flag already in XLA_FLAGS is left as the user set it.
# - Compiling is most of the suite's CPU time. LLVM at optimisation level 0, XLA's elemental emitters
#   instead of its fusion emitters and one LLVM module per program compile about 3x faster
#   (tests/test_grad.py's backend compile: 39 s -> 13.5 s, benchmarks/pytest_compile_time.py,
#   2026-12-02). Both emitters are XLA:CPU's own, and a second rounding: no tolerance may rest on one
#   compiler's. VMCGRAD_TEST_XLA=default keeps XLA's defaults (the compiler users' programs get):
#   .ci/run runs the compiled-program checks so, and the notebooks.
# - XLA's CPU collectives warn when a device's thread has waited 20 s at a rendezvous ("may be stuck":
#   how tests/test_netket_tdvp.py tells a stalled child from a slow one) and abort the process
#   ("Fatal Python error") after 40 s by default. A stall is not load: one device's part of a
#   program never arrives (tests/test_netket_tdvp.py's in_own_process). 300 s leaves a slow rendezvous
#   on a loaded machine its time and still ends a real deadlock well within CI's limit.
_STALL = {
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds": "20",
    "--xla_cpu_collective_call_terminate_timeout_seconds": "300",
}
_FAST_COMPILE = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
    "--xla_cpu_parallel_codegen_split_count": "1",
}
XLA_MODES = ("fast", "default")


def xla_flags(user_flags: str, mode: str) -> str:
    """``XLA_FLAGS`` for the suite: the user's, then each of the suite's flags the user did not set."""
    if mode not in XLA_MODES:
        raise ValueError(f"VMCGRAD_TEST_XLA={mode!r}: expected one of {XLA_MODES} (unset means 'fast')")
    ours = {**_STALL, **(_FAST_COMPILE if mode == "fast" else {})}
    set_by_user = {flag.split("=")[0] for flag in user_flags.split()}
    return " ".join([user_flags, *(f"{k}={v}" for k, v in ours.items() if k not in set_by_user)]).strip()


os.environ["XLA_FLAGS"] = xla_flags(
    os.environ.get("XLA_FLAGS", ""), os.environ.get("VMCGRAD_TEST_XLA", "fast")
)


import jax
import pytest
from helpers import N_DEVICES, auto_mesh  # N_DEVICES: VMCGRAD_TEST_DEVICES, 4 if unset

jax.config.update("jax_num_cpu_devices", N_DEVICES)
jax.config.update("jax_enable_x64", True)
# Without asynchronous dispatch a call on one device returns when its program has run. It does not
# serialise programs on several devices: on 4 fake CPU devices a call returned at once and its program
# ran on for 0.58 s (jax 0.10.2, issue 46), so it is no guard against overlapping 4-device programs
# (the TDVP stall, tests/test_netket_tdvp.py, is met with it set). What vmcgrad computes is unchanged.
jax.config.update("jax_cpu_enable_async_dispatch", False)
# NetKet fakes its own CPU devices from this variable at import; keep it in step.
os.environ.setdefault("NETKET_EXPERIMENTAL_SHARDING_CPU", str(N_DEVICES))
# With that variable NetKet's import sets a global mesh. Import it here, with the mesh undone, so that
# no test's outcome depends on whether it is the first to import NetKet (a test file run alone, or
# a pytest-xdist worker's share).
with jax.set_mesh(None):
    try:
        import netket  # noqa: F401
    except ImportError:  # the core suite runs without the [netket] extra
        pass

# A worker script run in subprocesses by test_multiprocess.py; importing it would join a cluster.
collect_ignore = ["mp_worker.py"]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees every compiled program and trace cache after each test module. With ~1000 tests in one
    process on 4 fake CPU devices, XLA's CPU runtime segfaulted (jax 0.10.2) while compiling or
    collecting late in the run, in tests that pass alone; nothing is shared across modules on purpose."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_mesh_left_behind(request):
    """Fails the test that leaves a context mesh set (``jax.set_mesh`` not undone): later tests would
    silently find a sample axis there."""
    yield
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        pytest.fail(f"{request.node.nodeid} left a context mesh set: {mesh}")


@pytest.fixture
def netket_mesh():
    """NetKet's mesh (one Auto axis "S" over all devices), as after a plain ``import netket``, set as
    the context mesh for the test. A module whose every test runs under it names it in its
    ``pytestmark`` (``pytest.mark.usefixtures("netket_mesh")``)."""
    with jax.set_mesh(auto_mesh()):
        yield


# --- tiers ---------------------------------------------------------------------------------------
# The README's command runs the quick tier: each test function's first instance, plus, for the
# parameters a test names in `@pytest.mark.quick_cover(...)` (the estimator, the mode, the model),
# an instance for each of their values (a covering subset, chosen in collection order); no test
# marked `slow` or `heavy` (one that compiles many programs: a budget search, every transform of a
# dense QGT). On 1 device it is a smoke pass: each test's first instance, in the modules marked
# `one_device_smoke` only (every estimator: vjp/jvp, expect_grad, the QGT and its solve, the NTK and
# MinSR; the NetKet switch; the HLO structure and with_refs checks). `--tier=rest` runs exactly what
# the quick tier leaves out (on 4 devices: the rest of each parameter matrix, the heavy and the slow
# tests); .ci/run runs both on 4 devices, so CI covers every case. `--tier=all` runs everything.
TIERS = ("quick", "rest", "all")


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=TIERS,
        default="quick",
        help="quick (default): each parameter value once, no slow tests; rest: the others; all: every test",
    )


def _param_key(name, value):
    try:
        hash(value)
    except TypeError:
        return (name, "id", id(value))
    return (name, type(value).__name__, value)


def quick_items(items, *, cover=True):
    """The quick tier of ``items``: per test function, its first instance and each instance that
    covers a value, not yet covered, of a parameter its ``quick_cover`` marker names (``cover=False``:
    the first instance only); no instance of a test marked ``slow`` or ``heavy``."""
    covered, quick = {}, []
    for item in items:
        if item.get_closest_marker("slow") is not None or item.get_closest_marker("heavy") is not None:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            quick.append(item)
            continue
        function = (item.module.__name__, item.originalname)
        marker = item.get_closest_marker("quick_cover")
        names = set(marker.args) if marker is not None and cover else set()
        keys = {_param_key(n, v) for n, v in callspec.params.items() if n in names}
        if function not in covered or not keys <= covered[function]:
            covered.setdefault(function, set()).update(keys)
            quick.append(item)
    return quick


def tier_items(items, tier, n_devices):
    """The items of ``tier`` on ``n_devices``: all of them, the quick tier (on 1 device: each test's
    first instance in the modules marked ``one_device_smoke``), or the rest (its complement)."""
    if tier == "all":
        return list(items)
    quick = {id(item) for item in quick_items(items, cover=n_devices > 1)}
    if n_devices == 1:
        quick &= {id(item) for item in items if item.get_closest_marker("one_device_smoke")}
    return [item for item in items if (id(item) in quick) == (tier == "quick")]


def pytest_collection_modifyitems(config, items):
    keep = tier_items(items, config.getoption("--tier"), N_DEVICES)
    kept = {id(item) for item in keep}
    dropped = [item for item in items if id(item) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
