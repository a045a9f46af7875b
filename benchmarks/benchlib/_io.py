"""The one JSON writer of the benchmarks: strict JSON (a NaN or infinity becomes ``null``), written
atomically (a temporary file in the same directory, then :func:`os.replace`), so that a benchmark
stopped at any moment leaves the previous complete file or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def json_safe(x: Any) -> Any:
    """``x`` with NumPy scalars as Python numbers and every non-finite float as None (strict JSON).

    Examples:
        >>> json_safe({"a": float("nan"), "b": [np.float32(1.5), (2, float("inf"))]})
        {'a': None, 'b': [1.5, [2, None]]}
    """
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def write_json(data: Any, path: str | os.PathLike | None) -> None:
    """Writes :func:`json_safe` of ``data`` as indented JSON to ``path``, atomically; nothing when
    ``path`` is None. Values JSON does not know (a dtype, a path) are written as their ``str``."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(json_safe(data), f, indent=1, default=str, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_figure(fig: Any, path: str | os.PathLike) -> None:
    """Saves a matplotlib figure as PNG through a temporary file in the same directory and
    :func:`os.replace` (as :func:`write_json`)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
