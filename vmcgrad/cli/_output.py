"""Files written by the command line: strict, atomic JSON logs and matplotlib plots (Agg backend).

Every file is written to a unique temporary name in the same directory (:func:`tempfile.mkstemp`) and
moved over the old one with :func:`os.replace`, so a crash, a Ctrl-C or a full disk leaves either the
previous complete file or the new one, never half of one, and two writers never share a temporary.
A failed write raises :class:`OutputError` (one line: the file and the system's reason) and removes its
temporary. JSON is strict (RFC 8259): a NaN or infinite number is written as ``null`` and listed, with
the reason, under the key ``"nonfinite"``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

#: Temporary files being written now; removed by :func:`remove_temporaries` before a hard exit.
_TEMPORARIES: set[str] = set()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The permissions of a written file: as ``open`` would give (``mkstemp``'s own are 0o600).
_FILE_MODE = 0o666 & ~_umask()


class OutputError(Exception):
    """A file of ``--out`` could not be written (full disk, read-only file system, ...); one line."""


def problem_with_out_dir(out: Path, files: tuple[str, ...] = ()) -> str | None:
    """Why ``out`` cannot become an output directory (a message for ``--out``), or None when it can.

    Nothing is left behind: the directory must either exist, or have a nearest existing ancestor that
    is a directory, and a probe directory must be creatable (and is removed) there. The probe catches
    what permission bits do not show: ``/proc`` and other special or read-only file systems, and
    directories a privileged user may not write either. Each of ``files`` (the names the command
    writes in ``out``) must be a regular file where it exists already.
    """
    if out.exists():
        if not out.is_dir():
            return f"{str(out)!r} exists and is not a directory"
        for name in files:
            path = out / name
            if (path.exists() or path.is_symlink()) and not path.is_file():
                return f"{str(path)!r} exists and is not a regular file; remove it or choose another --out"
        where, what = out, f"directory {str(out)!r} is not writable"
    else:
        parent = out.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot create {str(out)!r}: {str(parent)!r} is not a directory"
        where, what = parent, f"cannot create {str(out)!r}: directory {str(parent)!r} is not writable"
    if not os.access(where, os.W_OK | os.X_OK):
        return what
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vmcgrad-probe-", dir=where))
    except OSError as error:
        return f"{what} ({reason(error)})"
    return None


def reason(error: OSError) -> str:
    """``"No space left on device (ENOSPC)"``: the system's words and the errno name."""
    name = errno.errorcode.get(error.errno or 0)
    text = error.strerror or str(error) or type(error).__name__
    return f"{text} ({name})" if name else text


