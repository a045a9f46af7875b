"""NetKet's TDVP driver with ``vmcgrad.netket.QGTOnTheFly`` against ``QGTJacobianDense`` (float64).

``nkx.driver.TDVP(H, vstate, integrator, qgt=..., linear_solver=...)`` calls, every stage,
``vstate.expect_and_forces(H)`` (NetKet's own here: the two runs differ only in the QGT),
``qgt(vstate)``, ``qgt.solve(linear_solver, forces, x0=last solution)``, and with
``error_norm="qgt"`` ``qgt @ x``. Both runs use the same seeds and NetKet's ``ExactSampler``, so
they see identical samples at every stage as long as the parameters agree; the comparison is made
after every step, in real and imaginary time, with ``pinv_smooth``, ``cholesky`` and ``cg``, and
with the adaptive ``RK23`` (the accepted times must agree too).

The chunking check records, with ``jax.debug.callback``, the batch sizes the model is *run* on
(host callbacks are safe on one CPU device only: on several it runs in a subprocess on one).
"""

import faulthandler
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import assert_tree_allclose
from jax.nn.initializers import normal

with jax.set_mesh(None):
    import netket as nk
    import netket.experimental as nkx

    import vmcgrad.netket as vnk

N_DEV = jax.device_count()
L = 6
N_SAMPLES = 512
CHUNK = 37  # divides no per-device sample count (512, 128)
DT, N_STEPS = 0.01, 10

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("netket_mesh")]


def ising():
    hi = nk.hilbert.Spin(0.5, L)
    return nk.operator.Ising(hi, nk.graph.Chain(L, pbc=True), h=1.0)


MODELS = {
    "RBMModPhase[float64]": lambda: nk.models.RBMModPhase(alpha=1, param_dtype=np.float64),
    "RBM[float64]": lambda: nk.models.RBM(alpha=1, param_dtype=np.float64),
    "RBM[complex128]": lambda: nk.models.RBM(alpha=1, param_dtype=np.complex128),
}


def make_state(model, hilbert, chunk_size=None):
    vs = nk.vqs.MCState(
        nk.sampler.ExactSampler(hilbert),
        model,
        n_samples=N_SAMPLES,
        seed=1,
        sampler_seed=2,
        chunk_size=chunk_size,
    )
    vs.init_parameters(normal(stddev=0.1), seed=jax.random.key(3))
    return vs


SOLVERS = {
    "pinv_smooth": nk.optimizer.solver.pinv_smooth,
    "cholesky": nk.optimizer.solver.cholesky,
    "cg": functools.partial(jax.scipy.sparse.linalg.cg, tol=1e-12, maxiter=2000),
}


def run_tdvp(qgt, model_name, propagation_type, solver, integrator, error_norm="euclidean", n_steps=N_STEPS):
    """Runs ``n_steps`` steps; returns (time, parameters, energy) at t0 and after every step (the
    driver's callback also runs before the first step)."""
    H = ising()
    vs = make_state(MODELS[model_name](), H.hilbert)
    te = nkx.driver.TDVP(
        H,
        vs,
        integrator,
        qgt=qgt,
        linear_solver=solver,
        propagation_type=propagation_type,
        error_norm=error_norm,
    )
    history = []

    def record(step, log_data, driver):
        history.append((float(driver.t), vs.parameters, complex(log_data["Generator"].mean)))
        return len(history) < n_steps + 1

    te.run(T=1.0, show_progress=False, callback=record)
    assert len(history) == n_steps + 1 and history[0][0] == 0.0
    return history


def assert_same_history(ours, ref):
    assert len(ours) == len(ref)
    for (t, p, e), (t_ref, p_ref, e_ref) in zip(ours, ref):
        assert t == pytest.approx(t_ref, rel=1e-12, abs=1e-14)
        assert_tree_allclose(p, p_ref, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(e, e_ref, rtol=1e-10)


_ISOLATED = "VMCGRAD_TEST_TDVP_ISOLATED"  # set in the child process of each 4-device case
if os.environ.get(_ISOLATED):  # a child: its Python stacks on SIGUSR1 where no gdb takes native ones
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)

