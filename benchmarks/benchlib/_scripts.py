"""What the scripts in ``benchmarks/`` share: one child process per device count.

The device count is fixed once JAX starts, so a script given several counts runs itself once per
count (``--devices n --json FILE --quiet`` added to its arguments) and merges the rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence


def rows_for_device_counts(
    script: str, counts: Sequence[int], run_here: Callable[[], list[dict]], argv: Sequence[str]
) -> list[dict]:
    """``run_here()`` for one device count (this process), else :func:`rows_per_device_count`."""
    if len(counts) == 1:
        return run_here()
    return rows_per_device_count(script, argv, counts)


def rows_per_device_count(script: str, argv: Sequence[str], counts: Sequence[int]) -> list[dict]:
    """Runs ``python script --devices n --json FILE --quiet *argv`` for each ``n`` in ``counts``.

    Returns:
        The rows each child wrote, concatenated in the order of ``counts``.

    Raises:
        subprocess.CalledProcessError: if a child fails (its output went to this terminal).
    """
    rows: list[dict] = []
    for n in counts:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, script, "--devices", str(n), "--json", f.name, "--quiet", *argv]
            subprocess.run(cmd, check=True)
            with open(f.name) as fh:
                rows += json.load(fh)
    return rows
