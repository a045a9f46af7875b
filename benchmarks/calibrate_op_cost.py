r"""The constants of vmcgrad's cost model, measured on this machine's first device.

:func:`vmcgrad.program_cost` models a program's time as

.. math::

    t = n_{\text{ops}}\, t_{\text{op}} + \text{FLOPs}/\text{peak} + \text{bytes}/\text{bandwidth}

with per-platform constants (``vmcgrad._hlo.cost.PLATFORMS``). This script measures them:

- ``t_op``, twice: a chain of k dependent small matmuls (``x = tanh(x @ w)``, an 8×16 by 16×16
  product: two dots cannot fuse, so each link is at least one op; the ops are counted by
  ``program_cost`` on the compiled program, not assumed) and a ``fori_loop`` of k trips of the same
  link, for k in ``--ks``. Each program's time is the median of ``--repeats`` calls after two
  warm-up calls; ``t_op`` is the least-squares slope of time against counted ops (the intercept is
  a call's fixed cost: dispatch and transfer, not an op's);
- the same slope for a chain of small FFTs (``x = fft(x) * 0.5`` on 64 × 16 complex numbers, k/4
  links): what one FFT op costs, which the model counts as any other op;
- ``peak``: an n×n by n×n float32 matmul (2n³ FLOPs) at n and n/2, the slope of FLOPs against time
  (so a call's fixed cost drops out), at JAX's default precision and at ``HIGHEST`` (on a TPU the
  default runs float32 in one bfloat16 pass; the model's float32 figure is ``HIGHEST``'s);
- ``bandwidth``: ``x * 1.5 + 1`` on float32 arrays of m and m/4 elements, one fusion reading and
  writing each (8 bytes an element): the slope of bytes against time.

Sizes depend on the platform (a CPU gets n = 512 and m = 2²², an accelerator n = 8192 and m = 2²⁶),
so that the whole runs in well under a minute on a CPU and on a TPU. Prints one JSON object (and
writes it to ``--json``), with the constants ``program_cost`` now uses for this platform beside
the measured ones.

Usage (PYTHONPATH=. in a checkout)::

    python benchmarks/calibrate_op_cost.py --json calib.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64, 256, 1024], help="chain and loop lengths")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per program (median)")
    ap.add_argument("--matmul-n", type=int, help="n of the matmul (default: 512 on a CPU, else 8192)")
    ap.add_argument("--copy-m", type=int, help="elements of the copy (default: 2**22 on a CPU, else 2**26)")
    ap.add_argument("--json", help="write the result to this file")
    args = ap.parse_args(argv)
    if len(args.ks) < 2 or min(args.ks) < 1:
        ap.error(f"--ks {args.ks}: expected at least two positive lengths (a slope)")
    return args


def median_seconds(fun, *args, repeats: int) -> float:
    """The median wall time of ``fun(*args)``, results blocked on, after two warm-up calls."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fun(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fun(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def slope(xs, ys) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``ys`` against ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return b, my - b * mx


def main(argv=None):
    args = parse(argv)
    import jax
    import jax.numpy as jnp
    from jax import lax

    import vmcgrad
    from vmcgrad._hlo.cost import PLATFORMS

    d = jax.devices()[0]
    platform = d.platform
    cpu = platform == "cpu"
    t_start = time.perf_counter()
    x = jnp.full((8, 16), 0.5, jnp.float32)
    w = jnp.eye(16, dtype=jnp.float32) * 0.9

    def chain(k):
        def f(x, w):
            for _ in range(k):
                x = jnp.tanh(x @ w)
            return x

        return f

    def loop(k):
        return lambda x, w: lax.fori_loop(0, k, lambda i, y: jnp.tanh(y @ w), x)

    result = {"device": f"{jax.device_count()} x {platform} {d.device_kind}", "platform": platform}
    z = jnp.full((64, 16), 0.5 + 0.5j, jnp.complex64)

    def ffts(k):
        def f(z, w):
            for _ in range(k):
                z = jnp.fft.fft(z) * 0.5
            return z

        return f

    for name, build, arg, ks in (
        ("chain", chain, x, args.ks),
        ("loop", loop, x, args.ks),
        ("fft", ffts, z, sorted({max(k // 4, 1) for k in args.ks})),
    ):
        points = []
        for k in ks:
            compiled = jax.jit(build(k)).lower(arg, w).compile()
            cost = vmcgrad.program_cost(compiled)
            seconds = median_seconds(compiled, arg, w, repeats=args.repeats)
            points.append({"k": k, "ops": cost.ops, "median_s": seconds})
        t_op, fixed = slope([p["ops"] for p in points], [p["median_s"] for p in points])
        result[name] = points
        result[f"t_op_{name}_s"] = t_op
        result[f"call_{name}_s"] = fixed

    n = args.matmul_n or (512 if cpu else 8192)
    for precision in ("default", "highest"):
        p = None if precision == "default" else lax.Precision.HIGHEST
        mm = jax.jit(lambda a, b, p=p: jnp.matmul(a, b, precision=p))
        points = []
        for size in (n // 2, n):
            a = jnp.full((size, size), 1.0 / size, jnp.float32)
            seconds = median_seconds(mm, a, a, repeats=args.repeats)
            points.append({"n": size, "flops": 2 * size**3, "median_s": seconds})
        rate, _ = slope([q["median_s"] for q in points], [q["flops"] for q in points])
        result[f"matmul_{precision}"] = {"points": points, "flops_per_s": rate}
    m = args.copy_m or (2**22 if cpu else 2**26)
    points = []
    for size in (m // 4, m):
        big = jnp.ones((size,), jnp.float32)
        seconds = median_seconds(jax.jit(lambda y: y * 1.5 + 1.0), big, repeats=args.repeats)
        points.append({"elements": size, "bytes": 8 * size, "median_s": seconds})
    rate, _ = slope([q["median_s"] for q in points], [q["bytes"] for q in points])
    result["copy"] = {"points": points, "bytes_per_s": rate}

    result["measured"] = {
        "t_op_s": max(result["t_op_chain_s"], 0.0),
        "t_op_loop_s": max(result["t_op_loop_s"], 0.0),
        "t_op_fft_s": max(result["t_op_fft_s"], 0.0),
        "peak_flops": result["matmul_highest"]["flops_per_s"],
        "bandwidth": result["copy"]["bytes_per_s"],
    }
    model = PLATFORMS.get("gpu" if platform in ("cuda", "rocm") else platform)
    if model is not None:
        result["model"] = {
            "t_op_s": model.t_op,
            "peak_flops": model.peak_flops,
            "bandwidth": model.bandwidth,
        }
    result["seconds"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
