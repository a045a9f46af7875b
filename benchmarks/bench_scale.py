"""Scale benchmarks: largest N per gradient step under a memory budget; simulated scale-out table.

Usage (with vmcgrad installed, ``pip install -e .``, or ``PYTHONPATH=.`` in a checkout)::

    python benchmarks/bench_scale.py                          # both parts, default settings
    python benchmarks/bench_scale.py --part memory --budgets-mib 16 64 256 --alpha 4
    python benchmarks/bench_scale.py --part scaleout --devices 1 2 4 --processes 2 --json rows.json

Part ``memory`` (one process, one CPU device, compile only): for each budget, the largest
power-of-two N whose VMC gradient step (RBMModPhase, int8 samples, complex local values) fits in
temp + argument + output bytes per device: ``vmcgrad.expect_grad(chunk_size="auto")`` vs NetKet's
chunked force at a fixed user chunk (``--netket-chunks``) vs NetKet unchunked.

Part ``scaleout``: ``batched_vjp`` (RBM) and ``expect_grad`` (RBMModPhase) with their NetKet and
``jax.vjp`` counterparts at a fixed global N, on 1, 2, 4 fake CPU devices (one subprocess per
count) and on ``--processes`` processes × 2 devices (JAX's distributed runtime, coordinator and gloo
collectives on 127.0.0.1 only, a free port, every child killed on timeout): per-device compiled
temp/argument memory, collectives per call (in loop bodies / outside), median time per call.

Every part runs in child processes (the device count is fixed per process); ``--child`` is the
internal entry point of those children.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", choices=["memory", "scaleout"], default=["memory", "scaleout"])
    ap.add_argument("--budgets-mib", type=float, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--alpha", type=int, default=4, help="RBMModPhase alpha for the memory part")
    ap.add_argument("--netket-chunks", type=int, nargs="+", default=[1024], help="NetKet's fixed chunk(s)")
    ap.add_argument("--vmcgrad-chunks", type=int, nargs="*", default=[1024], help="vmcgrad fixed chunk(s)")
    ap.add_argument("--n-min", type=int, default=4096, help="memory part: smallest N tried")
    ap.add_argument("--n-max", type=int, default=2**22, help="memory part: largest N tried")
    ap.add_argument("--devices", type=int, nargs="*", default=[1, 2, 4], help="scaleout: device counts")
    ap.add_argument("--processes", type=int, default=2, help="scaleout: processes (x2 devices); 0: none")
    ap.add_argument("--L", type=int, default=48, help="spins")
    ap.add_argument("--n-samples", type=int, default=16384, help="scaleout: global N")
    ap.add_argument("--chunk-size", type=int, default=512, help="scaleout: chunk per device")
    ap.add_argument("--repeats", type=int, default=7, help="scaleout: interleaved timed calls")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per child run")
    ap.add_argument("--json", metavar="PATH", help="write all rows as JSON here")
    ap.add_argument("--child", choices=["memory", "scaleout", "worker"], help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args()


def child(args: argparse.Namespace) -> None:
    """One child: set the devices up before JAX/NetKet are used, run one part, write JSON."""
    if args.child == "worker":
        from benchlib.scale import init_distributed

        init_distributed(args.process_id, args.processes, args.port, devices_per_process=2)
    else:
        from benchlib import use_cpu_devices

        use_cpu_devices(args.devices[0] if args.child == "scaleout" else 1)
    import warnings

    import netket  # noqa: F401  (sets NetKet's global mesh "S" over jax.devices(): all processes')
    from benchlib import scale

    warnings.filterwarnings("ignore", category=UserWarning)
    log = lambda s: print(s, flush=True)
    if args.child == "memory":
        rows = scale.largest_n_table(
            budgets_mib=args.budgets_mib,
            L=args.L,
            alpha=args.alpha,
            netket_chunks=args.netket_chunks,
            vmcgrad_chunks=args.vmcgrad_chunks,
            n_min=args.n_min,
            n_max=args.n_max,
            log=log,
        )
    else:
        kw = dict(L=args.L, n_samples=args.n_samples, chunk_size=args.chunk_size, repeats=args.repeats)
        rows = scale.scale_out_rows(**kw, log=log)
    if args.process_id == 0:
        from benchlib import write_json

        write_json(rows, args.json)
    if args.child == "worker":
        import jax

        jax.distributed.shutdown()


def spawn(args: argparse.Namespace, kind: str, *, devices: int = 1, processes: int = 1) -> list[dict]:
    """Runs one child (or ``processes`` workers) and returns the rows process 0 wrote."""
    from benchlib.scale import clean_env, launch_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        base = [sys.executable, __file__, "--child", kind, "--json", out, "--L", str(args.L)]
        base += ["--budgets-mib", *map(str, args.budgets_mib), "--alpha", str(args.alpha)]
        base += ["--netket-chunks", *map(str, args.netket_chunks), "--n-min", str(args.n_min)]
        base += ["--vmcgrad-chunks", *map(str, args.vmcgrad_chunks)]
        base += ["--n-max", str(args.n_max), "--n-samples", str(args.n_samples)]
        base += ["--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats)]
        base += ["--devices", str(devices), "--processes", str(processes)]

        def command(pid: int, port: int) -> list[str]:
            return [*base, "--process-id", str(pid), "--port", str(port)]

        logs = launch_processes(command, processes, timeout=args.timeout, env=clean_env())
        for pid, log in enumerate(logs):
            lines = [ln for ln in log.splitlines() if ln.startswith(("[{", "[budget"))]
            print("\n".join(f"  ({kind}, p{pid}) {ln}" for ln in lines), flush=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    args = parse()
    if args.child:
        child(args)
        return
    from benchlib.scale import format_largest_n, format_scale_out

    rows: dict[str, list[dict]] = {}
    if "memory" in args.part:
        rows["memory"] = spawn(args, "memory")
    if "scaleout" in args.part:
        rows["scaleout"] = []
        for n in args.devices:
            rows["scaleout"] += spawn(args, "scaleout", devices=n)
        if args.processes > 1:
            rows["scaleout"] += spawn(args, "worker", processes=args.processes)
    from benchlib import write_json

    write_json(rows, args.json)
    if "memory" in rows:
        print(
            f"\nLargest N per gradient step (RBMModPhase alpha={args.alpha}, L={args.L}, int8 samples, "
            "1 CPU device): per-device temp + argument + output bytes of the compiled step <= budget"
        )
        print(format_largest_n(rows["memory"]))
    if "scaleout" in rows:
        print(
            f"\nScale-out, global N={args.n_samples}, L={args.L}, chunk={args.chunk_size} per device, "
            f"repeats={args.repeats} (batched_vjp: RBM float64; expect_grad: RBMModPhase)"
        )
        print(format_scale_out(rows["scaleout"]))


if __name__ == "__main__":
    main()
