"""The one benchmark harness: candidates, their cross-check, interleaved timing, and the ratio table.

Every benchmark builds :class:`Candidate`\\ s computing the same thing, checks that they agree
(:func:`check_agree`) before timing anything, then :func:`measure` calls them in turns and reads
their compiled programs (temp memory, :func:`vmcgrad.collective_report`). Only public vmcgrad
functions are used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ._table import Column, table


@dataclass(frozen=True)
class Candidate:
    """One implementation to measure.

    Attributes:
        name: label in the table, e.g. ``"vmcgrad"``, ``"netket"``, ``"jax.vjp"``.
        call: a no-argument callable running one step; its result is blocked on.
        compiled: optional ``jax.stages.Compiled`` of the same step, for memory and collectives
            (None when the step is not one jitted function, e.g. a NetKet driver step).
    """

    name: str
    call: Callable[[], Any]
    compiled: Any = None


@dataclass
class Row:
    """Measurements of one candidate in one benchmark setting.

    Attributes:
        times: wall-clock seconds of each timed call.
        cpu_times: process CPU seconds (all threads) of the same calls: on a shared, oversubscribed
            machine a steadier measure of the work done than wall-clock medians.
    """

    bench: str
    setting: dict
    name: str
    times: list[float] = field(default_factory=list)
    temp_bytes: int | None = None
    collectives_in_loops: int | None = None
    collectives_outside: int | None = None
    cpu_times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def as_dict(self) -> dict:
        return {
            "bench": self.bench,
            **self.setting,
            "name": self.name,
            "median_s": self.median,
            "times_s": self.times,
            "cpu_s": self.cpu_times,
            "temp_bytes": self.temp_bytes,
            "collectives_in_loops": self.collectives_in_loops,
            "collectives_outside": self.collectives_outside,
        }


#: Keys of :meth:`Row.as_dict` that are measurements; the others describe the setting.
MEASURED = frozenset(
    {"name", "median_s", "times_s", "cpu_s", "temp_bytes", "collectives_in_loops", "collectives_outside"}
)


def measure(bench: str, setting: dict, candidates: Sequence[Candidate], *, repeats: int = 7) -> list[Row]:
    """Times the candidates in turns (one warm-up call each first) and reads their compiled programs.

    Each timed call records its wall time and its process CPU time; the warm-up call (compilation)
    records neither.

    Returns:
        One :class:`Row` per candidate, in the order given.
    """
    import vmcgrad

    rows = [Row(bench, dict(setting), c.name) for c in candidates]
    for c in candidates:
        jax.block_until_ready(c.call())  # compile and warm up
    for _ in range(repeats):
        for c, row in zip(candidates, rows):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(c.call())
            row.times.append(time.perf_counter() - t0)
            row.cpu_times.append(time.process_time() - c0)
    for c, row in zip(candidates, rows):
        if c.compiled is not None:
            row.temp_bytes = c.compiled.memory_analysis().temp_size_in_bytes
            report = vmcgrad.collective_report(c.compiled)
            row.collectives_in_loops = report.total_in_loops
            row.collectives_outside = report.total_outside
    return rows


def checked_candidates(
    fns: dict[str, Callable], args: dict[str, tuple] | tuple, *, reference: str, rtol: float
) -> tuple[list[Candidate], dict[str, float], dict[str, Any]]:
    """Runs the jitted functions (``reference`` first), checks that they agree (:func:`check_agree`),
    and makes one :class:`Candidate` of each, in the order of ``fns``, with its compiled program.

    Args:
        fns: name -> jitted function.
        args: the arguments of every function, or name -> its arguments.
        reference: the name the others are compared with.
        rtol: the tolerance of :func:`check_agree`.

    Returns:
        ``(candidates, errors, results)``: the errors of :func:`check_agree`, the results by name.
    """

    def args_of(name):
        return args[name] if isinstance(args, dict) else args

    order = [reference, *(n for n in fns if n != reference)]
    results = {n: jax.block_until_ready(fns[n](*args_of(n))) for n in order}
    errs = check_agree(results, rtol=rtol)
    cands = []
    for n, f in fns.items():
        a = args_of(n)
        cands.append(Candidate(n, (lambda f=f, a=a: f(*a)), f.lower(*a).compile()))
    return cands, errs, results


def max_rel_err(a: Any, b: Any) -> float:
    """``max|a - b| / max|b|``, both maxima over every leaf: the error relative to the result's scale.

    Not per leaf: a leaf whose exact value is 0 (a parameter the quantity does not depend on, such
    as an attention key bias in an update) holds rounding of the other leaves' size in one result and
    exact zeros in the other, and a per-leaf ratio would report that as an error of 1e+286.
    """
    pairs = [(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    diff = max(float(np.max(np.abs(x - y), initial=0.0)) for x, y in pairs)
    scale = max(float(np.max(np.abs(y), initial=0.0)) for _, y in pairs)
    return diff / max(scale, 1e-300)


def check_agree(results: dict[str, Any], *, rtol: float) -> dict[str, float]:
    """Asserts that every result has the first one's structure/shapes/dtypes and close values.

    Returns:
        name -> :func:`max_rel_err` against the first result.

    Raises:
        AssertionError: naming the candidate that disagrees, and how.
    """
    names = list(results)
    ref = results[names[0]]
    errs = {}
    for name in names[1:]:
        got = results[name]
        if jax.tree.structure(got) != jax.tree.structure(ref):
            raise AssertionError(f"{name}: tree {jax.tree.structure(got)} != {jax.tree.structure(ref)}")
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise AssertionError(f"{name}: leaf {x.shape} {x.dtype} != {names[0]} {y.shape} {y.dtype}")
        errs[name] = max_rel_err(got, ref)
        if not errs[name] <= rtol:
            raise AssertionError(
                f"{name} disagrees with {names[0]}: max relative error {errs[name]:.3e} > {rtol:.0e}"
            )
    return errs


def format_errors(errs: dict[str, float]) -> str:
    """``"vmcgrad 1.2e-15, netket 3.4e-16"``: the errors of :func:`check_agree`, for the log."""
    return ", ".join(f"{k} {e:.1e}" for k, e in errs.items())


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def format_table(rows: Sequence[Row | dict], *, baseline: str, setting: Sequence[str] = ()) -> str:
    """The table of all candidates, each with its time and memory ratio against the ``baseline``
    candidate of its setting.

    Args:
        rows: :class:`Row`\\ s, or their :meth:`Row.as_dict` dicts.
        baseline: the candidate name the ratios divide by (``"netket"``).
        setting: for dict rows, the keys that make the setting (default: every key that is not a
            measurement and not ``bench``).
    """
    items = []
    for r in rows:
        d = r.as_dict() if isinstance(r, Row) else r
        default = [k for k in d if k not in MEASURED]
        keys = list(r.setting) if isinstance(r, Row) else (list(setting) or default)
        keys = [k for k in keys if k != "bench"]
        items.append((d, ",".join(f"{k}={d[k]}" for k in keys)))
    bases = {(d["bench"], s): d for d, s in items if d["name"] == baseline}
    out = []
    for d, s in items:
        base = bases.get((d["bench"], s), {})
        coll = d["collectives_in_loops"]
        out.append(
            {
                "bench": d["bench"],
                "setting": s,
                "impl": d["name"],
                "ms": d["median_s"] * 1e3,
                "t/base": _ratio(d["median_s"], base.get("median_s")),
                "MiB": None if d["temp_bytes"] is None else d["temp_bytes"] / 2**20,
                "m/base": _ratio(d["temp_bytes"], base.get("temp_bytes")),
                "coll": None if coll is None else f"{coll}/{d['collectives_outside']}",
            }
        )
    return table(
        out,
        [
            Column("bench", "bench", align="<"),
            Column("setting", "setting", align="<"),
            Column("impl", "impl", align="<"),
            Column("median ms", "ms", ".2f"),
            Column("t/base", "t/base", ".2f"),
            Column("temp MiB", "MiB", ".2f"),
            Column("m/base", "m/base", ".2f"),
            Column("coll(loop/out)", "coll"),
        ],
    )


def use_cpu_devices(n: int | None) -> None:
    """Float64 and ``n`` fake CPU devices (None: JAX's own) for JAX and NetKet, then imports NetKet.

    The benchmark scripts call this first: the device count is fixed once JAX's backend starts,
    NetKet reads ``NETKET_EXPERIMENTAL_SHARDING_CPU`` when imported and sets its global mesh
    (axis ``"S"`` over ``jax.devices()``) then. Called in a process whose JAX already runs (a test),
    ``n`` must be its device count.

    Raises:
        RuntimeError: JAX already runs with another device count in this process.
    """
    import os

    if n is not None:
        os.environ["NETKET_EXPERIMENTAL_SHARDING_CPU"] = str(n)
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # the backend already runs
            if jax.device_count() != n:
                raise RuntimeError(
                    f"--devices {n}: JAX already runs with {jax.device_count()} devices in this process; "
                    "run the benchmark in a fresh process"
                ) from None
    jax.config.update("jax_enable_x64", True)
    import netket  # noqa: F401
