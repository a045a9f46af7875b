"""Reading compiled HLO: which collectives a program runs, and whether they sit inside a loop.

"One reduction" is a structural claim about the compiled program; this module checks it. A
collective inside a ``while`` body (or any computation a loop body calls) runs once per iteration,
i.e. once per chunk; one after the loop runs once per call.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, NamedTuple

COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_OP = re.compile(r"[\s)]((?:{})(?:-start)?)\(".format("|".join(COLLECTIVES)))
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation|select|scatter)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


class CollectiveReport(NamedTuple):
    """Counts of collective ops in a compiled program, split by where they run.

    Attributes:
        in_loops: op name -> count, in ``while`` bodies/conditions and what they call.
        outside: op name -> count, everywhere else reachable from the entry computation.
    """

    in_loops: Counter
    outside: Counter

    @property
    def total_in_loops(self) -> int:
        return sum(self.in_loops.values())

    @property
    def total_outside(self) -> int:
        return sum(self.outside.values())


def _parse(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _callees(line: str) -> list[str]:
    names = _CALLS.findall(line)
    for group in _BRANCHES.findall(line):
        names += [g.strip().lstrip("%") for g in group.split(",") if g.strip()]
    return names


def _reach(comps: dict[str, list[str]], roots: list[str]) -> set[str]:
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            stack.extend(_callees(line))
    return seen


def collective_report(compiled: Any) -> CollectiveReport:
    """Counts the collectives of a compiled program, inside loops and outside.

    Args:
        compiled: a ``jax.stages.Compiled`` (``jitted.lower(*args).compile()``) or its
            ``as_text()`` string.

    Returns:
        A :class:`CollectiveReport`. ``report.total_in_loops == 0`` and
        ``report.outside["all-reduce"] >= 1`` is "one reduction, after the loop".
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, entry = _parse(text)
    loop_roots = []
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                loop_roots += [n for n in _CALLS.findall(line)]
    in_loop = _reach(comps, loop_roots)
    reachable = _reach(comps, [entry]) if entry else set(comps)
    in_loops, outside = Counter(), Counter()
    for name in reachable:
        target = in_loops if name in in_loop else outside
        for line in comps[name]:
            for op in _OP.findall(line):
                target[op.removesuffix("-start")] += 1
    return CollectiveReport(in_loops, outside)
