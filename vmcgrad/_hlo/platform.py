"""The platform an automatic choice is priced for: the devices' own, unless overridden.

``chunk_size="auto"`` and the other automatic choices (the QGT product's design; MinSR's route and
Jacobian batch through :func:`vmcgrad._chunks.budget.cheapest`) take, among the candidates whose
compiled program fits the memory budget, the one of least modelled time
(:meth:`vmcgrad._hlo.cost.ProgramCost.time`) on one platform of :data:`vmcgrad._hlo.cost.PLATFORMS`.
:func:`resolve_platform` says which, in this order:

1. an argument of the caller (``vmcgrad.auto_chunk_size(..., platform="tpu")``);
2. the innermost ``with vmcgrad.cost_platform("tpu"):`` (a context variable, as ``jax.default_device``
   and ``jax.set_mesh`` are context managers: it holds for the calls inside it, per thread and task);
3. the environment variable ``VMCGRAD_COST_PLATFORM`` (read at each choice: for a command line run
   such as ``VMCGRAD_COST_PLATFORM=tpu vmcgrad vmc ...``);
4. the platform of the devices the samples are placed on (their mesh), else of ``jax.devices()[0]``.

Overriding the platform changes only which candidate is chosen, never where or how anything runs:
it is how the choice for a GPU or a TPU is made, inspected and tested on a CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

import jax

from vmcgrad._hlo.cost import Platform, _platform

#: The environment variable naming the platform the automatic choices are priced for.
ENV = "VMCGRAD_COST_PLATFORM"

_OVERRIDE: contextvars.ContextVar[Platform | None] = contextvars.ContextVar(
    "vmcgrad_cost_platform", default=None
)


@contextlib.contextmanager
def cost_platform(platform: str | Platform | None) -> Iterator[Platform | None]:
    """Prices the automatic choices made inside the block for ``platform``, whatever the devices.

    ``chunk_size="auto"``, :func:`vmcgrad.auto_chunk_size` and the QGT's design then choose, among
    the candidates whose compiled program fits the memory budget, the one of least modelled time
    :math:`n_\\text{ops} t_\\text{op} + \\text{FLOPs}/\\text{peak} + \\text{bytes}/\\text{bandwidth}`
    (:func:`vmcgrad.program_cost`) with that platform's constants. Only the choice changes: the
    programs still run on the devices they are placed on. Choices are cached per platform.

    Args:
        platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``"cuda"`` and ``"rocm"`` are ``"gpu"``), a
            :class:`vmcgrad._hlo.cost.Platform` of one's own constants, or None to restore the
            default (the environment variable ``VMCGRAD_COST_PLATFORM``, else the devices' own).

    Yields:
        The platform (None for the default).

    Raises:
        ValueError: for an unknown platform name (before the block runs).

    Example:
        >>> import jax.numpy as jnp, vmcgrad
        >>> fun = lambda w, x: jnp.tanh(x @ w).sum(-1)
        >>> w, x = jnp.ones((16, 64)), jnp.ones((1024, 16))
        >>> with vmcgrad.cost_platform("tpu"):  # the chunk a TPU would take, chosen on this machine
        ...     c = vmcgrad.auto_chunk_size(fun, w, x, memory_budget=2**20)
        >>> c & (c - 1) == 0
        True
    """
    resolved = None if platform is None else _checked(platform, "vmcgrad.cost_platform")
    token = _OVERRIDE.set(resolved)
    try:
        yield resolved
    finally:
        _OVERRIDE.reset(token)


def resolve_platform(platform: str | Platform | None = None, mesh: Any = None) -> Platform:
    """The platform an automatic choice is priced for (the module's order): ``platform`` if given,
    else the innermost :func:`cost_platform`, else ``$VMCGRAD_COST_PLATFORM``, else the platform of
    ``mesh``'s devices (a ``jax.sharding.Mesh``; an abstract mesh has none), else of
    ``jax.devices()[0]``."""
    if platform is not None:
        return _checked(platform, "platform")
    override = _OVERRIDE.get()
    if override is not None:
        return override
    env = os.environ.get(ENV)
    if env:
        return _checked(env, f"${ENV}")
    return _platform(_devices_platform(mesh))


def _devices_platform(mesh: Any) -> str:
    devices = None if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh) else mesh.devices
    if devices is not None and getattr(devices, "size", 0):
        return devices.flat[0].platform
    return jax.devices()[0].platform


def _checked(platform: str | Platform, what: str) -> Platform:
    if not isinstance(platform, str | Platform):
        raise TypeError(f"{what}: expected a platform name or a Platform; got {type(platform).__name__}")
    try:
        return _platform(platform)
    except ValueError:
        raise ValueError(
            f"{what}: unknown platform {platform!r}; expected one of 'cpu', 'gpu', 'tpu' ('cuda' and "
            "'rocm' are 'gpu') or a vmcgrad._hlo.cost.Platform of one's own constants."
        ) from None
