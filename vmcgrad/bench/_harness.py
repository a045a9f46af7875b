"""Interleaved timing, compiled temp memory and collective counts for a set of candidates."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from .._hlo import collective_report


@dataclass(frozen=True)
class Candidate:
    """One implementation to measure.

    Attributes:
        name: label in the table, e.g. ``"vmcgrad"``, ``"netket"``, ``"jax.vjp"``.
        call: a no-argument callable running one step; its result is blocked on.
        compiled: optional ``jax.stages.Compiled`` of the same step, for memory and collectives
            (None when the step is not one jitted function, e.g. NetKet's two-call remainder path).
    """

    name: str
    call: Callable[[], Any]
    compiled: Any = None


@dataclass
class Row:
    """Measurements of one candidate in one benchmark setting."""

    bench: str
    setting: dict
    name: str
    times: list[float] = field(default_factory=list)
    temp_bytes: int | None = None
    collectives_in_loops: int | None = None
    collectives_outside: int | None = None

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
            "temp_bytes": self.temp_bytes,
            "collectives_in_loops": self.collectives_in_loops,
            "collectives_outside": self.collectives_outside,
        }


def measure(bench: str, setting: dict, candidates: Sequence[Candidate], *, repeats: int = 7) -> list[Row]:
    """Times the candidates in turns (one warm-up call each first) and reads their compiled programs.

    Returns:
        One :class:`Row` per candidate, in the order given.
    """
    rows = [Row(bench, dict(setting), c.name) for c in candidates]
    for c in candidates:
        jax.block_until_ready(c.call())  # compile and warm up
    for _ in range(repeats):
        for c, row in zip(candidates, rows):
            t0 = time.perf_counter()
            jax.block_until_ready(c.call())
            row.times.append(time.perf_counter() - t0)
    for c, row in zip(candidates, rows):
        if c.compiled is not None:
            row.temp_bytes = c.compiled.memory_analysis().temp_size_in_bytes
            report = collective_report(c.compiled)
            row.collectives_in_loops = report.total_in_loops
            row.collectives_outside = report.total_outside
    return rows


def format_table(rows: Sequence[Row], *, baseline: str) -> str:
    """A plain-text table with each row's ratios against the ``baseline`` candidate of its setting."""
    lines = [
        f"{'bench':<18}{'setting':<34}{'impl':<16}{'median ms':>10}{'t/base':>8}"
        f"{'temp MiB':>10}{'m/base':>8}{'coll(loop/out)':>16}"
    ]
    by_setting: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_setting.setdefault((r.bench, tuple(sorted(r.setting.items()))), {})[r.name] = r
    for (bench, setting), group in by_setting.items():
        base = group.get(baseline)
        for name, r in group.items():
            t_ratio = f"{r.median / base.median:.2f}" if base else "-"
            mem = f"{r.temp_bytes / 2**20:.2f}" if r.temp_bytes is not None else "-"
            m_ratio = (
                f"{r.temp_bytes / base.temp_bytes:.2f}"
                if base and r.temp_bytes is not None and base.temp_bytes
                else "-"
            )
            coll = (
                f"{r.collectives_in_loops}/{r.collectives_outside}"
                if r.collectives_in_loops is not None
                else "-"
            )
            setting_s = ",".join(f"{k}={v}" for k, v in setting)
            lines.append(
                f"{bench:<18}{setting_s:<34}{name:<16}{r.median * 1e3:>10.2f}{t_ratio:>8}"
                f"{mem:>10}{m_ratio:>8}{coll:>16}"
            )
    return "\n".join(lines)


def use_cpu_devices(n: int | None) -> None:
    """Float64 and ``n`` fake CPU devices (None: JAX's own) for JAX and NetKet, then imports NetKet.

    The benchmark scripts call this first: the device count is fixed once JAX's backend starts,
    NetKet reads ``NETKET_EXPERIMENTAL_SHARDING_CPU`` when imported and sets its global mesh
    (axis ``"S"`` over ``jax.devices()``) then.
    """
    import os

    if n is not None:
        os.environ["NETKET_EXPERIMENTAL_SHARDING_CPU"] = str(n)
        jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_enable_x64", True)
    import netket  # noqa: F401