CASES = [  # (propagation, model, solver, holomorphic): each solver once, both propagations
    ("real", "RBMModPhase[float64]", "pinv_smooth", None),
    ("real", "RBM[complex128]", "cg", True),
    ("imag", "RBM[float64]", "cholesky", None),
]


@pytest.mark.parametrize(("propagation_type", "model_name", "solver_name", "holomorphic"), CASES)
def test_tdvp_matches_jacobian_dense(propagation_type, model_name, solver_name, holomorphic):
    """10 RK4 steps equal to NetKet's TDVP with QGTJacobianDense, step by step, to 1e-8.

    The shift 1e-3 keeps the linear systems well conditioned, so that the comparison measures the
    QGT and not the amplification of rounding by a near-singular S (with diag_shift=0 and
    pinv_smooth the runs agree to ~2e-8 relative).
    """
    if N_DEV > 1 and not os.environ.get(_ISOLATED):
        in_own_process(
            f"test_tdvp_matches_jacobian_dense[{propagation_type}-{model_name}-{solver_name}-{holomorphic}]"
        )
        return
    kw = {"diag_shift": 1e-3} if holomorphic is None else {"diag_shift": 1e-3, "holomorphic": holomorphic}
    args = (model_name, propagation_type, SOLVERS[solver_name], nkx.dynamics.RK4(dt=DT))
    ref = run_tdvp(nk.optimizer.qgt.QGTJacobianDense(**kw), *args)
    ours = run_tdvp(vnk.QGTOnTheFly(chunk_size=CHUNK, **kw), *args)
    assert_same_history(ours, ref)
    assert ours[-1][0] == pytest.approx(N_STEPS * DT)
    if propagation_type == "imag":  # the energy goes down
        assert ours[-1][2].real < ours[0][2].real - 1e-3


#: Seconds a child TDVP run may take when XLA reports no stall. A whole child (start-up, NetKet's
#: import, compiling, both runs) takes about 10 s in CI (the parent test's duration: 10.5 s for the
#: slowest, .ci/run's --durations); a child that has not ended by then without a stall warning is
#: slow (a loaded host), not stalled, and fails as such, without a retry.
CHILD_TIMEOUT = 300
#: What XLA's CPU collectives print when a device's thread has waited at a rendezvous for
#: ``--xla_cpu_collective_call_warn_stuck_seconds`` (20 s, tests/conftest.py): the mark of a stall.
STALL_MARK = "may be stuck"
#: Runs of a child before its test fails: a child that stalls is killed and run again. In a CI run of
#: 2026-12-06 one child and its retry both stalled: one retry was not enough.
ATTEMPTS = 3
#: XLA's CPU thread pools have max(cores, devices) threads (4 here: no thread to spare for the
#: device whose part of a program is late); NPROC sets the count XLA reads (a larger pool for the
#: children, unless the caller set one).
CHILD_NPROC = str(max(8, 2 * N_DEV))


class ChildStalled(Warning):
    """A 4-device TDVP child stalled in XLA's collectives and was run again (the test still passes);
    the message names the file holding the first stall's native stacks."""


def _native_stacks(pid: int) -> str:
    """Every thread's native stack of process ``pid`` (gdb; XLA's pool threads are ``tf_XLAEigen``),
    or, without gdb, its Python stacks (faulthandler on SIGUSR1, into the child's stderr)."""
    if shutil.which("gdb"):
        command = ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=180).stdout
        except subprocess.TimeoutExpired:
            return "gdb did not finish within 180 s"
    os.kill(pid, signal.SIGUSR1)
    time.sleep(2)
    return "no gdb: the Python stacks are in the child's stderr (faulthandler)"