def strict_json(data: Any) -> tuple[Any, dict[str, str]]:
    """``data`` with every NaN/infinite float replaced by None, and where each one was.

    Returns:
        ``(clean, nonfinite)``: ``nonfinite`` maps a path such as ``"energy_error[3]"`` to the value
        that stood there (``"nan"``, ``"inf"`` or ``"-inf"``).

    Examples:
        >>> strict_json({"a": [1.0, float("nan")], "b": {"c": float("-inf")}})
        ({'a': [1.0, None], 'b': {'c': None}}, {'a[1]': 'nan', 'b.c': '-inf'})
    """
    found: dict[str, str] = {}

    def clean(x: Any, path: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            found[path] = repr(float(x))
            return None
        if isinstance(x, dict):
            return {k: clean(v, f"{path}.{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v, f"{path}[{i}]") for i, v in enumerate(x)]
        return x

    return clean(data, ""), found


#: Why a value of ``"nonfinite"`` is null, as the log states it.
NONFINITE_REASON = (
    "JSON has no NaN or infinity: these numbers are written as null; each entry names where one "
    "stood and what it was (e.g. an error of the mean that is NaN for too few samples per chain)"
)


def write_json_atomic(path: Path, data: dict) -> None:
    """Writes ``data`` as strict JSON to ``path`` (non-finite numbers as null, listed under
    ``"nonfinite"``) through a unique temporary file and :func:`os.replace`.

    Raises:
        OutputError: if the file cannot be written; ``path`` is then unchanged.
    """
    clean, nonfinite = strict_json(data)
    if nonfinite:
        clean["nonfinite"] = {"reason": NONFINITE_REASON, "values": nonfinite}
    text = json.dumps(clean, indent=1, allow_nan=False) + "\n"
    _write_atomic(path, lambda f: f.write(text.encode()))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a unique temporary file that is flushed to the disk
    (:func:`os.fsync`) before :func:`os.replace` moves it, so that neither a killed process nor a lost
    machine leaves a half-written ``path``.

    Raises:
        OutputError: if the file cannot be written; ``path`` is then unchanged.
    """
    _write_atomic(path, lambda f: f.write(data), durable=True)


def _write_atomic(path: Path, write, durable: bool = False) -> None:
    """Calls ``write(binary_file)`` on a fresh temporary next to ``path``, then moves it to ``path``
    (after flushing it to the disk when ``durable``)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        _TEMPORARIES.add(tmp)
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise OutputError(f"cannot write {path}: {reason(error)}") from error
    finally:
        _TEMPORARIES.discard(tmp)


def remove_stale_temporaries(out: Path, names) -> None:
    """Removes the temporaries of ``out/NAME`` left by a process that was killed while writing them
    (call only while holding ``out``'s lock: no other process writes there)."""
    for name in names:
        for tmp in out.glob(f".{name}.*.tmp"):
            try:
                tmp.unlink()
            except OSError:
                pass


def remove_temporaries() -> None:
    """Removes the temporaries of writes in progress (called before :func:`os._exit`)."""
    for tmp in list(_TEMPORARIES):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure_atomic(fig, path: Path) -> None:
    """Saves a matplotlib figure as PNG through a unique temporary file and :func:`os.replace`.

    Raises:
        OutputError: if the file cannot be written (matplotlib's and PIL's OSError); ``path`` is then
            unchanged.
    """
    _write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))


def plot_energy(log: dict, path: Path) -> None:
    """Energy per step with its error bar against the exact energy, and the relative error (log scale).

    Raises:
        OutputError: if the file cannot be written.
    """
    import numpy as np

    plt = pyplot()
    mean = np.asarray(log["energy_mean"], dtype=float)
    err = np.asarray(log["energy_error"], dtype=float)
    steps = np.arange(len(mean))
    exact = log.get("exact_energy")
    cfg = log.get("config", {})
    title = f"{cfg.get('system')} L={cfg.get('L')}, {cfg.get('model')}, {cfg.get('samples')} samples"

    nrows = 2 if exact is not None else 1
    fig, axes = plt.subplots(nrows, 1, figsize=(6.4, 2.6 + 2.2 * nrows), sharex=True, squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, mean, lw=1, color="C0", label="VMC energy")
    ax.fill_between(steps, mean - err, mean + err, color="C0", alpha=0.3, lw=0)
    if exact is not None:
        ax.axhline(exact, color="k", ls="--", lw=1, label=f"exact {exact:.6f}")
        # Zoom on the tail of the convergence: the first steps are far off.
        start = len(mean) // 10 if len(mean) > 10 else 0
        lo_hi = np.concatenate([mean[start:] - err[start:], mean[start:] + err[start:]])
        lo_hi = lo_hi[np.isfinite(lo_hi)]
        if lo_hi.size:
            lo, hi = min(exact, float(lo_hi.min())), max(exact, float(lo_hi.max()))
            pad = max(0.05 * (hi - lo), 1e-4 * abs(exact))
            ax.set_ylim(lo - pad, hi + pad)
    ax.set_ylabel("energy")
    ax.set_title(title)
    ax.legend(loc="upper right")
    if exact is not None:
        ax2 = axes[1, 0]
        rel = np.abs(mean - exact) / abs(exact)
        ax2.semilogy(steps, np.maximum(rel, 1e-12), lw=1, color="C1")
        ax2.axhline(1e-3, color="gray", ls=":", lw=1, label="1e-3")
        ax2.set_ylabel("|E − E₀| / |E₀|")
        ax2.legend(loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path)
    finally:
        plt.close(fig)
