"""What each phase of a ``vmcgrad vmc`` step costs in memory: the compiled temp bytes per device.

A step has three phases: sampling with the local energies (NetKet's sampler and chunked local kernel),
the gradient (:func:`vmcgrad.expect_grad`'s pass, the force of SR), and the preconditioner — with
``--driver sr`` one QGT product :math:`S v` (:func:`vmcgrad.QGT`, applied once per CG iteration), with
``--driver minsr`` the whole sample-space update (:func:`vmcgrad.minsr_update` on the route the driver
took: the :math:`N\\times N` kernel in blocks and its solve, the :math:`P\\times P` matrix, or
matrix-free CG). The last two are vmcgrad's programs: :func:`bytes_of_phases` compiles each on the
state's current samples (without running it) and reads ``memory_analysis()``. The sample count only
changes when ``--grow-samples`` raises it, so a run measures once per N (:class:`PhaseBytes`).
"""

from __future__ import annotations

import math
from typing import Any

import vmcgrad

#: The route of ``--driver sr``: parameter-space SR, the QGT applied matrix-free inside CG.
SR_ROUTE = "qgt-cg"


def log_psi(vstate: Any) -> Any:
    """``logpsi(params, samples)`` of ``vstate``'s model, its model state closed over as data
    (:func:`vmcgrad.netket._expect_grad.state_log_psi`: one compiled program per model)."""
    # imported here: `vmcgrad vmc --help` imports this module, and must import neither JAX nor NetKet
    from vmcgrad.netket._expect_grad import state_log_psi

    return state_log_psi(vstate)


def abstract_samples(vstate: Any, n: int) -> Any:
    """``n`` samples as the sampler lays them out (shape, dtype and sharding of its chains'
    configurations), without sampling: a measurement must not move the sampler's random state."""
    import jax

    sigma = vstate.sampler_state.σ
    return jax.ShapeDtypeStruct((n, sigma.shape[-1]), sigma.dtype, sharding=sigma.sharding)


def route_of(driver: Any) -> str:
    """The route the driver's last step took: ``VMC_SR``'s (``dense``, ``parameter`` or ``cg``), else
    :data:`SR_ROUTE`."""
    if not hasattr(driver, "use_ntk"):  # nk.driver.VMC with SR
        return SR_ROUTE
    return str(getattr(driver, "route", None) or "dense")


def stand_in_samples(vstate: Any, n: int) -> Any:
    """``n`` zero configurations laid out as the sampler's samples (:func:`abstract_samples`, as an
    array): what a choice of chunks that compiles, or reads only the shapes, runs on before anything
    is sampled."""
    import jax
    import jax.numpy as jnp

    x = abstract_samples(vstate, n)
    return jax.device_put(jnp.zeros(x.shape, x.dtype), x.sharding)


def chunks_or_exit(args, choose: Any, then: Any = None) -> Any:
    """``choose()`` (the run's chunks, chosen within ``--memory-budget`` before anything is sampled);
    where no chunk of a program fits the budget, a usage error (exit 2) with a budget that holds one
    sample per chunk, in the option's terms. ``then(budget)``, optional: the checks that run after
    ``choose`` (the MinSR route's, the QGT's), at ``budget`` bytes, returning the bytes the first
    that does not fit needs at one sample per chunk, or None where all fit: the budget named is
    raised until they fit too (:func:`holding`), so that the fix given is one that runs."""
    try:
        return choose()
    except MemoryError as error:
        need = getattr(error, "need", None)
        if need is None:
            raise
        budget = "the default budget" if args.memory_budget is None else _size(args.memory_budget)
        program = str(error).split(":")[0]  # vmcgrad.auto_chunk_size (the gradient) or vmcgrad.QGT
        what = "the QGT products" if "QGT" in program else "the gradient"
        fix = enough_bytes(need) if then is None else holding(enough_bytes(need), then)
        args._parser.error(
            f"argument --memory-budget: no chunk of {what} fits {budget} per device; one sample per "
            f"chunk needs {_size(need)}. Fix: pass --memory-budget {_spelled(fix)}"
        )


def need_at(check: Any) -> int | None:
    """The bytes at one sample per chunk that ``check()`` says its program needs (its
    ``MemoryError``'s ``need``), or None where it passes (or fails otherwise)."""
    try:
        check()
    except MemoryError as error:
        return getattr(error, "need", None)
    return None


