"""Joining JAX's multi-process runtime, bound to the addresses it is given.

``jax.distributed.initialize`` binds its coordinator to all interfaces unless told otherwise, and on
CPU (jax 0.10.2) creates gloo's TCP collectives without an address, so gloo binds to whatever the
machine's hostname resolves to. :func:`initialize_distributed` binds the coordinator to the given
address and, when that address is loopback (one machine: tests, a laptop), pins gloo to 127.0.0.1
as well, so that nothing listens beyond loopback. On a cluster (a non-loopback coordinator) gloo
keeps its default: the node's own address.

A lost process is detected by JAX's own coordination service, with one bound ``timeout`` (default
:data:`DEFAULT_TIMEOUT` s) for its three clocks: every process must connect within ``timeout`` of the
first (``initialization_timeout``), a process whose heartbeats stop for ``timeout`` is declared dead
(``heartbeat_timeout_seconds``), and the shutdown barrier waits at most ``timeout``
(``shutdown_timeout_seconds``). JAX then ends every other process itself, with its own message
("Terminating process because the JAX distributed service detected fatal errors") and ``SIGABRT``:
jax 0.10.2 offers no hook that Python can receive (its ``missed_heartbeat_callback`` cannot convert the
status it is called with), so code that must clean up after a lost peer has to do it from another
process, as ``vmcgrad vmc`` does (:mod:`vmcgrad.cli._supervise`). JAX's defaults are 300 s to connect
and 100 s of heartbeats.
"""

from __future__ import annotations

import ipaddress
from functools import partial


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and 127.0.0.0/8 or ``::1`` literals."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


#: Seconds a process waits for a peer that never connects or stops answering (see the module docstring).
DEFAULT_TIMEOUT = 60


def initialize_distributed(
    coordinator: str, num_processes: int, process_id: int, *, timeout: int = DEFAULT_TIMEOUT
) -> None:
    """``jax.distributed.initialize`` with the coordinator bound to ``coordinator`` (``HOST:PORT``).

    Call before JAX computes anything (and before importing NetKet, whose mesh spans
    ``jax.devices()``: all processes' devices). On CPU the collectives are gloo's.

    Args:
        coordinator: ``HOST:PORT`` of process 0's coordinator, e.g. ``127.0.0.1:12345``.
        num_processes: total number of processes.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        timeout: seconds (an integer ≥ 1) after which a process that has not connected, or whose
            heartbeats stopped, is declared lost; JAX then ends every other process (module docstring).

    Raises:
        ValueError: if ``timeout`` is not an integer ≥ 1 (before anything is started).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise ValueError(
            f"vmcgrad.initialize_distributed: timeout must be a whole number of seconds >= 1; got "
            f"{timeout!r}. Fix: pass e.g. timeout={DEFAULT_TIMEOUT}."
        )
    import jax  # here: the command line reads DEFAULT_TIMEOUT for its --help, which imports no JAX

    host = coordinator.rsplit(":", 1)[0]
    if is_loopback(host):
        _pin_gloo_to_loopback()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        coordinator_bind_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout,
        shutdown_timeout_seconds=timeout,
    )


def _pin_gloo_to_loopback() -> None:
    # The only place jax 0.10.2 builds the CPU gloo collectives (a private hook, found through
    # vmcgrad._jax_private, which fails loudly if it moved rather than silently listen elsewhere).
    from vmcgrad._jax_private import gloo_tcp_collectives_module

    module = gloo_tcp_collectives_module()
    make = module.make_gloo_tcp_collectives
    if not isinstance(make, partial):
        module.make_gloo_tcp_collectives = partial(make, hostname="127.0.0.1")
