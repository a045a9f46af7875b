"""2 processes × 2 CPU devices on JAX's distributed runtime (127.0.0.1 only) vs one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from helpers import auto_mesh, child_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp_cases import RTOL, computations

HERE = Path(__file__).parent
TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(tmp_path, nproc=2):
    port = free_port()
    env = child_env()  # the suite's compile settings, not its devices
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    procs, outs = [], []
    try:
        for pid in range(nproc):
            out = tmp_path / f"proc{pid}.npz"
            outs.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "mp_worker.py"), str(pid), str(nproc), str(port), str(out)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:  # kill every child, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [dict(np.load(o)) for o in outs]


def test_two_processes_match_one(tmp_path):
    per_process = run_processes(tmp_path)
    mesh = auto_mesh()
    with jax.set_mesh(mesh):
        place = lambda a: jax.device_put(np.asarray(a), NamedSharding(mesh, P("S")))
        single = {
            f"{name}/{i}": np.asarray(leaf)
            for name, compute in computations(place).items()
            for i, leaf in enumerate(jax.tree.leaves(compute()))
        }
    for results in per_process:
        assert results.keys() == single.keys()
        for key, value in single.items():
            rtol = RTOL.get(key.split("/")[0], 1e-12)
            np.testing.assert_allclose(results[key], value, rtol=rtol, atol=rtol / 10, err_msg=key)


def test_loopback_detection_pins_gloo_only_for_loopback_coordinators():
    from vmcgrad._distributed import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("node001") and not is_loopback("compute-0.cluster")
