r"""Scale benchmarks: the largest N per step under a memory budget, and a simulated scale-out table.

**Largest N per step** (:func:`largest_n_table`). The step is the VMC gradient of NetKet's
``RBMModPhase`` (real parameters, complex output; the step :mod:`benchlib.grad` times),

.. math::

    g = 2\,\mathrm{Re}\,F, \qquad F = \frac{1}{N}\sum_{i=1}^{N} \overline{O_i}\,(L_i - \bar L),

with NetKet's int8 samples and complex128 local values as inputs. Its per-device footprint is the
compiled program's

.. math::

    \mathrm{bytes}(N) = \mathrm{temp} + \mathrm{arguments} + \mathrm{outputs}

(:func:`vmcgrad.program_bytes`, from ``memory_analysis()``; nothing is run, every input is a
``jax.ShapeDtypeStruct``). For each budget, N is doubled from ``n_min`` until the step no
longer fits; the last N that fits is reported with the bytes it needs, and the first N that does
not fit with the least it would need there:

- ``vmcgrad auto``: the chunk ``vmcgrad.expect_grad(..., chunk_size="auto")`` picks, from
  :func:`vmcgrad.auto_chunk_size` with ``estimator="expect_grad"`` and the given budget instead of
  the device default: at each N the largest power-of-two chunk that fits; N fits when some chunk
  does. Its bytes are those of ``jax.jit(lambda ...: vmcgrad.expect_grad(..., chunk_size=c))``.
- ``vmcgrad chunk=c``: the same pass at a fixed chunk, which separates what the automatic choice
  gains from what the pass itself saves (one pullback per chunk) at NetKet's chunk.
- ``netket chunk=c``: NetKet's chunked force, as ``forces_expect_hermitian_chunked`` computes it
  (centre, ``nk.jax.vjp_chunked(..., conjugate=True, chunk_size=c, chunk_argnums=2,
  nondiff_argnums=(1, 2))``, ``force_to_grad``) with the fixed chunk a user sets on
  ``MCState(chunk_size=c)``; NetKet picks no chunk before running (its ``AutoChunkSize`` halves
  the chunk after an out-of-memory crash).
- ``netket unchunked``: ``MCState(chunk_size=None)``, ``forces_expect_hermitian``: ``nk.jax.vjp``
  over all samples (for real parameters and a complex output, two forward traces and four
  pullbacks).

**Scale-out** (:func:`scale_out_rows`). For a fixed global N, the candidates of
:mod:`benchlib.core` (``batched_vjp`` on ``RBM``, float64) and :mod:`benchlib.grad`
(``expect_grad`` on ``RBMModPhase``), each cross-checked against NetKet and ``jax.vjp`` before timing,
measured on the devices of this process, or of all processes after :func:`init_distributed`: the
per-device compiled temp/argument bytes, the collectives per call (in loop bodies / outside, from
:func:`vmcgrad.collective_report`) and the median time per call. The device count is fixed per
process, so ``benchmarks/bench_scale.py`` runs one subprocess per device count and
:func:`launch_processes` starts the processes of a multi-process run (127.0.0.1 only, free ports,
every child killed on timeout).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import vmcgrad

from ._harness import format_errors, measure
from ._setup import log_psi, netket_grad, place, sample_sharding
from ._table import Column, table

MIB = 2**20


# --- largest N under a memory budget (compile only) ----------------------------------------------


class StepProgram(NamedTuple):
    """Compile-only footprint of one implementation's gradient step, for any N.

    Attributes:
        fits: ``(n, budget) -> (chunk, bytes)`` of the program run at N=n under ``budget`` bytes
            per device, or None if it does not fit (``chunk`` None: unchunked).
        least: ``n -> (chunk, bytes)``: the smallest footprint it can have at N=n (vmcgrad: chunk 1;
            NetKet: its one program, the chunk being fixed by the user).
    """

    fits: Callable[[int, int], tuple[int | None, int] | None]
    least: Callable[[int], tuple[int | None, int]]


def _fixed(bytes_at: Callable[[int], tuple[int | None, int]]) -> StepProgram:
    """A program whose footprint does not depend on the budget (a fixed chunk, or none)."""

    def fits(n, budget):
        got = bytes_at(n)
        return got if got[1] <= budget else None

    return StepProgram(fits, bytes_at)


def step_programs(
    *,
    L: int,
    alpha: int = 1,
    netket_chunks: Sequence[int] = (1024,),
    vmcgrad_chunks: Sequence[int] = (1024,),
    seed: int = 0,
) -> dict[str, StepProgram]:
    r"""The gradient step of each implementation (see the module docstring), compile only.

    Returns:
        ``"vmcgrad auto"``, ``"vmcgrad chunk=c"`` per ``vmcgrad_chunks`` (the same pass at a fixed
        chunk: separates the automatic choice from the pass's own footprint), ``"netket chunk=c"``
        per ``netket_chunks`` and ``"netket unchunked"`` -> :class:`StepProgram`. Inputs are
        ``ShapeDtypeStruct``\ s placed like NetKet's samples (``P("S")`` on its mesh).
    """
    import netket as nk

    hi = nk.hilbert.Spin(0.5, L)
    model = nk.models.RBMModPhase(alpha=alpha, param_dtype=jnp.float64)
    x0 = hi.random_state(jax.random.key(seed), 2)
    variables = model.init(jax.random.key(seed + 1), x0)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    _, (params, model_state) = place((), (params, model_state))
    sharding = sample_sharding()
    apply = model.apply
    logpsi = log_psi(apply, model_state)

    def inputs(n):  # what MCState holds: NetKet's int8 samples, complex local values
        samples = jax.ShapeDtypeStruct((n, L), x0.dtype, sharding=sharding)
        local_values = jax.ShapeDtypeStruct((n,), jnp.complex128, sharding=sharding)
        return samples, local_values

    @partial(jax.jit, static_argnames="chunk")
    def vmcgrad_grad(w, x, lv, chunk):
        return vmcgrad.expect_grad(logpsi, w, x, lv, chunk_size=chunk)

    @partial(jax.jit, static_argnames="chunk")
    def netket_step(w, x, lv, chunk):
        return netket_grad(apply, w, model_state, x, lv, chunk)

    def bytes_of(step):
        cache: dict[tuple, int] = {}

        def at(n, chunk):
            if (n, chunk) not in cache:
                cache[n, chunk] = vmcgrad.program_bytes(step.lower(params, *inputs(n), chunk=chunk).compile())
            return chunk, cache[n, chunk]

        return at

    vmcgrad_at, netket_at = bytes_of(vmcgrad_grad), bytes_of(netket_step)

    def vmcgrad_fits(n, budget):
        # auto_chunk_size needs arrays (it runs nothing on them): zeros, placed like the samples
        samples = jnp.zeros((n, L), x0.dtype, device=sharding)
        try:
            chunk = vmcgrad.auto_chunk_size(
                logpsi, params, samples, estimator="expect_grad", memory_budget=budget
            )
        except MemoryError:
            return None
        finally:
            samples.delete()
        return vmcgrad_at(n, chunk)

    progs = {"vmcgrad auto": StepProgram(vmcgrad_fits, lambda n: vmcgrad_at(n, 1))}
    progs.update({f"vmcgrad chunk={c}": _fixed(partial(vmcgrad_at, chunk=c)) for c in vmcgrad_chunks})
    progs.update({f"netket chunk={c}": _fixed(partial(netket_at, chunk=c)) for c in netket_chunks})
    progs["netket unchunked"] = _fixed(partial(netket_at, chunk=None))
    return progs


def largest_doubling_n(program: StepProgram, budget: int, *, n_min: int, n_max: int) -> dict:
    """Doubles N from ``n_min`` while the step fits ``budget``; the last fitting N and the next one (the
    table's N are powers of two times ``n_min``; :func:`benchlib.large.largest_n` bisects instead).

    Returns:
        ``{"largest_n", "chunk", "mib", "next_n", "next_chunk", "next_mib"}``: ``largest_n`` is None
        when ``n_min`` does not fit; ``next_*`` describe the first N that does not fit (None past
        ``n_max``) at its smallest footprint (:attr:`StepProgram.least`), which exceeds the budget.

    Examples:
        >>> need = lambda n: (None, 100 * n)  # an unchunked toy: 100 bytes per sample
        >>> toy = StepProgram(lambda n, b: need(n) if need(n)[1] <= b else None, need)
        >>> r = largest_doubling_n(toy, 2**20, n_min=1024, n_max=2**20)  # budget 1 MiB
        >>> r["largest_n"], r["next_n"], r["next_mib"]
        (8192, 16384, 1.5625)
    """
    best, n = None, n_min
    while n <= n_max:
        got = program.fits(n, budget)
        if got is None:
            break
        best, n = (n, *got), 2 * n
    out = dict.fromkeys(("largest_n", "chunk", "mib", "next_n", "next_chunk", "next_mib"))
    if best is not None:
        out.update(largest_n=best[0], chunk=best[1], mib=best[2] / MIB)
    if n <= n_max:
        chunk, need = program.least(n)
        out.update(next_n=n, next_chunk=chunk, next_mib=need / MIB)
    return out


def largest_n_table(
    *,
    budgets_mib: Sequence[float] = (16, 64, 256),
    L: int = 48,
    alpha: int = 1,
    netket_chunks: Sequence[int] = (1024,),
    vmcgrad_chunks: Sequence[int] = (1024,),
    n_min: int = 1024,
    n_max: int = 2**24,
    log: Any = print,
) -> list[dict]:
    """Largest power-of-two N whose gradient step fits each per-device budget, per implementation.

    Returns:
        One dict per (budget, implementation): ``budget_mib``, ``impl``, ``L``, ``alpha``,
        ``devices`` and the fields of :func:`largest_doubling_n`.
    """
    progs = step_programs(L=L, alpha=alpha, netket_chunks=netket_chunks, vmcgrad_chunks=vmcgrad_chunks)
    rows = []
    for budget_mib in budgets_mib:
        for name, program in progs.items():
            r = largest_doubling_n(program, int(budget_mib * MIB), n_min=n_min, n_max=n_max)
            setting = {"budget_mib": budget_mib, "impl": name, "L": L, "alpha": alpha}
            rows.append({**setting, "devices": jax.device_count(), **r})
            log(f"[budget {budget_mib} MiB] {name}: largest N {r['largest_n']} (chunk {r['chunk']})")
    return rows


def format_largest_n(rows: Sequence[dict]) -> str:
    """Plain-text table of :func:`largest_n_table` rows."""
    return table(
        rows,
        [
            Column("budget MiB", "budget_mib", "g"),
            Column("impl", "impl", align="<"),
            Column("largest N", "largest_n"),
            Column("chunk", "chunk"),
            Column("MiB at N", "mib", ".2f"),
            Column("next N", "next_n"),
            Column("chunk", "next_chunk"),
            Column("MiB at next", "next_mib", ".2f"),
        ],
    )


# --- scale-out: devices and processes -------------------------------------------------------------


def init_distributed(process_id: int, num_processes: int, port: int, devices_per_process: int) -> None:
    """Joins JAX's distributed runtime on 127.0.0.1 (coordinator and gloo bound to loopback).

    Call before any other JAX work and before importing NetKet (its mesh spans ``jax.devices()``,
    all processes' devices).
    """
    jax.config.update("jax_num_cpu_devices", devices_per_process)
    jax.config.update("jax_enable_x64", True)
    vmcgrad.initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without XLA_/JAX_/NETKET_ settings (a child sets its own), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "NETKET_"))}
    env.update(extra or {})
    return env


def launch_processes(
    command: Callable[[int, int], list[str]], num_processes: int, *, timeout: float, env: dict | None = None
) -> list[str]:
    """Runs ``command(process_id, port)`` for every process at once; returns their outputs.

    The port is a free loopback port; every child still running at the end (timeout, error) is
    killed. Raises ``RuntimeError`` with the output tail if a process fails or times out.
    """
    port = free_port()
    procs = []
    try:
        for pid in range(num_processes):
            procs.append(
                subprocess.Popen(
                    command(pid, port),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"process {procs.index(p)} timed out after {timeout} s") from err
    finally:
        for p in procs:  # kill every child, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    for pid, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            raise RuntimeError(f"process {pid} exited with {p.returncode}:\n{log[-3000:]}")
    return logs


def scale_out_rows(
    *, L: int = 48, n_samples: int = 8192, chunk_size: int = 512, repeats: int = 5, log: Any = print
) -> list[dict]:
    """``batched_vjp`` and ``expect_grad`` (and their NetKet / ``jax.vjp`` counterparts) on all devices.

    Uses the candidate builders of :mod:`benchlib.core` (RBM, float64 parameters) and
    :mod:`benchlib.grad` (RBMModPhase), which cross-check the results before anything is timed.

    Returns:
        One dict per (bench, implementation): ``processes``, ``devices``, ``N``, ``L``, ``chunk``,
        ``median_s``, ``times_s``, ``cpu_s`` (process CPU time per timed call: steadier than wall
        time on a shared machine; process 0's in a multi-process run), ``temp_mib``/``arg_mib``/
        ``out_mib`` per device, and the collectives per call as ``"op:count ..."`` strings
        ``coll_in_loops``/``coll_outside``.
    """
    from . import core, grad

    builders = {
        "batched_vjp": lambda: core.candidates("float64", L=L, n_samples=n_samples, chunk_size=chunk_size),
        "expect_grad": lambda: grad.candidates(L=L, n_samples=n_samples, chunk_size=chunk_size),
    }
    setting = {"processes": jax.process_count(), "devices": jax.device_count()}
    out = []
    for bench, build in builders.items():
        cands, info = build()
        errs = format_errors(info["max_rel_err_vs_jax.vjp"])
        log(f"[{setting}] {bench}: results agree; max rel. error vs jax.vjp: {errs}")
        for c, row in zip(cands, measure(bench, setting, cands, repeats=repeats)):
            m = c.compiled.memory_analysis()
            report = vmcgrad.collective_report(c.compiled)
            out.append(
                {
                    **row.as_dict(),
                    "N": n_samples,
                    "L": L,
                    "chunk": chunk_size,
                    "temp_mib": m.temp_size_in_bytes / MIB,
                    "arg_mib": m.argument_size_in_bytes / MIB,
                    "out_mib": m.output_size_in_bytes / MIB,
                    "coll_in_loops": _ops(report.in_loops),
                    "coll_outside": _ops(report.outside),
                }
            )
    return out


def _ops(counter: Any) -> str:
    return " ".join(f"{op}:{k}" for op, k in sorted(counter.items())) or "none"


def format_scale_out(rows: Sequence[dict]) -> str:
    """Plain-text scale-out table, grouped by bench, then processes × devices."""
    return table(
        sorted(rows, key=lambda r: (r["bench"], r["processes"], r["devices"])),
        [
            Column("bench", "bench", align="<"),
            Column("procs", "processes"),
            Column("devs", "devices"),
            Column("impl", "name", align="<"),
            Column("median ms", lambda r: r["median_s"] * 1e3, ".1f"),
            Column("cpu ms", lambda r: statistics.median(r["cpu_s"]) * 1e3, ".1f"),
            Column("temp MiB", "temp_mib", ".2f"),
            Column("arg MiB", "arg_mib", ".2f"),
            Column("collectives in loops", "coll_in_loops", align="<"),
            Column("outside", "coll_outside", align="<"),
        ],
    )
