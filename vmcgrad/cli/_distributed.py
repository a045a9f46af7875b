"""Multi-process runs of the command line on JAX's distributed runtime (``--coordinator`` and friends,
or ``--distributed auto`` under a cluster launcher).

Every process runs the same command with its own ``--process-id``; together they form one JAX program
whose devices are all processes' devices (``jax.devices()`` is global), so NetKet's sample mesh, the
chains and vmcgrad's one reduction per gradient span them all. The runtime must be joined before JAX
computes anything and before NetKet is imported (its mesh is built from ``jax.devices()`` at import).
A process that never joins, or is lost during the run, ends every other process within
``--distributed-timeout`` seconds, with one line naming it (:mod:`._supervise`).

With ``--distributed auto`` the launcher's environment gives every process its place, as it does for
``jax.distributed.initialize()`` without arguments: the same detection (JAX's ``ClusterEnv`` classes,
:func:`detect_launcher`) runs before anything else, and its coordinator address, number of processes
and process id then take the place of the three flags, so the supervisor, the lock of ``--out`` and
the messages are those of a run started by hand.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from vmcgrad._distributed import DEFAULT_TIMEOUT

from . import _supervise
from ._args import positive_int


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
    """Adds ``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id`` and
    ``--distributed-timeout`` to the parser ``p``."""
    g = p.add_argument_group(
        "multiple processes (JAX distributed runtime: --distributed auto under a launcher, or all three "
        "of --coordinator, --num-processes and --process-id)",
        "Start the same command once per process: through a cluster launcher (srun -n N vmcgrad vmc "
        "--distributed auto ..., or mpirun -n N), or by hand with the three flags. Process 0 hosts the "
        "coordinator, writes the output and shows the progress; --devices then counts each process's "
        "own CPU devices.",
    )
    g.add_argument(
        "--distributed",
        choices=("auto",),
        default=None,
        help="auto: take the coordinator, number of processes and process id from the launcher's "
        "environment, as jax.distributed.initialize() does (SLURM's srun, Open MPI's mpirun, ...)",
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
    """All three options or none, and a process id below the number of processes; with
    ``--distributed auto``, none of them, and the three taken from the launcher (:func:`use_launcher`)."""
    if args.distributed == "auto":
        use_launcher(args, parser)
        return
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


@dataclass(frozen=True)
class Launch:
    """This process's place in a launched job, as JAX's cluster detection reads it.

    Attributes:
        launcher: JAX's name of the environment (``"slurm"``, ``"ompi"``, ...).
        coordinator: ``HOST:PORT`` of process 0's coordinator.
        num_processes, process_id: the job's size and this process's index.
        local_device_ids: the devices JAX would restrict this process to (GPUs: one per local
            process); None for all.
    """

    launcher: str
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def detect_launcher(timeout: int) -> Launch | None:
    """The launcher environment ``jax.distributed.initialize()`` would detect here, or None.

    The same steps as JAX's own: ``JAX_COORDINATOR_ADDRESS`` and ``JAX_LOCAL_DEVICE_IDS`` when set,
    the first present, not opt-in, environment among JAX's ``ClusterEnv`` classes for the rest (its
    coordinator port from ``JAX_COORDINATOR_PORT`` or derived from the job id). JAX 0.10.2 reads, for
    SLURM, ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST`` (first host), ``SLURM_NTASKS``, ``SLURM_PROCID``
    and ``SLURM_LOCALID``; for Open MPI, ``OMPI_MCA_orte_hnp_uri`` (first address), ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_RANK`` and ``OMPI_COMM_WORLD_LOCAL_RANK``.

    Raises:
        RuntimeError, ValueError, KeyError: the environment is present but JAX cannot read it.
    """
    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    from vmcgrad._jax_private import cluster_env

    cluster = cluster_env()
    env = next((e for e in cluster._cluster_types if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return None
    ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
    coordinator, n, pid, local = cluster.auto_detect_unset_distributed_params(
        os.environ.get("JAX_COORDINATOR_ADDRESS"),
        None,
        None,
        [int(i) for i in ids.split(",")] if ids else None,
        None,
        timeout,
    )
    local = None if local is None else tuple(int(i) for i in local)
    return Launch(getattr(env, "name", "") or env.__name__, coordinator, int(n), int(pid), local)


def use_launcher(args, parser) -> None:
    """``--distributed auto``: sets ``args.coordinator``, ``num_processes`` and ``process_id`` from the
    launcher (:func:`detect_launcher`; left None for a job of one process, which runs without the
    runtime), and ``args._launch``; a usage error when the flags are given too, or no launcher is found."""
    given = [
        f"--{n.replace('_', '-')}"
        for n in ("coordinator", "num_processes", "process_id")
        if getattr(args, n) is not None
    ]
    if given:
        parser.error(
            f"argument --distributed: not allowed with {', '.join(given)}: auto takes them from the "
            "launcher's environment. Fix: drop one or the other"
        )
    try:
        launch = detect_launcher(args.distributed_timeout)
    except (RuntimeError, ValueError, KeyError) as error:
        parser.error(f"argument --distributed: cannot read the launcher's environment: {error}")
    if launch is None:
        parser.error(
            "argument --distributed: auto found no cluster launcher in the environment (JAX detects SLURM's "
            "srun, Open MPI's mpirun, Kubernetes and Cloud TPU: see docs/multidevice.md). Fix: start it "
            "as srun -n N vmcgrad vmc --distributed auto ..., or give --coordinator, --num-processes and "
            "--process-id"
        )
    try:
        coordinator = coordinator_address(launch.coordinator)
    except argparse.ArgumentTypeError as error:
        parser.error(f"argument --distributed: the {launch.launcher} launcher's coordinator address: {error}")
    if not 0 <= launch.process_id < launch.num_processes:
        parser.error(
            f"argument --distributed: the {launch.launcher} launcher gives process {launch.process_id} of "
            f"{launch.num_processes}; expected 0..{launch.num_processes - 1}"
        )
    args._launch = launch
    if launch.num_processes > 1:
        args.coordinator, args.num_processes, args.process_id = (
            coordinator,
            launch.num_processes,
            launch.process_id,
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
    launch = getattr(args, "_launch", None)
    try:
        if launch is None:
            # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
            from .. import initialize_distributed

            initialize_distributed(
                args.coordinator, args.num_processes, args.process_id, timeout=args.distributed_timeout
            )
        else:
            _initialize_launched(args.coordinator, launch, args.distributed_timeout)
    except RuntimeError as error:  # JAX already computed in this process, or initialize ran twice
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        parser.error(f"argument --coordinator: cannot join the distributed runtime: {first}")


def _initialize_launched(coordinator: str, launch: Launch, timeout: int) -> None:
    """``jax.distributed.initialize`` with the launcher's values, as JAX would call it, and the
    timeouts of :func:`vmcgrad.initialize_distributed`. A loopback coordinator (one machine) and gloo
    are bound to loopback; on a cluster the coordinator listens on its port on process 0's node (JAX's
    default: every interface, since the launcher names the node, not the interface), gloo on the
    address the node's hostname resolves to."""
    import jax

    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    from vmcgrad._distributed import _pin_gloo_to_loopback, is_loopback

    loopback = is_loopback(coordinator.rsplit(":", 1)[0])
    if loopback:
        _pin_gloo_to_loopback()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        coordinator_bind_address=coordinator if loopback else None,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=None if launch.local_device_ids is None else list(launch.local_device_ids),
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )


def shutdown(args) -> None:
    """Leaves the distributed runtime (a barrier: process 0's coordinator outlives the others)."""
    if args.coordinator is None:
        return
    import jax

    jax.distributed.shutdown()


def supervise(args, argv, prog: str, on_failure, on_interrupt) -> int:
    """Runs this command as the supervised child that joins the runtime (:mod:`._supervise`); returns
    the exit status. ``on_failure(reason)`` marks the log failed (process 0) and returns a note."""

    def diagnose(stderr: str) -> str | None:
        return _supervise.diagnose(
            stderr,
            process_id=args.process_id,
            num_processes=args.num_processes,
            coordinator=args.coordinator,
            timeout=args.distributed_timeout,
            launcher=getattr(getattr(args, "_launch", None), "launcher", None),
        )

    from pathlib import Path

    if getattr(args, "verbose", False):
        third_party = None
    elif args.process_id:  # only process 0 writes in the run folder
        third_party = Path(os.devnull)
    else:
        third_party = Path(args.out) / _supervise.THIRD_PARTY_LOG
    return _supervise.run_child(
        argv,
        prog,
        diagnose_child=diagnose,
        on_failure=on_failure,
        on_interrupt=on_interrupt,
        third_party=third_party,
    )
