r"""What a compiled program costs on an accelerator: its operations in sequence, FLOPs and bytes,
weighted by how often each runs.

On a GPU or a TPU every operation the program runs one after another pays a fixed cost (a kernel
launch, a scheduled region, a loop iteration's synchronisation) whatever its size, so a program of
many small operations is slow however few FLOPs it does. This module reads the optimized HLO
(``compiled.as_text()``, parsed by :mod:`vmcgrad._hlo.collectives`) and models

.. math::

    t = n_{\text{ops}}\, t_{\text{op}} + \frac{\text{FLOPs}}{\text{peak}}
        + \frac{\text{bytes}}{\text{bandwidth}}

with the constants of a platform (:data:`PLATFORMS`). What is counted:

- **ops**: each instruction of the entry computation counts 1 (a fusion is one op, whatever it fuses;
  the ops inside a fusion are not counted). Free ops count 0: ``parameter``, ``constant``, ``tuple``,
  ``get-tuple-element``, ``bitcast``, ``opt-barrier``, ``after-all``, ``add-dependency``, ``domain``,
  ``partition-id``, ``replica-id`` and the ``*-done`` / ``*-update`` halves of asynchronous ops (their
  ``*-start`` counts 1). A ``while`` counts its trip count times its body's and its condition's
  counts, recursively. The trip count is ``known_trip_count`` in the loop's backend config (XLA:CPU
  and XLA:GPU write it), else read from the loop (XLA:TPU writes none): a condition comparing a
  counter with a constant (``i < n``, ``<=``, ``>``, ``>=``), the counter starting at a constant and
  the body adding a constant to it, as ``fori_loop`` and ``scan`` compile. A loop whose count only a
  run decides (a ``while_loop`` that stops on a tolerance: CG) is counted at the count its author
  expects where the loop was traced inside ``with expected_trips(n):`` (:func:`expected_trips`, a name
  scope the loop's ``op_name`` carries; the innermost such scope counts) and reported
  (``assumed_trip_loops``). Any other loop is counted as one trip and reported
  (``unknown_trip_loops``: the counts are then lower bounds). A
  ``conditional`` counts the **mean** of its branches (the compiled program does not say how often
  each is taken); a ``call`` counts its callee's ops (inlined). Ops that apply a small computation to
  elements (``reduce``, ``sort``, ``scatter``, ``map``, ...) count 1; their computation is not walked.
- **FLOPs**, per op, weighted like the ops: ``dot`` :math:`2\,\prod(\text{result})\,\prod(\text{contracted})`;
  ``convolution`` :math:`2\,\prod(\text{result})\,\prod(\text{kernel})/\text{output features}`
  (both :math:`\times 4` for complex results: a complex multiply-add is 8 real FLOPs); ``fft``
  :math:`5\, n \log_2 n` per transform of :math:`n = \prod(\text{fft\_length})` points (half that for
  real transforms); ``reduce`` and ``all-reduce`` one per input element; ``reduce-window`` one per
  result element and window element; ``sort`` :math:`\lceil\log_2 m\rceil` per element, :math:`m` the
  sorted dimension; data movement (``copy``, ``broadcast``, ``transpose``, ``reshape``, slices,
  ``concatenate``, ``pad``, ``gather``, ``convert``, ``iota``, collectives other than reductions) 0;
  every other op (elementwise arithmetic, transcendental functions, comparisons, ``select``) one per
  result element, real or complex. A fusion's FLOPs are those of the ops it fuses, counted so; a
  cuBLAS/cuDNN-style ``custom-call`` with ``dot_dimension_numbers`` in its backend config as a ``dot``;
  a LAPACK or cuSOLVER factorisation of n x n matrices (XLA:CPU's and XLA:GPU's ``custom-call``
  targets ``*potrf*``, ``*getrf*``, ``*syevd*``, ``*heevd*``) :math:`n^3/3` (Cholesky),
  :math:`2n^3/3` (LU) or :math:`9n^3` (symmetric eigendecomposition with vectors) per matrix, a
  triangular solve (``*trsm*``) :math:`n^2` per right-hand side, complex 4 times as many; any other
  ``custom-call`` 0.
- **bytes**, per counted op, weighted like the ops: the bytes of its operands and of its result (what
  a kernel reads from and writes to memory), except where it touches only a slice: a ``slice``,
  ``dynamic-slice`` or ``gather`` reads and writes its result's bytes, a ``dynamic-update-slice``
  (in place) its update's, an asynchronous ``copy-start`` or ``slice-start`` (XLA:TPU's, whose result
  holds the operand beside the destination) its destination's; inside a fusion, an operand used
  only by a ``slice``, ``dynamic-slice`` or ``gather`` counts the bytes sliced, an operand updated
  in place by the fusion's root ``dynamic-update-slice`` counts 0 and the root counts its update's
  bytes. ``while``, ``conditional`` and ``call`` move no bytes themselves (their bodies do).

XLA's own ``compiled.cost_analysis()`` counts a loop body once, whatever its trip count; these counts
multiply it by its trips. The counts are of the program as compiled: a program compiled for the CPU
approximates the one XLA compiles for an accelerator (fusion decisions differ), which is what lets a
choice for a GPU or a TPU be modelled and tested on a CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from vmcgrad._hlo.ops import _FREE, _OP_NAME, _TRIPS, OpCosts


class Platform(NamedTuple):
    """The constants of the cost model for one platform.

    Attributes:
        name: the platform's name (a key of :data:`PLATFORMS`).
        t_op: seconds each op in sequence costs, whatever its size.
        peak_flops: FLOP per second.
        bandwidth: bytes per second, to and from the device's memory.
        source: where the constants come from.
    """

    name: str
    t_op: float
    peak_flops: float
    bandwidth: float
    source: str


#: Platform name -> :class:`Platform`: the cost model's constants (read-only).
#:
#: - ``cpu``: this project's 2-core x86_64 machines. ``t_op`` 1 µs: XLA:CPU runs one thunk per op, a
#:   function call and its bookkeeping, of the order of a microsecond (``benchmarks/calibrate_op_cost.py``
#:   measures it); peak 50 GFLOP/s: two cores of 8-wide float32 FMA at about 3 GHz give about 100
#:   GFLOP/s at best, about half in XLA's matmuls; bandwidth 20 GB/s: one DDR4 channel's order.
#: - ``gpu``: an NVIDIA H200. ``t_op`` 5 µs: a kernel launch and its wait, a few µs (the figure of
#:   vmcgrad's issue 47); peak 60 TFLOP/s: NVIDIA's float32 (non-tensor-core) figure for the H200 SXM,
#:   67 TFLOP/s, rounded down; bandwidth 4.8 TB/s: NVIDIA's HBM3e figure.
#: - ``tpu``: one Google TPU v5e chip. ``t_op`` 10 µs: the issue's figure, which reproduced the
#:   measured ratio of vmcgrad's and NetKet's SR phases on a v5e (20.3x measured, 23.6x modelled);
#:   peak 50 TFLOP/s: Google's 197 TFLOP/s is bfloat16; float32 matmuls run in several bfloat16
#:   passes, about a quarter of it; bandwidth 819 GB/s: Google's HBM2 figure for the v5e.
PLATFORMS: Mapping[str, Platform] = MappingProxyType(
    {
        "cpu": Platform(
            "cpu", 1e-6, 50e9, 20e9, "2-core x86_64: XLA:CPU thunk ~1 us, 2 cores x 8-wide FMA, DDR4"
        ),
        "gpu": Platform("gpu", 5e-6, 60e12, 4.8e12, "NVIDIA H200 SXM: launch ~5 us, float32, HBM3e"),
        "tpu": Platform("tpu", 10e-6, 50e12, 819e9, "Google TPU v5e: issue 47's t_op, float32-ish, HBM2"),
    }
)
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


class Loop(NamedTuple):
    """A ``while`` loop of the program.

    Attributes:
        name: the HLO instruction's name.
        source: the JAX operation it came from (its ``op_name`` metadata), or "".
        trip_count: its trip count, None where the compiled program does not know it.
        ops_per_trip: the ops one trip runs (body and condition, inner loops by their trips).
        loops: the loops its body and condition run, the same way.
    """

    name: str
    source: str
    trip_count: int | None
    ops_per_trip: float
    loops: tuple[Loop, ...]


class ProgramCost(NamedTuple):
    """What a compiled program costs (:func:`program_cost`): its counts and its modelled time.

    Attributes:
        ops: operations run in sequence, loops by their trip counts, conditionals by the mean of
            their branches.
        flops: floating-point operations, weighted the same way.
        bytes: bytes read and written by those operations, weighted the same way.
        loops: the entry computation's loops (each with the loops it runs).
        unknown_trip_loops: the names of the loops whose trip count the program does not know
            and no :func:`expected_trips` states (counted as one trip: the counts are then lower
            bounds).
        platform: the platform of ``modelled_seconds``.
        modelled_seconds: ``ops * t_op + flops / peak_flops + bytes / bandwidth`` on that platform.
        assumed_trip_loops: the names of the loops of unknown trip count counted at the count
            :func:`expected_trips` states (their :class:`Loop` ``trip_count`` is that count).
    """

    ops: float
    flops: float
    bytes: float
    loops: tuple[Loop, ...]
    unknown_trip_loops: tuple[str, ...]
    platform: str
    modelled_seconds: float
    assumed_trip_loops: tuple[str, ...] = ()

    def time(self, platform: str | Platform) -> float:
        """The modelled seconds on another platform: a name of :data:`PLATFORMS` or a
        :class:`Platform` of one's own constants."""
        p = _platform(platform)
        return self.ops * p.t_op + self.flops / p.peak_flops + self.bytes / p.bandwidth


