"""The computations compared between a multi-process run and a single-process one."""

import jax
import jax.numpy as jnp
from helpers import make_case

import vmcgrad

N = 4 * 37 + 8  # 164 samples: 41 per device on 4 devices, not divisible by the chunk size


#: rtol of the multi-process vs single-process comparison (1e-12 unless listed)
RTOL = {"qgt_solve": 1e-9}


def computations(place):
    """name -> no-argument callable; ``place`` puts a sample-shaped host array on the devices."""
    fun, params, samples = make_case("r2c", N)
    ct = (jnp.linspace(-1.0, 1.0, N) + 0.5j).astype(jnp.complex128)
    x, c = place(samples), place(ct)
    return {
        "batched_vjp": lambda: vmcgrad.batched_vjp(fun, params, x, c, chunk_size=5),
        "batched_jvp": lambda: vmcgrad.batched_jvp(fun, params, x, params, chunk_size=5),
        "batched_vjp_jit": lambda: jax.jit(lambda p, x, c: vmcgrad.batched_vjp(fun, p, x, c, chunk_size=7))(
            params, x, c
        ),
        "expect_grad": lambda: vmcgrad.expect_grad(fun, params, x, c, chunk_size=5),
        "qgt_matmul": lambda: vmcgrad.QGT(fun, params, x, chunk_size=5, diag_shift=1e-3) @ params,
        # a converged solve: its answer is defined to ~cond(S)·eps, not to the reduction order
        "qgt_solve": lambda: vmcgrad.QGT(fun, params, x, chunk_size=5, diag_shift=1e-1).solve(
            params, tol=1e-13, maxiter=500
        )[0],
    }