def holding(budget: int, then: Any, tries: int = 3) -> int:
    """The least budget of the raises ``enough_bytes(then(b))`` from ``budget`` at which ``then``
    (the later checks, as :func:`chunks_or_exit`'s) finds nothing over it (each raise at least
    doubles the need that failed: a few at most), or the last raise after ``tries``."""
    for _ in range(tries):
        need = then(budget)
        if need is None:
            break
        budget = max(budget, enough_bytes(need))
    return budget


def enough_bytes(need: int) -> int:
    """The budget that holds a program needing ``need`` bytes at the budget it failed: ``2 * need``
    (:func:`vmcgrad._sr.ntk.routes.enough`), rounded up to a whole MiB, or KiB below one."""
    scale = 2**20 if 2 * need >= 2**20 else 2**10
    return math.ceil(2 * need / scale) * scale


def _spelled(nbytes: int) -> str:
    """``--memory-budget``'s spelling of a whole number of MiB, or of KiB below one."""
    return f"{nbytes // 2**20}MiB" if nbytes >= 2**20 else f"{math.ceil(nbytes / 2**10)}KiB"


def _enough(need: int) -> str:
    """``--memory-budget``'s value that holds a program needing ``need`` bytes at the budget it failed
    (:func:`enough_bytes`).

    Examples:
        >>> _enough(3 * 2**20), _enough(4608)
        ('6MiB', '9KiB')
    """
    return _spelled(enough_bytes(need))


def _size(nbytes: int) -> str:
    """``"64.0 MiB"``, or ``"4.5 KiB"`` below a MiB.

    Examples:
        >>> _size(64 * 2**20), _size(4608)
        ('64.0 MiB', '4.5 KiB')
    """
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def route_or_exit(args, driver, n: int, min_samples: int = 1) -> str:
    """The route of ``--driver minsr`` at ``n`` samples (compiled, not run: nothing is sampled); where
    no route fits the budget, a usage error (exit 2) with the budget that fits and the samples this
    one holds, where those are at least ``min_samples`` (the fewest ``--samples`` takes)."""
    try:
        return driver.route_at(n)
    except MemoryError as error:
        need = getattr(error, "need", None)
        if need is None:
            raise
        budget = "the default budget" if args.memory_budget is None else _size(args.memory_budget)
        fewer = getattr(error, "max_samples", None)
        fewer = f", or at most --samples {fewer} at this budget" if fewer and fewer >= min_samples else ""
        args._parser.error(
            f"argument --memory-budget: no route of the MinSR update fits {budget} per device at "
            f"{n} samples; the smallest, matrix-free CG, needs {_size(need)}. Fix: pass "
            f"--memory-budget {_enough(need)}{fewer}"
        )


def route_choice(driver: Any, n: int) -> dict | None:
    """The record of the route of ``--driver minsr`` at ``n`` samples, JSON-able
    (:meth:`vmcgrad.netket.VMC_SR.route_choice_at`, ``Choice.as_dict()``): ``value`` ``[route, chunk]``,
    ``seconds`` its modelled time on ``platform``, ``priced`` each route that fits with its own;
    None where a route given does not fit (the step then says why)."""
    choice = driver.route_choice_at(n)
    return None if choice is None else choice.as_dict()


def modelled_time_of(driver: Any) -> float | None:
    """The modelled seconds of the route the driver's last step took (``VMC_SR``'s record), else None."""
    choice = getattr(driver, "route_choice", None)
    return None if choice is None else choice.seconds


def bytes_of_phases(
    vstate: Any,
    n: int,
    chunks: dict,
    design: str,
    memory_budget: int | None,
    diag_shift: float,
    driver: Any,
) -> dict[str, int]:
    """The compiled temp bytes per device of the gradient pass and of the preconditioner's program
    (``"qgt"``: the largest of the programs the driver runs with the QGT, :func:`qgt_bytes`;
    ``"kernel"``: the MinSR update on the driver's route)
    at ``n`` samples laid out as the sampler's, at the run's chunks (``"auto"`` chunks chosen within
    ``memory_budget``). Compiled, not run: abstract samples, nothing sampled."""
    import jax

    logpsi, w, x = log_psi(vstate), vstate.parameters, abstract_samples(vstate, n)
    out = jax.eval_shape(logpsi, w, x)
    e = jax.ShapeDtypeStruct((n,), out.dtype, sharding=x.sharding)
    budget = {"memory_budget": memory_budget}

    def gradient(w, x, e):
        return vmcgrad.expect_grad(logpsi, w, x, e, chunk_size=chunks["gradient"], **budget)

    phases = {"gradient": jax.jit(gradient).lower(w, x, e).compile()}
    if "qgt" in chunks:  # the largest of the programs the driver runs: O-bar's pass and NetKet's solve
        return {
            "gradient": vmcgrad.program_bytes(phases["gradient"]),
            "qgt": qgt_bytes(logpsi, w, x, chunks, design, memory_budget, diag_shift),
        }
    else:
        route = getattr(driver, "route", None)
        options = {"route": route} if route is not None else {}

        def kernel(w, x, e):
            return vmcgrad.minsr_update(
                logpsi,
                w,
                x,
                e,
                diag_shift=diag_shift,
                mode=str(driver.mode),
                chunk_size=chunks["kernel"],
                **budget,
                **options,
            )[0]

        phases["kernel"] = jax.jit(kernel).lower(w, x, e).compile()
    return {name: vmcgrad.program_bytes(compiled) for name, compiled in phases.items()}


