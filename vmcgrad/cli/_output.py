"""Files written by the command line: atomic JSON logs and matplotlib plots (Agg backend).

Every file is written to a temporary name in the same directory and moved over the old one with
:func:`os.replace`, so a crash or Ctrl-C leaves either the previous complete file or the new one, never half.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def problem_with_out_dir(out: Path) -> str | None:
    """Why ``out`` cannot become an output directory (a message for ``--out``), or None when it can.

    Nothing is created: the directory must either exist and be writable, or have a nearest existing
    ancestor that is a writable directory.
    """
    if out.exists():
        if not out.is_dir():
            return f"{str(out)!r} exists and is not a directory"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"directory {str(out)!r} is not writable"
        return None
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {str(out)!r}: {str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {str(out)!r}: directory {str(parent)!r} is not writable"
    return None


def write_json_atomic(path: Path, data: dict) -> None:
    """Writes ``data`` as JSON to ``path`` through a temporary file and :func:`os.replace`."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure_atomic(fig, path: Path) -> None:
    """Saves a matplotlib figure as PNG through a temporary file and :func:`os.replace`."""
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)


def plot_energy(log: dict, path: Path) -> None:
    """Energy per step with its error bar against the exact energy, and the relative error (log scale)."""
    import numpy as np

    plt = _pyplot()
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
        if len(mean):
            lo = min(exact, float(np.min(mean[start:] - err[start:])))
            hi = max(exact, float(np.max(mean[start:] + err[start:])))
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
    save_figure_atomic(fig, path)
    plt.close(fig)
