"""A multi-process run under a supervisor: the process the user started watches the one that runs JAX.

When a process of a JAX distributed run is lost (killed, crashed, never started), JAX's coordination
service ends every other process with ``SIGABRT`` and a C++ stack trace, after
``--distributed-timeout`` seconds (:func:`vmcgrad.initialize_distributed`); when the lost process is
process 0, whose coordinator they all talk to, at once. Nothing in a process that JAX aborts can write
its log or remove its lock. So with ``--coordinator`` the command starts itself again as a child
process (``python -m vmcgrad`` with the same arguments) and stays outside JAX: it holds the lock of
``--out``, relays the child's standard error (without the C++ stack frames), forwards SIGINT and SIGTERM
to it (the child runs in its own session, so a Ctrl-C at the terminal reaches it once, through here),
and when the child ends:

- normally, with its own status: returns that status;
- aborted by JAX: reads JAX's last words for which process was lost (the heartbeat report lists its
  task id; a lost coordinator is reported as the "leader"; a registration that timed out means a
  process never joined), marks ``log.json`` "failed" with that reason, prints one line naming the
  process and the fix, and returns 1.

The child dies with this process (``PR_SET_PDEATHSIG`` on Linux), so killing the supervisor kills the
whole process, as a user would expect.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import vmcgrad

#: Set in the child's environment: the child runs the command itself (no supervisor, no lock).
ENV = "VMCGRAD_SUPERVISED"

_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\):\s*((?:\d+[\s,]*)+)")
_LEADER = "leader task was preempted/died"
_NOISE = (b"    @ ", b"*** Check failure stack trace")
#: Log lines of the libraries under JAX's distributed runtime (glog/absl lines of its client and
#: coordination service, Gloo's own): written to ``DIR/third_party.log``, not the terminal, unless
#: ``--verbose``. A partial line that may become one waits for its end.
_THIRD_PARTY = re.compile(
    rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\]\s]+:\d+\]"  # glog/absl: I0102 12:00:00.1 42 f.cc:7]
    rb"|\[Gloo\]|WARNING: All log messages before absl)"
)
_THIRD_PARTY_START = re.compile(rb"^(?:[IWEF]\d{0,4}(?: |$)|\[G(?:l(?:o(?:o\]?)?)?)?$|\[Gloo\]|WARNING)")
THIRD_PARTY_LOG = "third_party.log"
_TAIL_BYTES = 1 << 18


def is_child() -> bool:
    """Whether this process is the supervised child (it then runs the command itself)."""
    return os.environ.get(ENV) == "1"


def diagnose(
    stderr: str,
    *,
    process_id: int,
    num_processes: int,
    coordinator: str,
    timeout: int,
    launcher: str | None = None,
) -> str | None:
    """One line saying which process was lost and the fix, from the standard error of a child that
    JAX's distributed runtime ended; None when JAX did not end it. ``launcher``: JAX's name of the
    launcher that started the processes (``--distributed auto``), or None when they were started by hand.

    Examples:
        >>> jax_said = "The following tasks are unhealthy (stopped sending heartbeats):\\n1\\nThe tasks..."
        >>> diagnose(jax_said, process_id=0, num_processes=2, coordinator="127.0.0.1:1234", timeout=60)[:40]
        'lost process 1 of 2: its heartbeats stop'
    """
    n, me = num_processes, process_id
    again = f"Fix: start all {n} processes again"
    unhealthy = _UNHEALTHY.search(stderr)
    if unhealthy:
        ids = sorted({int(i) for i in re.findall(r"\d+", unhealthy.group(1))} - {me})
        who = _processes(ids) if ids else "a process"
        return (
            f"lost {who} of {n}: its heartbeats stopped (--distributed-timeout {timeout} s; it ended, "
            f"crashed or hangs: see its own output); process {me} stopped too. {again} (a larger "
            f"--distributed-timeout if {who} was only slow)"
        )
    if _LEADER in stderr:
        return (
            f"lost process 0 of {n}, the coordinator at {coordinator} (it ended, crashed or is unreachable; "
            f"see its own output); process {me} stopped too. {again}"
        )
    if _FATAL in stderr and "RegisterTask" in stderr:
        others = [i for i in range(n) if i != me]
        who = _processes(others) if len(others) == 1 else f"one of {_processes(others)}"
        if launcher is not None:
            return (
                f"{who} of {n} did not join the coordinator at {coordinator} within --distributed-timeout "
                f"{timeout} s ({launcher} launcher). Fix: start the command through the launcher, once per "
                f"process (srun -n {n} ..., mpirun -n {n} ...), with --distributed auto in every process"
            )
        return (
            f"{who} of {n} did not join the coordinator at {coordinator} within --distributed-timeout "
            f"{timeout} s. Fix: start the same command once per process, with --process-id 0 to {n - 1} "
            f"(each once), the same --coordinator and --num-processes {n}"
        )
    if _FATAL in stderr:
        status = stderr.split(_FATAL, 1)[1].split("Status:", 1)[-1].strip().splitlines()
        return (
            f"JAX's distributed runtime ended process {me} of {n}: {status[0] if status else 'no reason'}. "
            f"{again}"
        )
    return None


def _processes(ids: Sequence[int]) -> str:
    return f"process {ids[0]}" if len(ids) == 1 else "processes " + ", ".join(map(str, ids))


def run_child(
    argv: Sequence[str],
    prog: str,
    *,
    diagnose_child: Callable[[str], str | None],
    on_failure: Callable[[str], str | None],
    on_interrupt: Callable[[], None],
    third_party: Path | None = None,
) -> int:
    """Runs ``python -m vmcgrad *argv`` as the supervised child; returns the exit status.

    Args:
        argv: the command line, as given to this process.
        prog: the command's name, for the messages.
        diagnose_child: the child's standard error -> one line naming the lost process, or None.
        on_failure: called with that line when the child was lost; returns a note on the log kept.
        on_interrupt: called when a forwarded SIGINT/SIGTERM ended the child before it could keep its log.
        third_party: the file the child's third-party log lines go to (appended), or None to show
            them (``--verbose``); a process without a run folder passes ``os.devnull``.
    """

    env = dict(os.environ)
    env[ENV] = "1"
    root = str(Path(vmcgrad.__file__).resolve().parents[1])  # the child imports this very vmcgrad
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if third_party is not None:  # its stdout is relayed too (Gloo prints there): unbuffered, in order
        env["PYTHONUNBUFFERED"] = "1"
    child = subprocess.Popen(
        [sys.executable, "-m", "vmcgrad", *argv],
        stdout=subprocess.PIPE if third_party is not None else None,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        relay_out = None
        if third_party is not None:
            import threading

            relay_out = threading.Thread(
                target=_relay, args=(child.stdout.fileno(), sys.stdout, third_party), daemon=True
            )
            relay_out.start()
        tail = _relay(child.stderr.fileno(), sys.stderr, third_party)
        if relay_out is not None:
            relay_out.join()
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
    reason = diagnose_child(tail.decode(errors="replace")) if rc != 0 else None
    if reason is not None:
        note = on_failure(reason)
        print(f"{prog}: error: {reason}{'; ' + note if note else ''}", file=sys.stderr, flush=True)
        return 1
    if rc < 0:
        if forwarded and -rc in (signal.SIGINT, signal.SIGTERM):
            on_interrupt()
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return 130
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        reason = f"process ended by signal {name}"
        note = on_failure(reason)
        print(f"{prog}: error: {reason}{'; ' + note if note else ''}", file=sys.stderr, flush=True)
        return 1
    return rc


def _relay(fd: int, stream, third_party: Path | None = None) -> bytes:
    """Copies ``fd`` to ``stream`` until end of file, dropping C++ stack frames and, with
    ``third_party``, appending third-party log lines to that file instead; returns the tail."""
    out = getattr(stream, "buffer", None)
    tail, pending, line_open = b"", b"", False
    log = [None]

    def emit(data: bytes) -> None:
        if third_party is not None and not line_open and _THIRD_PARTY.match(data):
            try:
                if log[0] is None:
                    log[0] = open(third_party, "ab")  # closed at the end
                log[0].write(data)
                log[0].flush()
            except OSError:
                pass  # a log of others' notes is not worth stopping for
            return
        if out is not None:
            out.write(data)
        else:
            stream.write(data.decode(errors="replace"))
        stream.flush()

    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:  # pragma: no cover (PEP 475 retries)
            continue
        if not data:
            break
        tail = (tail + data)[-_TAIL_BYTES:]
        pending += data
        while (cut := _line_end(pending)) >= 0:
            segment, pending = pending[: cut + 1], pending[cut + 1 :]
            if line_open or not segment.startswith(_NOISE):
                emit(segment)
            line_open = False
        # a partial line (a progress bar redrawn with \r) goes out at once, unless it may be noise
        maybe_theirs = third_party is not None and _THIRD_PARTY_START.match(pending)
        if pending and (
            line_open or (len(pending) >= 32 and not pending.startswith(_NOISE) and not maybe_theirs)
        ):
            emit(pending)
            pending, line_open = b"", True
    if pending and not pending.startswith(_NOISE):
        emit(pending)
    if log[0] is not None:
        log[0].close()
    return tail


def _line_end(data: bytes) -> int:
    """The index of the first ``\\n`` or ``\\r`` in ``data``, or -1."""
    ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
    return min(ends) if ends else -1


def _die_with_parent() -> None:
    """In the child before ``exec``: receive SIGKILL when the supervisor dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