def watch(
    command: list[str], env: dict, cwd: str, log, timeout: float
) -> tuple[str, subprocess.Popen, float]:
    """Starts ``command`` (its stdout and stderr into the file ``log``) and watches it: returns
    ``(outcome, proc, seconds)``, outcome "ended"; "stalled" as soon as XLA's stall warning
    (:data:`STALL_MARK`) appears (the process left running, for :func:`_native_stacks`); or "slow"
    past ``timeout`` seconds without it (the process group killed)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    outcome = "ended"
    while proc.poll() is None:
        if STALL_MARK in Path(log.name).read_text(errors="replace"):
            outcome = "stalled"
            break
        if time.monotonic() - start > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome = "slow"
            break
        time.sleep(0.5)
    return outcome, proc, time.monotonic() - start


def _run_child(test_id: str, log) -> tuple[str, Any, float]:
    """:func:`watch` of ``test_id`` run in a child pytest, with a larger XLA thread pool."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys"]
    env = {**os.environ, _ISOLATED: "1"}
    env.setdefault("NPROC", CHILD_NPROC)
    command = [*command, "--tier=all", f"{__file__}::{test_id}"]
    return watch(command, env, os.path.dirname(__file__), log, CHILD_TIMEOUT)


def in_own_process(test_id):
    """Runs ``test_id`` (this module's) in a process of its own on the same devices, run again
    (``ATTEMPTS`` in all) when it stalls in XLA's collectives or a signal ends it.

    On 4 fake CPU devices a TDVP run has stalled in an all-reduce: one device's part of a program
    never joined the rendezvous (``xla::cpu::InProcessCommunicator::AllReduce`` waiting; gdb showed
    the main thread in ``PjRtCpuLoadedExecutable::Execute`` and XLA's pool threads idle or in the
    all-reduce, 2026-12-06), in NetKet's reference run and in ours, in different cases, about once a
    CI run, never alone or on one device; XLA then aborted the process. A stall and a slow run are
    told apart by XLA's own warning: a thread that has waited 20 s at a rendezvous prints ``may be
    stuck``. A child that prints it is stalled: the native stacks of its threads are kept (the first
    stall of this process, in a file the :class:`ChildStalled` warning names), it is killed and run
    again. A child that runs past ``CHILD_TIMEOUT`` without it is slow, and fails; a failed
    assertion fails at once. The children get a larger XLA thread pool (``NPROC``)."""
    global _STACKS_KEPT
    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="tdvp-child-") as log:
            outcome, proc, seconds = _run_child(test_id, log)
            print(f"{test_id}: attempt {attempt} {outcome} after {seconds:.0f} s")
            output = Path(log.name).read_text(errors="replace")
            if outcome == "stalled":
                if not _STACKS_KEPT:
                    kept = Path(tempfile.gettempdir()) / f"vmcgrad-tdvp-stall-{os.getpid()}.txt"
                    kept.write_text(
                        f"{test_id}, attempt {attempt}\n{output[-8000:]}\n{_native_stacks(proc.pid)}"
                    )
                    _STACKS_KEPT = str(kept)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                message = f"{test_id}: attempt {attempt} stalled in XLA's collectives ({_STACKS_KEPT})"
                warnings.warn(ChildStalled(message), stacklevel=2)
                if attempt == ATTEMPTS:
                    pytest.fail(f"{test_id}: all {ATTEMPTS} attempts stalled; stacks in {_STACKS_KEPT}")
                continue
            if outcome == "slow":
                load = os.getloadavg()[0]
                pytest.fail(
                    f"{test_id}: slow, not stalled (no XLA stall warning) and not done in {CHILD_TIMEOUT} s "
                    f"(load average {load:.1f}):\n{output[-4000:]}"
                )
            if proc.returncode < 0 and attempt < ATTEMPTS:  # ended by a signal (an abort): again
                print(f"attempt {attempt} ended by signal {-proc.returncode}:\n{output[-4000:]}")
                continue
            break
    assert proc.returncode == 0 and " passed" in output, output[-8000:]


#: The file holding the first stall's native stacks in this process ("" before any stall).
_STACKS_KEPT = ""


def test_tdvp_adaptive_rk23_with_the_qgt_norm():
    """RK23 with error control in the QGT norm (which calls qgt @ x): same accepted steps."""
    if N_DEV > 1 and not os.environ.get(_ISOLATED):
        in_own_process("test_tdvp_adaptive_rk23_with_the_qgt_norm")
        return
    integrator = nkx.dynamics.RK23(dt=DT, adaptive=True, rtol=1e-4, atol=1e-6)
    args = ("RBMModPhase[float64]", "real", SOLVERS["cholesky"], integrator, "qgt")
    ref = run_tdvp(nk.optimizer.qgt.QGTJacobianDense(diag_shift=1e-3), *args, n_steps=6)
    ours = run_tdvp(vnk.QGTOnTheFly(chunk_size=CHUNK, diag_shift=1e-3), *args, n_steps=6)
    assert_same_history(ours, ref)
    dts = np.diff([t for t, _, _ in ours])
    assert not np.allclose(dts, DT), dts  # the controller did change the step


