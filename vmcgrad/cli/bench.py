"""``vmcgrad bench``: vmcgrad against NetKet and unchunked JAX, all benchmarks in one process.

Runs the benchmark modules of :mod:`vmcgrad.bench` that are present (``core``: ``batched_vjp``;
``grad``: the VMC gradient; ``qgt``: QGT products and solves; ``vmc_step``: a full VMC + SR step) over
a small sweep of sample counts N (at the first chunk size) and chunk sizes (at the largest N). Within
a setting the candidates take turns (:func:`vmcgrad.bench.measure`), so a busy machine slows them
alike. Prints the ratios vmcgrad/NetKet and vmcgrad/unchunked JAX (median time, compiled temp memory)
and the collectives per call (inside loops / outside, from the compiled HLO), and writes
``DIR/bench.json`` (after every benchmark, atomically) and ``DIR/bench.png`` (time and memory against
N and against the chunk size).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import inspect
import platform
import re
import sys
import threading
import time
from pathlib import Path

from . import _interrupt, _output
from ._args import HelpFormatter, positive_int

#: The modules this command imports beyond vmcgrad's own (the ``[cli]`` extra), checked before it starts.
REQUIRES = ("netket", "matplotlib")

#: Benchmark suites: name -> the modules of :mod:`vmcgrad.bench` it runs, in order (``--suite``).
SUITES: dict[str, tuple[str, ...]] = {
    "default": ("core", "grad", "qgt", "vmc_step"),
    "large": (),  # GCNN / ViT at a memory budget: vmcgrad.bench.large's own runner
}

#: Every benchmark module of the suites (``--only`` picks among them).
BENCHES = tuple(dict.fromkeys(b for suite in SUITES.values() for b in suite))


def add_parser(commands) -> None:
    """Adds the ``bench`` sub-command and its options to ``commands`` (an argparse sub-parsers object)."""
    p = commands.add_parser(
        "bench",
        help="time and memory of vmcgrad vs NetKet vs unchunked JAX, in one process",
        description=_plain(__doc__.split("\n\n")[1]),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--suite", choices=list(SUITES), default="default", help="the set of benchmarks to run")
    p.add_argument(
        "--only", nargs="+", choices=BENCHES, default=None, help="run these benchmarks instead of the suite's"
    )
    p.add_argument("--L", type=positive_int, default=32, help="spins of the benchmark models")
    p.add_argument("--samples", type=positive_int, nargs="+", default=[1024, 4096], help="sample counts N")
    p.add_argument(
        "--chunk-sizes", type=positive_int, nargs="+", default=[128, 512], help="chunk sizes (first: N sweep)"
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved timed calls per candidate")
    p.add_argument(
        "--devices",
        type=positive_int,
        default=2,
        help="fake CPU devices (so that the collectives show; 1 for a single device)",
    )
    p.add_argument("--out", default="vmcgrad-bench", metavar="DIR", help="output directory (bench.json/png)")
    p.set_defaults(_command=sys.modules[__name__], _parser=p)


def _plain(rst: str) -> str:
    """reStructuredText roles and literals as plain text, for ``--help``."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", rst).replace("``", "").replace("\n", " ")


def check(args, parser) -> None:
    """Checks the options that depend on the file system; creates nothing."""
    problem = _output.problem_with_out_dir(Path(args.out), ("bench.json", "bench.png"))
    if problem:
        parser.error(f"argument --out: {problem}")


def out_dir(args) -> Path:
    """The directory this run writes (and locks)."""
    return Path(args.out)


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
    from ..bench import MEASURED

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
    from ..bench import Column, table

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


def run(args) -> int:
    """Runs the benchmarks; returns 0, 1 when a benchmark failed (its cross-check, say), or 130 when
    interrupted (the first Ctrl-C stops after the setting in progress, a second one at once; both
    keep ``bench.json`` with the rows measured so far)."""
    if args.suite == "large":  # its own runner: compile-only memory tables and an SR step
        from ..bench.large import run_cli

        return run_cli(Path(args.out), repeats=args.repeats)
    result: dict = {}
    out = Path(args.out)
    summary = Summary(result, args, time.perf_counter())

    def keep() -> str | None:  # a second Ctrl-C: the summary of the settings that finished
        if not result.get("rows"):
            return None
        summary("interrupted")
        return f"kept {out / 'bench.json'} and {out / 'bench.png'} ({len(result['rows'])} rows)"

    with _interrupt.Interrupts(
        "vmcgrad bench", "stopping after this setting (Ctrl-C again to stop at once)", keep
    ) as interrupts:
        return _run(args, interrupts, result, summary)


