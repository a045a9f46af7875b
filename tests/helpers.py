"""Shared test helpers: a tree comparison that really compares, models, sharding set-ups, and the
child processes tests start (the command line as a user runs it).

Every helper two test modules share lives here (tests/test_package.py checks that no test module
imports another); fixtures every module gets are in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def assert_tree_allclose(actual, desired, *, rtol, atol=0.0):
    """Same pytree structure, same shapes and dtypes leaf by leaf, and close values."""
    a_def, d_def = jax.tree.structure(actual), jax.tree.structure(desired)
    assert a_def == d_def, f"tree structures differ: {a_def} vs {d_def}"
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        a, d = jnp.asarray(a), jnp.asarray(d)
        assert a.shape == d.shape, (a.shape, d.shape)
        assert a.dtype == d.dtype, (a.dtype, d.dtype)
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=rtol, atol=atol)


def tols(dtype):
    """(rtol, atol) for float64 and float32 comparisons of sums over ~10^2 samples."""
    return (1e-11, 1e-12) if jnp.finfo(dtype).bits == 64 else (2e-4, 2e-5)


# --- models: fun(params, batch) -> (batch,) -----------------------------------------------------


def r2r(p, x):
    return jnp.sum(jnp.tanh(x @ p["W"] + p["b"]), axis=-1)


def r2c(p, x):
    """Real parameters, complex output (modulus and phase, like NetKet's RBMModPhase)."""
    h = x @ p["W"]
    return jnp.sum(jnp.log(jnp.cosh(h)), -1) + 1j * jnp.sum(jnp.tanh(h @ p["phase"]), -1)


def c2c_holo(p, x):
    return jnp.sum(jnp.log(jnp.cosh(x @ p["W"] + p["b"])), axis=-1)


def c2c_nonholo(p, x):
    h = x @ p["W"]
    return jnp.sum(jnp.log(jnp.cosh(h)) + 0.3 * jnp.conj(h) * jnp.abs(h), axis=-1)


def mixed(p, x):
    """A real and a complex parameter leaf, complex output."""
    return jnp.sum(jnp.tanh(x @ p["real"]) * p["cplx"], axis=-1)


def layered(p, x):
    """The seed discussion's model: an inner lax.scan over layers."""
    act, _ = jax.lax.scan(lambda h, W: (jnp.tanh(h @ W), None), x, p)
    return jnp.sum(act, axis=-1)


def pytree_samples(p, s):
    return jnp.tanh(s["x"] @ p["W"]).sum(-1) * s["y"]


L, H = 6, 5


def _c(key, shape, dtype):
    k1, k2 = jax.random.split(key)
    re = jax.random.normal(k1, shape, dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        re = jax.random.normal(k1, shape, jnp.finfo(dtype).dtype)
        return (re + 1j * jax.random.normal(k2, shape, re.dtype)).astype(dtype) / 2
    return re / 2


def make_case(name, n, dtype=jnp.float64, seed=0):
    """Returns (fun, params, samples) for a named dtype case with n samples."""
    real = jnp.dtype(dtype)
    cplx = jnp.result_type(real, jnp.complex64)
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, L), real)
    if name == "r2r":
        return r2r, {"W": _c(ks[1], (L, H), real), "b": _c(ks[2], (H,), real)}, x
    if name == "r2c":
        return r2c, {"W": _c(ks[1], (L, H), real), "phase": _c(ks[2], (H, 3), real)}, x
    if name == "c2c_holo":
        return c2c_holo, {"W": _c(ks[1], (L, H), cplx), "b": _c(ks[2], (H,), cplx)}, x.astype(cplx)
    if name == "c2c_nonholo":
        return c2c_nonholo, {"W": _c(ks[1], (L, H), cplx)}, x.astype(cplx)
    if name == "mixed":
        return mixed, {"real": _c(ks[1], (L, H), real), "cplx": _c(ks[2], (H,), cplx)}, x
    if name == "layered":
        return layered, _c(ks[1], (3, L, L), real), x
    if name == "pytree_samples":
        s = {"x": x, "y": jax.random.normal(ks[3], (n,), real)}
        return pytree_samples, {"W": _c(ks[1], (L, H), real)}, s
    raise ValueError(name)


