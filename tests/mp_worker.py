"""One process of a multi-process run (launched by test_multiprocess.py; not a test module).

Usage: python mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_FILE
Joins JAX's distributed runtime on 127.0.0.1 only (coordinator bound to loopback, gloo CPU
collectives), builds global arrays sharded over every process's devices, runs vmcgrad and writes
the (replicated) results of this process to OUT_FILE as .npz.
"""

import sys

import jax

pid, nproc, port, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
from vmcgrad._distributed import initialize_distributed

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_x64", True)
# coordinator and gloo collectives both bound to 127.0.0.1
initialize_distributed(f"127.0.0.1:{port}", nproc, pid)

import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mp_cases import computations

mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))


def global_array(a):
    """A global array sharded over all processes' devices from the same host value everywhere."""
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P("S")), lambda idx: a[idx])


results = {}
with jax.set_mesh(mesh):
    for name, compute in computations(global_array).items():
        out = compute()
        for i, leaf in enumerate(jax.tree.leaves(out)):
            # results are replicated (or sharded for per-sample outputs): gather to host
            results[f"{name}/{i}"] = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
np.savez(out_file, **results)
print(f"process {pid}: wrote {len(results)} arrays", flush=True)
jax.distributed.shutdown()