def _run(args, interrupts, result: dict, summary: Summary) -> int:
    import jax

    names = args.only or list(SUITES[args.suite])
    available = [b for b in names if importlib.util.find_spec(f"vmcgrad.bench.{b}") is not None]
    missing = [b for b in names if b not in available]
    for b in missing:
        print(f"vmcgrad bench: skipping {b}: vmcgrad/bench/{b}.py is not there", file=sys.stderr)
    samples, note = divisible_samples(args.samples, jax.device_count())
    if note:
        print(f"vmcgrad bench: {note}", flush=True)
    pairs = settings(samples, args.chunk_sizes)
    result.update(
        {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": _machine(),
            "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "benches": available,
            "samples_used": samples,
            "missing": missing,
            "errors": [],
            "rows": [],
            "ratios": [],
            "status": "running",
        }
    )
    print(
        f"vmcgrad bench: {', '.join(available) or 'nothing'} on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), L={args.L}, (N, chunk) in {pairs}, {args.repeats} repeats"
    )
    todo = [(name, n, chunk) for name in available for n, chunk in pairs]
    for name, n, chunk in todo:
        if interrupts.requested:
            break
        module = importlib.import_module(f"vmcgrad.bench.{name}")
        accepted = inspect.signature(module.run).parameters
        tag = f"[{name} N={n} chunk={chunk}]"
        kwargs = {"L": args.L, "n_samples": n, "chunk_size": chunk, "repeats": args.repeats}
        kwargs["n_chains"] = jax.device_count() * max(1, min(16, n // jax.device_count()))
        kwargs["log"] = lambda line, tag=tag: print(f"{tag} {line}", flush=True)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        t0 = time.perf_counter()
        try:
            rows = module.run(**kwargs)
        except Exception as error:  # report, keep the other benchmarks
            message = f"{tag} failed: {type(error).__name__}: {error}"
            print(message, file=sys.stderr, flush=True)
            result["errors"].append(message)
            continue
        for row in rows:
            d = row.as_dict()
            d.update(L=args.L, N=n, chunk=chunk, devices=d.get("devices", jax.device_count()))
            result["rows"].append(d)
        print(f"{tag} {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        result["ratios"] = ratios(result["rows"])
        summary.progress()
    summary("interrupted" if interrupts.requested else "finished")
    if missing:
        print(f"not run (modules missing): {', '.join(missing)}")
    if interrupts.requested:
        print(f"interrupted; kept the {len(result['rows'])} rows measured")
        return 130
    return 1 if result["errors"] else 0


class Summary:
    """Writes ``bench.json`` (with the status) and ``bench.png`` from the rows measured so far, and prints
    the table of ratios, once: at the end, after a first Ctrl-C, or from the interrupt watcher on a
    second one, while the main thread may still be measuring. A lock keeps two threads from drawing
    at once (matplotlib is not thread-safe); ``result`` is only read here (the main thread writes it).

    Raises:
        _output.OutputError: if a file cannot be written.
    """

    def __init__(self, result: dict, args, t_start: float):
        self.result, self.args, self.t_start = result, args, t_start
        self._lock = threading.Lock()
        self._done = False

    def progress(self) -> None:
        """Rewrites ``bench.json`` as it stands (status "running"), unless the summary was written."""
        with self._lock:
            if not self._done:
                _output.write_json_atomic(Path(self.args.out) / "bench.json", self.result)

    def __call__(self, status: str) -> None:
        with self._lock:
            if not self._done:
                _summary(dict(self.result), self.args, self.t_start, status)
                self._done = True


def _summary(result: dict, args, t_start: float, status: str) -> None:
    out = Path(args.out)
    rows = list(result["rows"])  # a copy: the main thread may append while this runs
    done = {**result, "rows": rows, "status": status, "ratios": ratios(rows)}
    done["total_s"] = time.perf_counter() - t_start
    _output.write_json_atomic(out / "bench.json", done)
    print()
    print(format_ratios(done["ratios"]))
    print(
        "\nt/x, m/x: vmcgrad's median time and compiled temp memory over x's (NetKet, unchunked jax.vjp); "
        "collectives: inside loops/outside per call.",
        flush=True,
    )
    if rows:
        plot(rows, out / "bench.png", chunk=args.chunk_sizes[0], n=max(result["samples_used"]))
    wrote = f"{out / 'bench.json'} and {out / 'bench.png'}" if rows else f"{out / 'bench.json'} (no rows)"
    print(f"wrote {wrote} in {done['total_s']:.0f} s", flush=True)


def _machine() -> dict:
    import os

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
    from ..bench import MEASURED

    other = ",".join(f"{v}" for k, v in row.items() if k not in MEASURED | _SHOWN)
    return f"{row['bench']} ({other})" if other else row["bench"]


def plot(rows: list[dict], path: Path, *, chunk: int, n: int) -> None:
    """One row of panels per benchmark: time and temp memory against N (at chunk size ``chunk``) and
    against the chunk size (at ``n``), one line per implementation."""
    plt = _output.pyplot()
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
    _output.save_figure_atomic(fig, path)
    plt.close(fig)