CASES = ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "mixed", "layered", "pytree_samples"]


def random_like(key, shape, dtype):
    return _c(key, shape, dtype) * 2


# --- NetKet-style models: apply(variables, x), the parameters under variables["params"] ---------

NK_L, NK_H = 5, 4


def _apply_real(v, x):
    p = v["params"]
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]), -1) + x @ p["a"]


def _apply_r2c(v, x):
    p = v["params"]
    return jnp.sum(jnp.log(jnp.cosh(x @ p["w"] + p["b"])), -1) + 1j * jnp.tanh(x @ p["a"])


def _apply_holo(v, x):
    p = v["params"]
    return jnp.sum(jnp.log(jnp.cosh(x @ p["w"] + p["b"])), -1) + x @ p["a"]


def _apply_nonholo(v, x):
    p = v["params"]
    return _apply_holo(v, x) + 0.3 * jnp.conj(x @ p["a"]) ** 2


#: name -> (apply, complex parameters): real, real-to-complex, holomorphic, non-holomorphic.
NK_MODELS = {
    "real": (_apply_real, False),
    "r2c": (_apply_r2c, False),
    "holo": (_apply_holo, True),
    "nonholo": (_apply_nonholo, True),
}


def nk_params(complex_params, dtype=jnp.float64):
    """Parameters for :data:`NK_MODELS` (``w``: (L, H), ``b``: (H,), ``a``: (L,)), complex if asked."""
    k = jax.random.split(jax.random.key(1), 6)
    p = {
        "w": 0.3 * jax.random.normal(k[0], (NK_L, NK_H)),
        "b": 0.1 * jax.random.normal(k[1], (NK_H,)),
        "a": 0.2 * jax.random.normal(k[2], (NK_L,)),
    }
    if complex_params:
        p = {n: v + 0.2j * jax.random.normal(kk, v.shape) for (n, v), kk in zip(p.items(), k[3:])}
    return jax.tree.map(lambda v: v.astype(jnp.result_type(dtype, v.dtype)), p)