def test_the_watch_tells_a_stalled_child_from_a_slow_one(tmp_path):
    """A child that prints XLA's stall warning is "stalled" at once (and left running for its
    stacks); one that prints nothing past the timeout is "slow" (and killed); one that ends, "ended"."""
    child = "import sys, time; print({!r}, file=sys.stderr, flush=True); time.sleep({})"
    xla = "[id=3] This thread has been waiting for `all-reduce` for 20 seconds and may be stuck."
    cases = {"stalled": (xla, 60), "slow": ("compiling", 60), "ended": ("1 passed", 0)}
    for expected, (text, sleep) in cases.items():
        with open(tmp_path / f"{expected}.log", "w+") as log:
            command = [sys.executable, "-c", child.format(text, sleep)]
            outcome, proc, seconds = watch(command, dict(os.environ), str(tmp_path), log, timeout=5)
        assert outcome == expected and seconds < 30, (outcome, seconds)
        if outcome == "stalled":
            assert proc.poll() is None  # still there for gdb
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.poll() is not None


# --- chunking, seen by a spy -------------------------------------------------------------------

RECORDED: list[int] = []


class Spy(nn.Module):
    """Wraps a model; records at run time the number of configurations each call evaluates."""

    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        rows = math.prod(x.shape[:-1])
        jax.debug.callback(functools.partial(RECORDED.append, rows))
        return self.inner(x)


def in_one_device_subprocess(test_id):
    env = {**os.environ, "VMCGRAD_TEST_DEVICES": "1", "NETKET_EXPERIMENTAL_SHARDING_CPU": "1"}
    out = subprocess.run(
        # --tier=all: the test is named, whatever tier its 1-device run would put it in
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tier=all",
            f"{__file__}::{test_id}",
        ],
        env=env,
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def spy_run(qgt, netket_chunk):
    """Two RK4 steps on the spied state; returns (largest batch during TDVP, largest batch in
    S @ v, S.solve(cg) and S.to_dense() of the QGT the driver built)."""
    H = ising()
    vs = make_state(Spy(nk.models.RBMModPhase(alpha=1, param_dtype=np.float64)), H.hilbert, netket_chunk)
    te = nkx.driver.TDVP(H, vs, nkx.dynamics.RK4(dt=DT), qgt=qgt, linear_solver=SOLVERS["cg"])
    RECORDED.clear()
    te.run(T=2 * DT, show_progress=False)
    jax.effects_barrier()
    during_tdvp = max(RECORDED)
    S = te.qgt(vs)
    jax.block_until_ready(S)
    RECORDED.clear()
    jax.block_until_ready((S @ vs.parameters, S.solve(SOLVERS["cg"], vs.parameters), S.to_dense()))
    jax.effects_barrier()
    return during_tdvp, max(RECORDED)


@pytest.mark.heavy
def test_forces_and_qgt_are_chunked():
    """With NetKet's forces chunked at c (its own MCState.chunk_size) and QGTOnTheFly at c, no
    model call during a TDVP run exceeds c x max_conn rows, and none of the QGT's exceeds c; the
    companion shows the spy sees an unchunked QGT (N rows)."""
    if N_DEV != 1:
        in_one_device_subprocess("test_forces_and_qgt_are_chunked")
        return
    c = 16
    max_conn = ising().max_conn_size
    assert c * max_conn < N_SAMPLES
    during, qgt_rows = spy_run(vnk.QGTOnTheFly(chunk_size=c, diag_shift=1e-3), netket_chunk=c)
    assert 0 < qgt_rows <= c
    assert during <= c * max_conn
    # companion: the same run with the QGT in one chunk of all N samples is caught
    during, qgt_rows = spy_run(vnk.QGTOnTheFly(chunk_size=N_SAMPLES, diag_shift=1e-3), netket_chunk=c)
    assert qgt_rows == N_SAMPLES and during == N_SAMPLES
