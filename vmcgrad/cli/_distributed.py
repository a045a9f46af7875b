"""Multi-process runs of the command line on JAX's distributed runtime (``--coordinator`` and friends).

Every process runs the same command with its own ``--process-id``; together they form one JAX program
whose devices are all processes' devices (``jax.devices()`` is global), so NetKet's sample mesh, the
chains and vmcgrad's one reduction per gradient span them all. The runtime must be joined before JAX
computes anything and before NetKet is imported (its mesh is built from ``jax.devices()`` at import).
A process that never joins, or is lost during the run, ends every other process within
``--distributed-timeout`` seconds, with one line naming it (:mod:`._supervise`).
"""

from __future__ import annotations

import argparse

from .._distributed import DEFAULT_TIMEOUT


def coordinator_address(text: str) -> str:
    """``HOST:PORT`` of process 0's coordinator (``[::1]:PORT`` for an IPv6 host).

    Examples:
        >>> coordinator_address("127.0.0.1:12345")
        '127.0.0.1:12345'
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:12345; got {text!r}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or any(c.isspace() for c in bare) or (":" in bare and not host.startswith("[")):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a host name or address (IPv6 in brackets); got {text!r}"
        )
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a numeric port; got {text!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be in 1..65535; got {number}")
    return f"{host}:{number}"


def non_negative_int(text: str) -> int:
    """An integer ≥ 0.

    Examples:
        >>> non_negative_int("0")
        0
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer; got {value}")
    return value


def add_arguments(p) -> None:
    """Adds ``--coordinator``, ``--num-processes`` and ``--process-id`` to the parser ``p``."""
    from ._args import positive_int

    g = p.add_argument_group(
        "multiple processes (JAX distributed runtime; give all three or none)",
        "Start the same command once per process. Process 0 hosts the coordinator, writes the "
        "output and shows the progress; --devices then counts each process's own CPU devices.",
    )
    g.add_argument(
        "--coordinator",
        type=coordinator_address,
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordinator, e.g. 127.0.0.1:12345; it listens on this address only",
    )
    g.add_argument(
        "--num-processes", type=positive_int, default=None, metavar="N", help="number of processes"
    )
    g.add_argument(
        "--process-id", type=non_negative_int, default=None, metavar="I", help="this process: 0..N-1"
    )
    g.add_argument(
        "--distributed-timeout",
        type=positive_int,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help="seconds to wait for a process that does not join, or stops answering, before all stop",
    )


def check(args, parser) -> None:
    """All three options or none, and a process id below the number of processes."""
    given = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    missing = [name for name, value in given.items() if value is None]
    if missing and len(missing) < len(given):
        present = ", ".join(name for name in given if name not in missing)
        parser.error(
            f"argument {missing[0]}: required with {present}; "
            "give --coordinator HOST:PORT, --num-processes N and --process-id I together"
        )
    if not missing and args.process_id >= args.num_processes:
        parser.error(
            f"argument --process-id: must be in 0..{args.num_processes - 1} "
            f"for --num-processes {args.num_processes}; got {args.process_id}"
        )


def initialize(args, parser) -> None:
    """Joins the distributed runtime when ``--coordinator`` is given; must run before JAX computes.

    The coordinator is bound to the given address only (``coordinator_bind_address``): without it,
    process 0 would listen on every network interface. CPU collectives use gloo; when the coordinator
    is on loopback all processes are on this machine, and gloo is bound to ``127.0.0.1`` as well
    (JAX 0.10.2 otherwise binds it to the address the machine's hostname resolves to).
    """
    if args.coordinator is None:
        return
    try:
        from .. import initialize_distributed

        initialize_distributed(
            args.coordinator, args.num_processes, args.process_id, timeout=args.distributed_timeout
        )
    except RuntimeError as error:  # JAX already computed in this process, or initialize ran twice
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        parser.error(f"argument --coordinator: cannot join the distributed runtime: {first}")


def shutdown(args) -> None:
    """Leaves the distributed runtime (a barrier: process 0's coordinator outlives the others)."""
    if args.coordinator is None:
        return
    import jax

    jax.distributed.shutdown()


def supervise(args, argv, prog: str, on_failure, on_interrupt) -> int:
    """Runs this command as the supervised child that joins the runtime (:mod:`._supervise`); returns
    the exit status. ``on_failure(reason)`` marks the log failed (process 0) and returns a note."""
    from . import _supervise

    def diagnose(stderr: str) -> str | None:
        return _supervise.diagnose(
            stderr,
            process_id=args.process_id,
            num_processes=args.num_processes,
            coordinator=args.coordinator,
            timeout=args.distributed_timeout,
        )

    return _supervise.run_child(
        argv, prog, diagnose_child=diagnose, on_failure=on_failure, on_interrupt=on_interrupt
    )
