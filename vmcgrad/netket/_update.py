"""The sample-space update as :class:`vmcgrad.netket.VMC_SR` runs it, on the driver's arguments
(:meth:`~vmcgrad.netket.VMC_SR._update_arguments`): traced under ``jax.jit`` (:func:`_update`: the
check of a raised N, and the update with several processes), priced (:func:`_route_choice`), or run
as the program the route's choice compiled (:class:`CompiledUpdate`: each step)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

import vmcgrad
from vmcgrad._sr.ntk import minsr

from ._expect_grad import log_psi


class CompiledUpdate:
    """``update(args, static)``: :func:`_update` on the driver's arguments, run as the compiled
    program the route's choice compiled (:func:`vmcgrad._sr.ntk.minsr.update_executable`), its
    arguments prepared by a small jitted function; both kept for the latest argument signature.

    The first step then compiles the update once: tracing it inside :func:`_update` compiled the
    choice's candidate again around it (33 s and 35 s on the TPU v5e host,
    benchmarks/results/device-tpu-v5e-2026-12-07d). With several processes, :func:`_update` itself
    (the choice lowers its candidates on shapes, not on global arrays).
    """

    def __init__(self):
        self._key, self._run = None, None

    def __call__(self, args: tuple, static: dict) -> Any:
        if jax.process_count() > 1:
            return _update(*args, **static)
        key = (_signature(args), tuple(static.items()))
        if key == self._key:
            prepare, compiled = self._run
            return compiled(*prepare(*args))
        found = []

        def prepare(*a):
            compiled, arguments = _minsr(minsr.update_executable, *a, **static)
            found.append(compiled)
            return arguments

        prepare = jax.jit(prepare)
        arguments = prepare(*args)  # traced once: the choice's executable found
        self._key, self._run = key, (prepare, found[-1])
        return found[-1](*arguments)


def _signature(args: tuple) -> tuple:
    """What the compiled update depends on in its arguments: the tree, and each array's abstract
    value (shape, dtype, weak type) and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)


def _minsr(
    fun,
    model_state,
    params,
    samples,
    local_energies,
    diag_shift,
    proj_reg,
    momentum,
    old_updates,
    *,
    apply_fun,
    platform,
    **static,
):
    """``fun`` (:func:`vmcgrad.minsr_update`, or another entry point of
    :mod:`vmcgrad._sr.ntk.minsr` on its arguments) on the driver's arguments
    (:meth:`vmcgrad.netket.VMC_SR._update_arguments`); ``platform`` is only the trace's key (the
    update reads the platform in force itself: :func:`vmcgrad._sr.ntk.modes.pinned`). The samples
    (any leading axes, NetKet's chains and samples per chain) and their local energies are taken to
    rows here, traced: a step runs no op for them outside the update's programs."""
    del platform
    return fun(
        log_psi(apply_fun, model_state),
        params,
        jax.lax.collapse(samples, 0, samples.ndim - 1),
        local_energies.reshape(-1),
        diag_shift=diag_shift,
        proj_reg=proj_reg,
        momentum=momentum,
        old_updates=old_updates,
        **static,
    )


@partial(
    jax.jit,
    static_argnames=("apply_fun", "mode", "solver", "route", "chunk_size", "memory_budget", "platform"),
)
def _update(*args, **static):
    """:func:`vmcgrad.minsr_update` on the driver's arguments, traced: the check of a raised N
    (:meth:`vmcgrad.netket.VMC_SR._update_fits`, which lowers this at the new N) and each step
    (:class:`CompiledUpdate`, traced the same way) reach ``chunk_size="auto"``'s cache with the
    same key, so the first step at a raised N searches no chunk again (called on placed arrays it
    would: the key holds their placement)."""
    return _minsr(vmcgrad.minsr_update, *args, **static)


def _route_choice(*args, **static):
    """The record of the route :func:`_update` takes on these arguments (traced as :func:`_update`
    traces them, so that the route's chunk search is the one the step finds in the cache)."""
    return _minsr(minsr.update_choice, *args, **static)
