"""The ``vmcgrad`` command line: ``vmcgrad vmc`` (ground-state search).

The benchmark suite is not installed with vmcgrad: it lives in ``benchmarks/`` of the source
repository (``python benchmarks/run.py``).

Arguments are parsed and checked before JAX computes anything and before any file is written, so that
``--devices`` can still set the number of fake CPU devices, ``--coordinator`` can still join JAX's
distributed runtime, and a typo costs nothing. A usage mistake
prints one line on stderr naming the option and what it accepts, and exits with status 2. The
output directory is then created and locked (:mod:`._lock`): a second run into it exits with status 2
at once; one that cannot be created or written (a full disk) leaves nothing behind. Before that, the
command's optional dependencies (the ``[cli]`` extra) are looked up without importing them: a missing
one is named, with the pip command, and nothing runs (status 1). An unexpected exception is logged as
"failed" with its message and raised. With ``--coordinator`` the process the user started supervises
the one that joins JAX's runtime (:mod:`._supervise`), so that a lost process ends in one line, a log
marked "failed" and a released lock instead of JAX's abort.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import __version__
from . import _checkpoint, _distributed, _lock, _output, _supervise, _vmc_options, vmc
from ._args import Parser
from ._run_folder import Run, RunFolderError, load_run

__all__ = ["Run", "RunFolderError", "build_parser", "load_run", "main"]


def build_parser() -> Parser:
    """The ``vmcgrad`` parser with one sub-parser per command."""
    parser = Parser(
        prog="vmcgrad",
        description="Chunked, sharded, once-reduced gradients for variational Monte Carlo.",
    )
    parser.add_argument("--version", action="version", version=f"vmcgrad {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _vmc_options.add_parser(commands, vmc)
    return parser


def use_devices(n: int | None, parser: Parser) -> None:
    """Makes JAX show ``n`` CPU devices, and NetKet shard over them; must run before JAX computes."""
    if n is None:
        return
    os.environ["NETKET_EXPERIMENTAL_SHARDING_CPU"] = str(n)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend already runs (vmcgrad called in a process that used JAX)
        if jax.device_count() != n:
            parser.error(
                f"argument --devices: JAX already runs with {jax.device_count()} devices in this process; "
                f"cannot switch to {n}"
            )


#: The command line's optional dependencies (the ``[cli]`` extra), and how to install them.
CLI_EXTRA = "pip install 'vmcgrad[cli]'"


def missing_dependencies(names: Sequence[str]) -> list[str]:
    """Those of the modules ``names`` that cannot be imported here (found without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is missing, or a module without a spec
            found = name in sys.modules and sys.modules[name] is not None
        if not found:
            missing.append(name)
    return missing


def claim_out_dir(out: Path, parser: Parser, option: str = "--out") -> _lock.OutDirLock:
    """Creates ``out`` and locks it for this run; a usage error (exit 2) when another run holds it or it
    cannot be created or written (a full disk): then nothing that this created is left behind.
    ``option`` is the one the user gave the folder with (``--out``, or ``--resume``), for the message."""
    created = [p for p in (out, *out.absolute().parents) if not p.exists()][::-1]  # outermost first
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = _lock.OutDirLock.acquire(out)
    except (_lock.Busy, OSError) as error:
        for directory in reversed(created):
            try:
                directory.rmdir()
            except OSError:
                break
        if isinstance(error, _lock.Busy):
            fix = "choose another --out" if option == "--out" else "resume it once that run has ended"
            parser.error(f"argument {option}: {error}; wait for it to end, or {fix}")
        parser.error(f"argument {option}: cannot create {str(out)!r}: {_output.reason(error)}")
    if lock.stale_pid is not None:
        print(
            f"{parser.prog}: note: took over the lock file {lock.path} of process {lock.stale_pid}, "
            "which has ended",
            file=sys.stderr,
        )
    return lock


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vmcgrad`` console script and of ``python -m vmcgrad``.

    Returns:
        The exit status: 0 on success, 1 when an optional dependency is missing (before anything is
        done), a file could not be written (a one-line error; what was written before is kept) or a
        process of a multi-process run was lost, 2 on a usage error (including an ``--out`` that
        another run is using), 130 when interrupted.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    command, sub = args._command, args._parser  # set by each command's add_parser
    missing = missing_dependencies(command.REQUIRES)
    if missing:
        verb, it = ("is", "it") if len(missing) == 1 else ("are", "them")
        print(
            f"{sub.prog}: error: {' and '.join(missing)} {verb} not installed; `{sub.prog}` needs {it}: "
            f"{CLI_EXTRA} (or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
        return 1
    args._argv = argv  # for the options a command must tell given from defaulted (``--resume``)
    command.check(args, sub)
    # Until a command installs its own handling (._interrupt), SIGTERM stops the run as Ctrl-C does:
    # through the handlers below, which release the lock, instead of ending the process on the spot.
    previous = _sigterm_as_interrupt()
    distributed = getattr(args, "coordinator", None) is not None
    supervised = distributed and _supervise.is_child()  # the supervisor holds the lock
    lock = None
    try:
        out = None if supervised else command.out_dir(args)
        option = "--resume" if getattr(args, "resume", None) is not None else "--out"
        lock = claim_out_dir(out, sub, option) if out is not None else None
        if distributed and not supervised:  # JAX runs in a child, which this process watches
            return _distributed.supervise(
                args,
                argv,
                sub.prog,
                on_failure=lambda reason: command.mark_log(args, "failed", reason),
                on_interrupt=lambda: command.mark_log(args, "interrupted", None),
            )
        try:
            use_devices(getattr(args, "devices", None), sub)
            if distributed:  # --devices counts this process's devices; jax.devices() spans all processes
                _distributed.initialize(args, sub)
            status = command.run(args)
        except KeyboardInterrupt:  # before or after the part that handles Ctrl-C itself
            print(f"{sub.prog}: interrupted", file=sys.stderr)
            return 130
        except (_output.OutputError, _checkpoint.CheckpointError) as error:
            print(f"{sub.prog}: error: {error}", file=sys.stderr)
            status = 1
        except MemoryError as error:  # vmcgrad's: no chunk fits --memory-budget (the message has the fix)
            print(f"{sub.prog}: error: {error}".replace("\n", " "), file=sys.stderr)
            status = 1
        if distributed:
            _distributed.shutdown(args)
        return status
    finally:
        if lock is not None:
            lock.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_as_interrupt():
    """Makes SIGTERM raise KeyboardInterrupt; returns the previous handler (None outside the main
    thread, where Python cannot set handlers)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        return None
