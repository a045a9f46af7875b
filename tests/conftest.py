"""Test set-up: fake CPU devices (4 by default; VMCGRAD_TEST_DEVICES=1 for one) and float64.

This must run before any JAX computation: ``jax_num_cpu_devices`` raises if set too late.
"""

import gc
import os

import jax
import pytest

N_DEVICES = int(os.environ.get("VMCGRAD_TEST_DEVICES", "4"))
jax.config.update("jax_num_cpu_devices", N_DEVICES)
jax.config.update("jax_enable_x64", True)
# NetKet fakes its own CPU devices from this variable at import; keep it in step.
os.environ.setdefault("NETKET_EXPERIMENTAL_SHARDING_CPU", str(N_DEVICES))

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