def _platform(platform: str | Platform) -> Platform:
    if isinstance(platform, Platform):
        return platform
    name = _ALIASES.get(platform.lower(), platform.lower())
    if name not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: expected one of {sorted(PLATFORMS)} or a Platform")
    return PLATFORMS[name]


#: The prefix of :func:`expected_trips`'s name scope, followed by the count.
EXPECTED_TRIPS = "vmcgrad_expected_trips_"
_EXPECTED = re.compile(re.escape(EXPECTED_TRIPS) + r"(\d+)(?:/|$)")


def expected_trips(n: int) -> Any:
    """A name scope (``with expected_trips(50): ...``) stating that a loop traced inside it whose trip
    count the compiled program does not know (a ``while_loop`` that stops on a tolerance) is expected
    to run ``n`` trips: :func:`program_cost` counts it ``n`` times and lists it in
    ``assumed_trip_loops``. A loop of known trip count keeps its own. Changes nothing in the program
    but its ops' ``op_name`` metadata."""
    import jax

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"expected_trips: the count must be an int >= 0; got {n!r}")
    return jax.named_scope(f"{EXPECTED_TRIPS}{n}")


class _Cost(NamedTuple):
    ops: float
    flops: float
    bytes: float
    loops: tuple[Loop, ...]
    unknown: tuple[str, ...]
    assumed: tuple[str, ...] = ()


