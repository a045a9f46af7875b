"""The ``vmcgrad`` command line: ``vmcgrad vmc`` (ground-state search) and ``vmcgrad bench`` (benchmarks).

Arguments are parsed and checked before JAX computes anything and before any file is written, so that
``--devices`` can still set the number of fake CPU devices, ``--coordinator`` can still join JAX's
distributed runtime, and a typo costs nothing. A usage mistake
prints one line on stderr naming the option and what it accepts, and exits with status 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from . import _distributed, bench, vmc
from ._args import Parser


def build_parser() -> Parser:
    """The ``vmcgrad`` parser with one sub-parser per command."""
    from .. import __version__

    parser = Parser(
        prog="vmcgrad",
        description="Chunked, sharded, once-reduced gradients for variational Monte Carlo.",
    )
    parser.add_argument("--version", action="version", version=f"vmcgrad {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    vmc.add_parser(commands)
    bench.add_parser(commands)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vmcgrad`` console script and of ``python -m vmcgrad``.

    Returns:
        The exit status: 0 on success, 2 on a usage error, 130 when interrupted.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command, sub = args._command, args._parser  # set by each command's add_parser
    command.check(args, sub)
    use_devices(getattr(args, "devices", None), sub)
    distributed = getattr(args, "coordinator", None) is not None
    if distributed:  # --devices then counts this process's devices; jax.devices() spans all processes
        _distributed.initialize(args, sub)
    try:
        status = command.run(args)
    except KeyboardInterrupt:  # before or after the part that handles Ctrl-C itself
        print(f"{sub.prog}: interrupted", file=sys.stderr)
        return 130
    if distributed:
        _distributed.shutdown(args)
    return status
