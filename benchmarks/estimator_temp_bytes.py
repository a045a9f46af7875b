"""Compiled temp bytes of every estimator at two sample counts (compile only, one CPU device).

Usage (with vmcgrad installed, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/estimator_temp_bytes.py

A tanh layer W (256 × 1024, float64), chunk 256, N = 4096 and 16384: ``batched_vjp``,
``expect_grad``, ``batched_jvp`` and ``QGT @ v``. Run it at two commits to compare a change of the
core (the chunked map-reduce primitive was checked this way against the runner it replaced: equal
bytes for every estimator). The bytes should not grow with N.
"""

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

import vmcgrad  # noqa: E402


def main() -> None:
    w = jnp.ones((256, 1024)) / 100
    fun = lambda w, x: jnp.sum(jnp.tanh(x @ w), -1)
    for n in (4096, 16384):
        x, ct = jnp.ones((n, 256)), jnp.ones(n)
        rows = {
            "batched_vjp": vmcgrad.lower(vmcgrad.batched_vjp, fun, w, x, ct, chunk_size=256),
            "expect_grad": vmcgrad.lower(vmcgrad.expect_grad, fun, w, x, ct, chunk_size=256),
            "batched_jvp": vmcgrad.lower(vmcgrad.batched_jvp, fun, w, x, w, chunk_size=256),
            "QGT @ v": jax.jit(lambda S, v: S @ v).lower(vmcgrad.QGT(fun, w, x, chunk_size=256), w),
        }
        for name, lowered in rows.items():
            temp = lowered.compile().memory_analysis().temp_size_in_bytes
            print(f"N={n:6d} {name:12s} temp bytes {temp:>10,d}")


if __name__ == "__main__":
    main()
