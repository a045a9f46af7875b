"""The benchmark suite in one process (``python benchmarks/run.py``): vmcgrad, NetKet, unchunked JAX.

Runs the benchmark modules ``core`` (``batched_vjp``), ``grad`` (the VMC gradient), ``qgt`` (QGT products
and solves) and ``vmc_step`` (a full VMC + SR step) over a small sweep of sample counts N (at the first
chunk size) and chunk sizes (at the largest N). Within a setting the candidates take turns
(:func:`benchlib.measure`), so a busy machine slows them alike. Prints the ratios vmcgrad/NetKet and
vmcgrad/unchunked JAX (median time, compiled temp memory) and the collectives per call (inside loops /
outside, from the compiled HLO), and writes ``DIR/bench.json`` (after every benchmark, atomically) and
``DIR/bench.png`` (time and memory against N and against the chunk size). Ctrl-C or SIGTERM stops it
with the same summary of the settings that finished (status "interrupted", exit status 130).
``--suite large`` runs ``benchmarks/bench_large.py`` with its defaults instead (``DIR/large.json``).

With the defaults (L=32, N in 1024 4096, chunks 128 512, 2 fake CPU devices, 3 repeats) the suite
takes 8 minutes or more on a shared 2-core CPU machine (2026-12); ``--only grad --L 8 --samples 256
--chunk-sizes 64 --repeats 1`` took 43 s there (2026-12-01), compilation included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import sys
import time
from pathlib import Path

from ._harness import MEASURED
from ._io import save_figure, write_json
from ._table import Column, table

#: The benchmark modules of the default suite, in order (``--only`` picks among them).
BENCHES = ("core", "grad", "qgt", "vmc_step")

#: Options of the default suite that ``--suite large`` does not take (bench_large.py has its own).
NOT_FOR_LARGE = ("L", "samples", "chunk_sizes", "only")

DEFAULTS = {"L": 32, "samples": [1024, 4096], "chunk_sizes": [128, 512]}


def positive_int(text: str) -> int:
    """An integer >= 1, for argparse.

    Examples:
        >>> positive_int("12")
        12
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``benchmarks/run.py``."""
    p = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description=" ".join(__doc__.split("\n\n")[1:3]).replace("``", "").replace(":func:", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--suite", choices=["default", "large"], default="default", help="the benchmarks to run")
    p.add_argument("--only", nargs="+", choices=BENCHES, default=None, help="run these benchmarks only")
    p.add_argument("--L", type=positive_int, default=None, help=f"spins (default {DEFAULTS['L']})")
    p.add_argument(
        "--samples", type=positive_int, nargs="+", default=None, help="sample counts N (default 1024 4096)"
    )
    p.add_argument(
        "--chunk-sizes",
        type=positive_int,
        nargs="+",
        default=None,
        help="chunk sizes, the first for the N sweep (default 128 512)",
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved timed calls per candidate")
    p.add_argument(
        "--devices", type=positive_int, default=2, help="fake CPU devices (so that the collectives show)"
    )
    p.add_argument("--out", default="vmcgrad-bench", metavar="DIR", help="output directory")
    return p


def parse(argv=None) -> argparse.Namespace:
    """Parses ``argv``; ``--suite large`` with an option only the default suite takes is a usage error
    (exit 2) rather than an option silently ignored."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite == "large":
        given = [f"--{k.replace('_', '-')}" for k in NOT_FOR_LARGE if getattr(args, k) is not None]
        if given:
            parser.error(
                f"{' '.join(given)} not taken by --suite large, which runs benchmarks/bench_large.py "
                "with its defaults; run `python benchmarks/bench_large.py --help` for its own options"
            )
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def divisible_samples(samples: list[int], n_devices: int) -> tuple[list[int], str | None]:
    """Each sample count rounded up to a multiple of the device count (the samples are split evenly
    over the devices), duplicates dropped; and a note saying so when any count changed.

    Examples:
        >>> divisible_samples([10, 12, 1024], 3)[0]
        [12, 1026]
        >>> print(divisible_samples([10], 3)[1])
        note: --samples 10 is not a multiple of the 3 devices; using 12 (each device takes an equal share)
        >>> divisible_samples([1024], 2)
        ([1024], None)
    """
    rounded = [-(-n // n_devices) * n_devices for n in samples]
    changed = [str(n) for n, r in zip(samples, rounded) if n != r]
    used = list(dict.fromkeys(rounded))
    if not changed:
        return used, None
    what = "is not a multiple" if len(changed) == 1 else "are not multiples"
    return used, (
        f"note: --samples {' '.join(changed)} {what} of the {n_devices} devices; using "
        f"{' '.join(map(str, used))} (each device takes an equal share)"
    )


def settings(samples: list[int], chunk_sizes: list[int]) -> list[tuple[int, int]]:
    """``(N, chunk)`` pairs: every N at the first chunk size, then every other chunk size at the largest N.

    Examples:
        >>> settings([1024, 4096], [128, 512])
        [(1024, 128), (4096, 128), (4096, 512)]
    """
    first, largest = chunk_sizes[0], max(samples)
    pairs = [(n, first) for n in samples]
    pairs += [(largest, c) for c in chunk_sizes[1:] if (largest, c) not in pairs]
    return pairs


def _baseline(name: str) -> str | None:
    if name.startswith("netket"):
        return "netket"
    if name.startswith("jax"):
        return "jax"
    return None


def ratios(rows: list[dict]) -> list[dict]:
    """For every vmcgrad candidate: time and temp-memory ratios against the NetKet and plain-JAX rows of
    the same benchmark and setting, and the collectives (in loops / outside) of each."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        setting = tuple((k, v) for k, v in r.items() if k not in MEASURED)
        groups.setdefault(setting, []).append(r)
    out = []
    for setting, group in groups.items():
        bases = {}
        for r in group:
            b = _baseline(r["name"])
            if b and b not in bases:
                bases[b] = r
        for r in group:
            if not r["name"].startswith("vmcgrad"):
                continue
            entry = dict(setting, name=r["name"], median_s=r["median_s"], temp_bytes=r["temp_bytes"])
            entry["setting_keys"] = [k for k, _ in setting]
            entry["collectives"] = _coll(r)
            for b, base in bases.items():
                entry[f"time_vs_{b}"] = r["median_s"] / base["median_s"]
                entry[f"memory_vs_{b}"] = (
                    r["temp_bytes"] / base["temp_bytes"] if r["temp_bytes"] and base["temp_bytes"] else None
                )
                entry[f"collectives_{b}"] = _coll(base)
            out.append(entry)
    return out


BASES = ("netket", "jax")

_SHOWN = {"bench", "N", "chunk", "L", "devices"}


def _coll(row: dict) -> str | None:
    if row.get("collectives_in_loops") is None:
        return None
    return f"{row['collectives_in_loops']}/{row['collectives_outside']}"


def format_ratios(entries: list[dict]) -> str:
    """The summary table: one line per vmcgrad candidate and setting."""

    def other(e):
        return ",".join(str(v) for k, v in e.items() if k in e["setting_keys"] and k not in _SHOWN) or "-"

    def coll(e):
        return " ".join(str(e.get(k) or "-") for k in ("collectives", *(f"collectives_{b}" for b in BASES)))

    return table(
        entries,
        [
            Column("bench", "bench", align="<"),
            Column("N", "N"),
            Column("chunk", "chunk"),
            Column("other", other, align="<"),
            Column("vmcgrad impl", "name", align="<"),
            Column("ms", lambda e: e["median_s"] * 1e3, ".2f"),
            Column("t/netket", "time_vs_netket", ".2f"),
            Column("m/netket", "memory_vs_netket", ".2f"),
            Column("t/jax", "time_vs_jax", ".2f"),
            Column("m/jax", "memory_vs_jax", ".2f"),
            Column("collectives loop/out: vg nk jax", coll, align="<"),
        ],
    )


def main(argv=None) -> int:
    """Runs the suite; returns 0, 1 when a benchmark failed (its cross-check, say), 2 on a usage error,
    or 130 when interrupted by Ctrl-C or SIGTERM (the summary of the settings that finished is written
    then as at the end: ``bench.json``, ``bench.png`` and the table of ratios)."""
    args = parse(argv)
    out = Path(args.out)
    if args.suite == "large":  # benchmarks/bench_large.py (benchmarks/ is on sys.path: the scripts' folder)
        import bench_large

        argv = [
            "--devices",
            str(args.devices),
            "--repeats",
            str(args.repeats),
            "--json",
            str(out / "large.json"),
        ]
        return bench_large.main(argv)
    from ._harness import use_cpu_devices

    result: dict = {}
    stop = Stop()
    summary = Summary(result, args, out, stop)
    with stop:
        try:
            use_cpu_devices(args.devices)
            status = _run(args, out, result, summary, stop)
        except KeyboardInterrupt:
            summary("interrupted")
            status = 130
    if status == 130:
        n = len(result.get("rows", []))
        kept = f"kept the {n} rows measured in {out / 'bench.json'}" if n else "no setting finished"
        print(f"benchmarks/run.py: interrupted; {kept}", file=sys.stderr, flush=True)
    return status


class Stop:
    """Ctrl-C and SIGTERM while the suite runs (a context manager, entered in the main thread).

    The first signal raises :class:`KeyboardInterrupt` in the main thread, as Python does for Ctrl-C
    (SIGTERM would otherwise end the process with nothing written), and every signal sets
    :attr:`requested`, which the loop over settings reads too: an exception that JAX swallows (one
    raised inside a garbage-collection callback is printed and lost) still stops the suite after the
    setting in progress. Later signals, and any inside :meth:`held`, only set :attr:`requested`, so
    that nothing interrupts the summary or a write of ``bench.json``.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.raised = False
        self.holding = False
        self.previous: dict = {}

    def __enter__(self) -> Stop:
        self.previous = {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        self.requested = True
        if not (self.raised or self.holding):
            self.raised = True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self):
        """Within the block, a signal only sets :attr:`requested`."""
        holding, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = holding


class Summary:
    """Writes ``bench.json`` (with the status), ``bench.png`` and the table of ratios of the rows measured
    so far, once: at the end, or when a stop is asked for (the first call wins; later ones, a second
    Ctrl-C in the middle of a summary included, change nothing). Signals are held off while it writes
    (:meth:`Stop.held`), so that a second Ctrl-C cannot leave half of it.
    """

    def __init__(self, result: dict, args, out: Path, stop: Stop):
        self.result, self.args, self.out, self.stop = result, args, out, stop
        self.t_start = time.perf_counter()
        self.done = False

    def __call__(self, status: str) -> None:
        with self.stop.held():
            if self.done or "rows" not in self.result:  # written, or stopped before the suite started
                return
            self.done = True
            self.write(status)

    def write(self, status: str) -> None:
        out, result = self.out, self.result
        rows = result["rows"]
        result.update(status=status, ratios=ratios(rows), total_s=time.perf_counter() - self.t_start)
        write_json(result, out / "bench.json")
        if rows:
            plot(rows, out / "bench.png", chunk=self.args.chunk_sizes[0], n=max(result["samples_used"]))
        print()
        print(format_ratios(result["ratios"]))
        wrote = f"{out / 'bench.json'} and {out / 'bench.png'}" if rows else f"{out / 'bench.json'} (no rows)"
        print(
            "\nt/x, m/x: vmcgrad's median time and compiled temp memory over x's (NetKet, unchunked "
            "jax.vjp); collectives: inside loops/outside per call.",
        )
        print(f"wrote {wrote} in {result['total_s']:.0f} s", flush=True)


def _run(args, out: Path, result: dict, summary: Summary, stop: Stop) -> int:
    import jax

    from . import core, grad, qgt, vmc_step

    modules = {"core": core, "grad": grad, "qgt": qgt, "vmc_step": vmc_step}
    names = args.only or list(BENCHES)
    samples, note = divisible_samples(args.samples, jax.device_count())
    if note:
        print(f"benchmarks/run.py: {note}", flush=True)
    pairs = settings(samples, args.chunk_sizes)
    result.update(
        {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": _machine(),
            "config": vars(args),
            "benches": names,
            "samples_used": samples,
            "errors": [],
            "rows": [],
            "ratios": [],
            "status": "running",
        }
    )
    print(
        f"benchmarks/run.py: {', '.join(names)} on {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), L={args.L}, (N, chunk) in {pairs}, {args.repeats} repeats"
    )
    for name, n, chunk in [(name, n, chunk) for name in names for n, chunk in pairs]:
        if stop.requested:  # a KeyboardInterrupt that JAX swallowed
            break
        tag = f"[{name} N={n} chunk={chunk}]"
        kwargs = {"L": args.L, "n_samples": n, "chunk_size": chunk, "repeats": args.repeats}
        if name == "vmc_step":
            kwargs["n_chains"] = jax.device_count() * max(1, min(16, n // jax.device_count()))
        t0 = time.perf_counter()
        try:
            rows = modules[name].run(**kwargs, log=lambda line, tag=tag: print(f"{tag} {line}", flush=True))
        except Exception as error:  # report, keep the other benchmarks
            message = f"{tag} failed: {type(error).__name__}: {error}"
            print(message, file=sys.stderr, flush=True)
            result["errors"].append(message)
            continue
        measured = []
        for row in rows:
            d = row.as_dict()
            d.update(L=args.L, N=n, chunk=chunk, devices=d.get("devices", jax.device_count()))
            measured.append(d)
        with stop.held():  # a setting's rows, their ratios and bench.json together
            result["rows"] += measured
            result["ratios"] = ratios(result["rows"])
            write_json(result, out / "bench.json")
        print(f"{tag} {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    status = "interrupted" if stop.requested else "finished"
    summary(status)  # (a signal from here on changes nothing: the suite has finished)
    return 130 if status == "interrupted" else 1 if result["errors"] else 0


def _machine() -> dict:
    import jax

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "jax": jax.__version__,
    }
    try:
        import netket

        info["netket"] = netket.__version__
    except ImportError:
        info["netket"] = None
    return info


def _series_key(row: dict) -> str:
    other = ",".join(f"{v}" for k, v in row.items() if k not in MEASURED | _SHOWN)
    return f"{row['bench']} ({other})" if other else row["bench"]


def plot(rows: list[dict], path: Path, *, chunk: int, n: int) -> None:
    """One row of panels per benchmark: time and temp memory against N (at chunk size ``chunk``) and
    against the chunk size (at ``n``), one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({_series_key(r) for r in rows})
    names = sorted({r["name"] for r in rows})
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(groups), 4, figsize=(14, 2.4 * len(groups) + 0.8), squeeze=False)
    panels = [
        ("N", "chunk", chunk, "median_s", "time [ms]"),
        ("N", "chunk", chunk, "temp_bytes", "temp memory [MiB]"),
        ("chunk", "N", n, "median_s", "time [ms]"),
        ("chunk", "N", n, "temp_bytes", "temp memory [MiB]"),
    ]
    scale = {"median_s": 1e3, "temp_bytes": 2.0**-20}
    for g_i, group in enumerate(groups):
        for p_i, (x_key, fixed_key, fixed, y_key, ylabel) in enumerate(panels):
            ax = axes[g_i, p_i]
            for name in names:
                sel = sorted(
                    (
                        r
                        for r in rows
                        if _series_key(r) == group
                        and r["name"] == name
                        and r[fixed_key] == fixed
                        and r[y_key] is not None
                    ),
                    key=lambda r: r[x_key],
                )
                if sel:
                    ys = [r[y_key] * scale[y_key] for r in sel]
                    ax.plot([r[x_key] for r in sel], ys, "o-", ms=3, color=colors[name], label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            ax.set_ylabel(ylabel, fontsize=8)
            if g_i == len(groups) - 1:
                ax.set_xlabel("samples N" if x_key == "N" else "chunk size", fontsize=8)
            where = f"chunk {chunk}" if x_key == "N" else f"N={n}"
            ax.set_title(f"{group}: {ylabel.split()[0]} vs {x_key} ({where})", fontsize=8)
    handles = [plt.Line2D([], [], color=colors[name], marker="o", ms=3, label=name) for name in names]
    fig.legend(handles=handles, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.5 / (2.4 * len(groups) + 0.8), 1, 1))
    save_figure(fig, path)
    plt.close(fig)