def qgt_bytes(
    logpsi: Any, w: Any, x: Any, chunks: dict, design: str, memory_budget: int | None, diag_shift: float
) -> int:
    r"""The compiled bytes per device of the largest program of ``--driver sr``'s QGT phase, as the
    driver runs them (``vmcgrad vmc``'s ``_driver``: ``nk.optimizer.SR`` on
    :func:`vmcgrad.netket.QGTOnTheFly`), compiled, not run (``x`` abstract samples):

    1. the operator's build, :math:`\bar O`'s pass, at its own automatic chunk within the budget
       where the run's chunks are automatic (``chunks`` holds ``"qgt_solve"``), else at the given one;
    2. NetKet's solve of :math:`(S + \lambda) x = g` (``LinearOperator.solve`` with ``SR``'s default
       ``jax.scipy.sparse.linalg.cg``, from the previous step's solution), its products at the
       product's chunk, or on every chunk's linearisation kept where ``kept_solve`` is set.

    Not one program that builds the operator and applies it: the driver never runs that, and at the
    product's chunk its :math:`\bar O` pass can be over the budget the chunk was chosen for (a
    2-D GCNN at 16 MiB: 24.4 MB, docs/performance.md)."""
    import jax

    # deferred, each: `vmcgrad vmc --help` imports this module, and must import neither JAX nor NetKet
    from vmcgrad._problem.problem import auto_chunk, compile_only  # (deferred: JAX)
    from vmcgrad._sr.qgt.qgt import _mean_program  # (deferred: JAX)
    from vmcgrad.netket._qgt import QGTOnTheFlyT, _solve  # (deferred: NetKet)

    auto = "qgt_solve" in chunks
    chunk = "auto" if auto else chunks["qgt"]

    def build(w, x):
        return vmcgrad.QGT(
            logpsi, w, x, chunk_size=chunk, design=design, diag_shift=0.0, memory_budget=memory_budget
        )

    op = jax.eval_shape(build, w, x)  # the operator, its arrays as shapes (O-bar's chunk chosen)
    prob = op.problem
    mean_at = prob.at_chunk(auto_chunk(_mean_program, prob, op) if auto else chunk)
    programs = [compile_only(_mean_program, mean_at, op)]
    lhs = QGTOnTheFlyT(diag_shift=diag_shift, qgt=op)
    g = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), w)
    solver = jax.tree_util.Partial(jax.scipy.sparse.linalg.cg)
    programs.append(_solve.lower(lhs, solver, g, x0=g).compile())
    return max(vmcgrad.program_bytes(c) for c in programs)


class PhaseBytes:
    """:func:`bytes_of_phases`, measured once per (N, route) of a run."""

    def __init__(self, vstate: Any, chunks: dict, design: str, memory_budget: int | None, diag_shift: float):
        self.vstate, self.chunks, self.design = vstate, chunks, design
        self.memory_budget, self.diag_shift = memory_budget, diag_shift
        self.seen: dict[tuple, dict[str, int]] = {}

    def __call__(self, n: int, driver: Any) -> dict[str, int]:
        """The bytes of the step that ran at ``n`` samples on ``driver``'s route."""
        key = (int(n), route_of(driver))
        if key not in self.seen:
            measured = bytes_of_phases(
                self.vstate, n, self.chunks, self.design, self.memory_budget, self.diag_shift, driver
            )
            self.seen = {key: measured}  # the last (N, route) only: N changes rarely, and only grows
        return self.seen[key]