class _Program(OpCosts):
    """An HLO module's ops, FLOPs and bytes, each weighted by how often it runs; memoised by computation."""

    def __init__(self, text: str):
        super().__init__(text)
        self._cost: dict[str, _Cost] = {}

    def cost(self, comp: str) -> _Cost:
        """The ops, FLOPs, bytes, loops and unknown-trip loops of a non-fused computation."""
        if comp in self._cost:
            return self._cost[comp]
        ops = flops = nbytes = 0.0
        loops: list[Loop] = []
        unknown: list[str] = []
        assumed: list[str] = []
        for i in self.comps.get(comp, ()):
            op = i.opcode
            if op in _FREE or op.endswith("-done") or op.endswith("-update"):
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", i.attrs)
                cond = re.search(r"condition=%?([\w.\-]+)", i.attrs)
                parts = [self.cost(m.group(1)) for m in (body, cond) if m]
                trips = _TRIPS.search(i.attrs)
                n = int(trips.group(1)) if trips else self.loop_trips(i, comp)
                per = _Cost(
                    sum(p.ops for p in parts),
                    sum(p.flops for p in parts),
                    sum(p.bytes for p in parts),
                    tuple(lp for p in parts for lp in p.loops),
                    tuple(u for p in parts for u in p.unknown),
                    tuple(a for p in parts for a in p.assumed),
                )
                source = _OP_NAME.search(i.attrs)
                source = source.group(1) if source else ""
                stated = _EXPECTED.findall(source) if n is None else []
                if stated:  # counted at the count its author expects (expected_trips)
                    n = int(stated[-1])
                    assumed.append(i.name)
                w = 1 if n is None else n
                ops, flops, nbytes = ops + w * per.ops, flops + w * per.flops, nbytes + w * per.bytes
                loops.append(Loop(i.name, source, n, per.ops, per.loops))
                unknown += ([i.name] if n is None else []) + list(per.unknown)
                assumed += list(per.assumed)
            elif op == "conditional":
                names = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", i.attrs)
                branches = re.search(r"branch_computations=\{([^}]*)\}", i.attrs)
                if branches:
                    names += [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
                parts = [self.cost(b) for b in names] or [_Cost(0.0, 0.0, 0.0, (), ())]
                ops += sum(p.ops for p in parts) / len(parts)
                flops += sum(p.flops for p in parts) / len(parts)
                nbytes += sum(p.bytes for p in parts) / len(parts)
                loops += [lp for p in parts for lp in p.loops]
                unknown += [u for p in parts for u in p.unknown]
                assumed += [a for p in parts for a in p.assumed]
            elif op == "call":
                for callee in re.findall(r"to_apply=%?([\w.\-]+)", i.attrs):
                    p = self.cost(callee)
                    ops, flops, nbytes = ops + p.ops, flops + p.flops, nbytes + p.bytes
                    loops += p.loops
                    unknown += p.unknown
                    assumed += p.assumed
            else:
                ops += 1
                flops += self.flops(i, comp)
                nbytes += self.op_bytes(i, comp)
        self._cost[comp] = _Cost(ops, flops, nbytes, tuple(loops), tuple(unknown), tuple(assumed))
        return self._cost[comp]


def _own_platform(compiled: Any) -> str:
    import jax

    if not isinstance(compiled, str):
        try:
            shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
            for s in shardings:
                for d in getattr(s, "device_set", ()):
                    return d.platform
        except Exception:  # a Compiled-like object without shardings: the default backend's
            pass
    return jax.devices()[0].platform


def program_cost(compiled: Any, platform: str | Platform | None = None) -> ProgramCost:
    r"""What a compiled program costs on an accelerator: its ops in sequence, FLOPs and bytes, each
    weighted by how often it runs, and the modelled time

    .. math::

        t = n_{\text{ops}}\, t_{\text{op}} + \frac{\text{FLOPs}}{\text{peak}}
            + \frac{\text{bytes}}{\text{bandwidth}}.

    On a GPU or a TPU a program costs about the number of ops it runs one after another (each pays a
    launch or a scheduled region, however small); XLA's ``compiled.cost_analysis()`` counts a loop's
    body once, whatever its trip count, and counts no ops. What each count includes is in
    :mod:`vmcgrad._hlo.cost`'s documentation: a fusion is one op; a ``while`` counts its trip
    count (its ``known_trip_count``, or read from its counter, or stated by :func:`expected_trips`
    where only a run decides it) times its body's and condition's counts, recursively; a
    ``conditional`` the
    mean of its branches; a ``call`` its callee; ``dot``, ``convolution`` and ``fft`` FLOPs from their
    shapes; bytes from operand and result shapes (slices and in-place updates by the bytes they
    touch). The constants of each platform, and where they come from, are in
    :data:`vmcgrad._hlo.cost.PLATFORMS`.

    Args:
        compiled: a ``jax.stages.Compiled`` (``jitted.lower(*args).compile()``) or its ``as_text()``
            string (the optimized HLO).
        platform: the platform to model: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``"cuda"`` and ``"rocm"``
            are ``"gpu"``), or a :class:`~vmcgrad._hlo.cost.Platform` of one's own constants; None:
            the platform of the program's devices (of ``jax.devices()[0]`` for a string).

    Returns:
        A :class:`ProgramCost`; ``cost.time("tpu")`` models the same counts on another platform.

    Example:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> f = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, y: jnp.sin(y) @ y, x))
        >>> cost = vmcgrad.program_cost(f.lower(jnp.ones((8, 8))).compile(), platform="tpu")
        >>> [(loop.trip_count, loop.ops_per_trip >= 2) for loop in cost.loops]
        [(10, True)]
        >>> cost.flops >= 10 * 2 * 8**3  # the matmul, ten times
        True
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    name = platform if platform is not None else _own_platform(compiled)
    p = _platform(name)
    program = _Program(text)
    entry = program.entry or next(iter(program.comps), "")
    c = program.cost(entry)
    seconds = c.ops * p.t_op + c.flops / p.peak_flops + c.bytes / p.bandwidth
    return ProgramCost(c.ops, c.flops, c.bytes, c.loops, c.unknown, p.name, seconds, c.assumed)


def loops_table(loops: tuple[Loop, ...], indent: str = "") -> str:
    """The loops, nested, one a line: name, trips, ops per trip and source (for reports)."""
    lines = []
    for lp in loops:
        trips = "?" if lp.trip_count is None else str(lp.trip_count)
        lines.append(f"{indent}{lp.name}: {trips} trips x {lp.ops_per_trip:g} ops  {lp.source}")
        if lp.loops:
            lines.append(loops_table(lp.loops, indent + "  "))
    return "\n".join(lines)
