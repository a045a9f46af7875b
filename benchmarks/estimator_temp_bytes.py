"""Compiled temp bytes of every estimator (compile only, CPU).

Usage (with vmcgrad installed, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/estimator_temp_bytes.py               # one device
    python benchmarks/estimator_temp_bytes.py --devices 4   # samples split over 4 fake CPU devices

Two tables:

1. **Every estimator, two N.** A tanh layer W (256 × 1024, float64), chunk 256, N = 4096 and
   16384: ``batched_vjp``, ``expect_grad``, ``batched_jvp`` and ``QGT @ v``. Run it at two commits
   to compare a change of the core. The bytes should not grow with N.
2. **Scan-over-layers models against the seed's recipe** (float32, N = 4096, chunk 64): the seed's
   ``mubatch_loss`` with a tanh (3 × 256 × 256 and 3 × 1024 × 1024), a complex-output scan model
   through ``expect_grad``, a 6-layer flax ``nn.scan`` model, and ``QGT @ v`` / the QGT's mean pass
   on the first. On one device each estimator is compared with a hand-written loop of
   ``f_vjp.with_refs(acc)(ct)`` (the seed discussion's program without sharding); the target is
   at most 1.05× (issue 18). With ``--devices 4`` the samples are split over a mesh and only
   vmcgrad's bytes are printed (compare two commits).
"""

import argparse

import jax

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=1, help="fake CPU devices (samples split over them)")
ARGS = parser.parse_args()
jax.config.update("jax_num_cpu_devices", ARGS.devices)
jax.config.update("jax_enable_x64", True)  # table 1 is float64; table 2 sets float32 explicitly

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import vmcgrad  # noqa: E402

N_SCAN, C_SCAN = 4096, 64


def temp(lowered) -> int:
    return lowered.compile().memory_analysis().temp_size_in_bytes


def on_mesh(x):
    """``x`` split over all devices along axis 0 (as is, on one device)."""
    if jax.device_count() == 1:
        return x
    mesh = jax.make_mesh((jax.device_count(),), ("S",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("S")))


def every_estimator() -> None:
    w = jnp.ones((256, 1024)) / 100
    fun = lambda w, x: jnp.sum(jnp.tanh(x @ w), -1)
    for n in (4096, 16384):
        x, ct = on_mesh(jnp.ones((n, 256))), on_mesh(jnp.ones(n))
        rows = {
            "batched_vjp": vmcgrad.lower(vmcgrad.batched_vjp, fun, w, x, ct, chunk_size=256),
            "expect_grad": vmcgrad.lower(vmcgrad.expect_grad, fun, w, x, ct, chunk_size=256),
            "batched_jvp": vmcgrad.lower(vmcgrad.batched_jvp, fun, w, x, w, chunk_size=256),
            "QGT @ v": jax.jit(lambda S, v: S @ v).lower(vmcgrad.QGT(fun, w, x, chunk_size=256), w),
        }
        for name, lowered in rows.items():
            print(f"N={n:6d} {name:12s} temp bytes {temp(lowered):>12,d}")


def seed_model(Ws, xs):
    act, _ = jax.lax.scan(lambda a, W: (jnp.tanh(a @ W), None), xs, Ws)
    return jnp.sum(act, axis=-1)


def complex_model(Ws, xs):
    act, _ = jax.lax.scan(lambda a, W: (jnp.tanh(a @ W), None), xs, Ws)
    return jnp.sum(act, axis=-1) + 1j * jnp.sum(act**2, axis=-1)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(x.shape[-1])(x)), None


class ScanNet(nn.Module):
    """Six Dense + tanh layers stacked with flax's ``nn.scan``."""

    layers: int = 6

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = scan()(x, None)
        return jnp.sum(x, -1)


def with_refs_loop(fun, params, xs, ct) -> int:
    """The seed's recipe by hand on one device: ``f_vjp.with_refs(acc)(ct)`` per chunk."""

    @jax.jit
    def run(params, xs, ct):
        acc = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

        def body(k, _):
            x = jax.lax.dynamic_slice_in_dim(xs, k * C_SCAN, C_SCAN)
            c = jax.lax.dynamic_slice_in_dim(ct, k * C_SCAN, C_SCAN)
            _, f_vjp = jax.vjp(lambda p: fun(p, x), params)
            f_vjp.with_refs(acc)(c)

        jax.lax.fori_loop(0, xs.shape[0] // C_SCAN, body, None)
        return jax.tree.map(jax.ref.freeze, acc)

    return temp(run.lower(params, xs, ct))


def scan_models() -> None:
    key = jax.random.key(0)
    one = jax.device_count() == 1
    ones = jnp.ones(N_SCAN, jnp.float32)
    local = jnp.linspace(-1, 1, N_SCAN).astype(jnp.complex64) * (1 + 0.5j)
    centred = jnp.conj(local - local.mean()) / N_SCAN
    rows = []
    for label, layers, d in (("seed 3x256x256", 3, 256), ("seed 3x1024x1024", 3, 1024)):
        Ws = jax.random.normal(key, (layers, d, d), jnp.float32) / d**0.5
        xs = jax.random.normal(key, (N_SCAN, d), jnp.float32)
        ours = vmcgrad.lower(
            vmcgrad.batched_vjp, seed_model, Ws, on_mesh(xs), on_mesh(ones), chunk_size=C_SCAN
        )
        rows.append((f"{label} batched_vjp", temp(ours), one and with_refs_loop(seed_model, Ws, xs, ones)))
        if layers == 3 and d == 256:
            S = vmcgrad.QGT(seed_model, Ws, on_mesh(xs), chunk_size=C_SCAN)
            rows.append((f"{label} QGT @ v", temp(jax.jit(lambda S, v: S @ v).lower(S, Ws)), None))
            mean = jax.jit(lambda p, x: vmcgrad.QGT(seed_model, p, x, chunk_size=C_SCAN).obar)
            rows.append((f"{label} QGT mean pass", temp(mean.lower(Ws, on_mesh(xs))), None))
            cx = vmcgrad.lower(
                vmcgrad.expect_grad, complex_model, Ws, on_mesh(xs), on_mesh(local), chunk_size=C_SCAN
            )
            rows.append(
                ("complex scan expect_grad", temp(cx), one and with_refs_loop(complex_model, Ws, xs, centred))
            )
    model = ScanNet()
    xs = jax.random.normal(key, (N_SCAN, 384), jnp.float32)
    params = model.init(key, xs[:2])
    ours = vmcgrad.lower(
        vmcgrad.batched_vjp, model.apply, params, on_mesh(xs), on_mesh(ones), chunk_size=C_SCAN
    )
    rows.append(
        ("flax nn.scan 6x384 batched_vjp", temp(ours), one and with_refs_loop(model.apply, params, xs, ones))
    )
    for label, ours, ref in rows:
        line = f"{label:34s} vmcgrad {ours:>12,d}"
        if ref:
            line += f"   with_refs loop {ref:>12,d}   ratio {ours / ref:.3f}"
        print(line)


if __name__ == "__main__":
    print(f"{jax.device_count()} device(s)")
    every_estimator()
    scan_models()
