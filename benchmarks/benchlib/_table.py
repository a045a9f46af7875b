"""The one plain-text table formatter of the benchmarks: rows of dicts, a list of columns.

Every table the benchmarks print (the ratio tables, the largest-N table, the scale-out table, the
summary of ``benchmarks/run.py``) is :func:`table` with its own :class:`Column` list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column.

    Attributes:
        header: its title.
        value: the row's key, or a function of the row.
        fmt: format spec for a value (``".2f"``); None is shown as ``-``.
        align: ``">"`` (numbers) or ``"<"`` (text).
    """

    header: str
    value: str | Callable[[dict], Any]
    fmt: str = ""
    align: str = ">"

    def cell(self, row: dict) -> str:
        v = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        return "-" if v is None else format(v, self.fmt)


def table(rows: Iterable[dict], columns: Sequence[Column]) -> str:
    """A header line, a rule, and one line per row; each column as wide as its widest cell.

    Examples:
        >>> print(table([{"a": "x", "b": 1.5}, {"a": "yy", "b": None}],
        ...             [Column("name", "a", align="<"), Column("value", "b", ".2f")]))
        name  value
        -----------
        x      1.50
        yy        -
    """
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([len(c.header), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]

    def line(items: Sequence[str]) -> str:
        return "  ".join(f"{x:{c.align}{w}}" for x, c, w in zip(items, columns, widths)).rstrip()

    head = line([c.header for c in columns])
    return "\n".join([head, "-" * len(head), *(line(r) for r in cells)])