def nk_data(n, seed=2):
    """``(x, e)``: n spin configurations of ±1 (length L) and complex local energies."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jnp.where(jax.random.bernoulli(k1, 0.5, (n, NK_L)), 1.0, -1.0)
    e = jax.random.normal(k2, (n,)) + 1j * jax.random.normal(k3, (n,))
    return x, e


def nk_logpsi(apply):
    """``logpsi(params, x)`` of a NetKet-style ``apply(variables, x)``."""
    return lambda p, x: apply({"params": p}, x)


def close(a, b, dtype, scale=1.0):
    """:func:`assert_tree_allclose` at :func:`tols` of ``dtype``, the absolute tolerance times ``scale``."""
    rtol, atol = tols(dtype)
    assert_tree_allclose(a, b, rtol=rtol, atol=atol * scale)


def qgt_bytes(S, design, chunk):
    """Compiled bytes (temporaries, arguments, outputs) of ``S @ v`` for one product design and chunk."""
    import dataclasses

    from vmcgrad._chunks.budget import program_bytes
    from vmcgrad._sr.qgt.apply import matmul_program

    op = dataclasses.replace(S, design=design)
    return program_bytes(matmul_program.lower(S.problem.at_chunk(chunk), op, S.params, "tree").compile())


# --- sharding set-ups ---------------------------------------------------------------------------


def auto_mesh():
    return Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))


def explicit_mesh():
    return jax.make_mesh((jax.device_count(),), ("S",), axis_types=(AxisType.Explicit,))


@contextlib.contextmanager
def setup(kind):
    """Yields a function placing sample-shaped arrays as the set-up ``kind`` does.

    'netket': Auto-axis mesh "S" set as context mesh, samples NamedSharding(mesh, P("S"));
    'explicit': Explicit-axis mesh "S", samples resharded to P("S") (the seed discussion);
    'none': no mesh, arrays on the default device.
    """
    if kind == "none":
        yield lambda a: a
        return
    mesh = auto_mesh() if kind == "netket" else explicit_mesh()
    with jax.set_mesh(mesh):
        if kind == "netket":
            yield lambda tree: jax.device_put(tree, NamedSharding(mesh, P("S")))
        else:
            yield lambda tree: jax.tree.map(lambda a: jax.sharding.reshard(a, P("S")), tree)


# --- compilation counter ------------------------------------------------------------------------

_compiles = 0
_lock = threading.Lock()


def _on_event(event, duration, **kwargs):
    global _compiles
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


class DriftingDevice:
    """A device whose memory in use grows at every read of its stats, as a GPU's or a TPU's does
    between steps (new samples, parameters, optimiser state): what the default budget reads."""

    def __init__(self, limit=2**30, step=4096):
        self.limit, self.step, self.used, self.reads = limit, step, 0, 0

    def memory_stats(self):
        self.used, self.reads = self.used + self.step, self.reads + 1
        return {"bytes_limit": self.limit, "bytes_in_use": self.used}


def compile_count() -> int:
    """Backend compilations so far in this process."""
    return _compiles


@contextlib.contextmanager
def compiled_names():
    """The names of the functions compiled (backend compilations) inside the ``with`` block, in
    order: ``with compiled_names() as names: ...``, then ``names.count("jit(_update_program)")``."""
    names = []

    def listen(event, duration, fun_name="?", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def traced_without_mesh():
    """The notice vmcgrad gives when samples are traced under ``jax.jit`` with no mesh and several
    devices (``vmcgrad._problem.sharding``'s ``warn_if_sharding_unseen``), asserted where it is due: a
    test that jits an estimator without a mesh on purpose wraps the call in this (nothing is expected
    on 1 device)."""
    import pytest

    import vmcgrad

    if jax.device_count() == 1:
        return contextlib.nullcontext()
    return pytest.warns(vmcgrad.VmcgradWarning, match="no sharding visible in their type")


def module_name(path, root) -> str:
    """The dotted name of the module at ``path`` in the package folder ``root`` (``a/b/__init__.py``
    is ``a.b``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# --- child processes: the command line as a user starts it --------------------------------------

ROOT = Path(__file__).resolve().parents[1]
#: The suite's fake CPU device count (tests/conftest.py sets JAX's from it).
N_DEVICES = int(os.environ.get("VMCGRAD_TEST_DEVICES", "4"))
#: The variables a cluster launcher (SLURM's ``srun``, Open MPI's ``mpirun``, Kubernetes, JAX's own)
#: gives a task: a child sees only those its test sets, never the ones this process runs under.
LAUNCHER_VARS = (
    "SLURM_",
    "OMPI_",
    "PMIX_",
    "KUBERNETES_SERVICE_HOST",
    "JAX_COORDINATOR",
    "JAX_LOCAL_DEVICE_IDS",
)


def child_env(launcher_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a JAX process a test starts: this one's, less its JAX_* and NETKET_*
    settings (the child sets its own devices and precision), XLA's variables other than XLA_FLAGS,
    whose compile settings it keeps (less a host device count), and any launcher's variables, plus
    ``launcher_env`` (a cluster launcher's, for ``--distributed auto``)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "NETKET_", *LAUNCHER_VARS))
    }
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(kept)
    env.update(launcher_env or {})
    return env


def start(argv: list[str], cwd: Path, launcher_env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python *argv`` started as a user starts it, with this checkout first on ``PYTHONPATH``,
    in its own process group (:func:`kill_all` ends it and its children as a whole), text pipes."""
    env = child_env(launcher_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def start_vmcgrad(args: list[str], cwd: Path, launcher_env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m vmcgrad *args`` (:func:`start`)."""
    return start(["-m", "vmcgrad", *args], cwd, launcher_env)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of ``proc``; past ``timeout`` seconds its process group is
    killed and the test fails with the ends of both streams."""
    import pytest

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        command = " ".join(map(str, proc.args[1:]))[:300]
        pytest.fail(f"`python {command}` did not finish within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return proc.returncode, out, err


def run_vmcgrad(args: list[str], cwd: Path, timeout: float = 90) -> tuple[int, str, str]:
    """``python -m vmcgrad *args`` to its end (:func:`finish`)."""
    return finish(start_vmcgrad(args, cwd), timeout)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kills every child still running, with its process group (its JAX children die with it)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


#: ``vmcgrad vmc``'s options for a tiny run on the suite's devices (Heisenberg chain of 8 spins).
TINY = ["--L", "8", "--samples", "128", "--chunk-size", "24", "--devices", str(N_DEVICES)]
#: The lists a ``vmcgrad vmc`` log holds, one entry a step.
LOG_KEYS = {"energy_mean", "energy_error", "energy_variance", "step_time", "exact_energy", "relative_error"}


def check_log(log: dict, n_steps: int | None = None) -> int:
    """Checks a ``vmcgrad vmc`` log's per-step lists (equal lengths, finite energies, positive
    errors and times); returns the number of steps."""
    assert LOG_KEYS <= set(log)
    lengths = {len(log[k]) for k in ("energy_mean", "energy_error", "energy_variance", "step_time")}
    assert len(lengths) == 1, f"lists of different lengths {lengths}"
    n = lengths.pop()
    if n_steps is not None:
        assert n == n_steps
    assert all(np.isfinite(log["energy_mean"])) and all(e >= 0 for e in log["energy_error"])
    assert all(t > 0 for t in log["step_time"])
    return n


def steps_in(log_path: Path) -> int:
    """The steps a run's ``log.json`` holds so far (0 while it is missing or half written)."""
    try:
        return len(json.loads(log_path.read_text())["energy_mean"])
    except (OSError, ValueError, KeyError):
        return 0


def is_png(path: Path) -> bool:
    """Asserts ``path`` is a PNG of a plot (more than 100 x 100 pixels, colour)."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return True


# --- a synthetic checkpoint (tests/test_cli_resume.py, test_cli_messages.py) ----------------------

SYNTHETIC_CONFIG = {
    "command": "vmc",
    "system": "heisenberg1d",
    "L": 8,
    "model": "rbm",
    "samples": 128,
    "chunk_size": 24,
    "steps": 6,
    "lr": 0.05,
    "diag_shift": 0.01,
    "seed": 3,
    "devices": None,
    "out": "x",
    "checkpoint_every": 10,
    "resume": None,
    "coordinator": None,
    "num_processes": None,
    "process_id": None,
    "distributed_timeout": 60,
}


def synthetic_checkpoint(folder: Path, *, step=4, version=None, **config) -> Path:
    """A checkpoint file with ``SYNTHETIC_CONFIG`` (updated by ``config``) and an empty state, in
    ``folder``."""
    import vmcgrad
    from vmcgrad.cli import _checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    snap = {
        "format": _checkpoint.FORMAT,
        "versions": {"vmcgrad": version or vmcgrad.__version__},
        "step": step,
        "config": json.dumps({**SYNTHETIC_CONFIG, "out": str(folder), **config}),
        "info": json.dumps({"versions": {}}),
        "records": json.dumps([[-1.0, 0.1, 1.0, 0.5, 0.01]] * step),
        "variables": {},
        "sampler_state": {},
        "optimizer_state": {},
        "driver": {},
    }
    path = folder / _checkpoint.CHECKPOINT
    path.write_bytes(_checkpoint.encode(snap))
    (folder / "log.json").write_text('{"kept": true}\n')
    return path


def sequential_ops(text: str) -> tuple[float, list[int | None]]:
    """``(ops, trips)`` of a compiled program (``compiled.as_text()``): the ops it runs one after
    another (:func:`vmcgrad.program_cost`: loops by their trip counts, nested) and the trip count of
    every loop, inner loops included."""
    import vmcgrad

    cost = vmcgrad.program_cost(text)
    trips: list[int | None] = []

    def walk(loops):
        for loop in loops:
            trips.append(loop.trip_count)
            walk(loop.loops)

    walk(cost.loops)
    return cost.ops, trips
