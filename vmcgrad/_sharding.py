"""Sharding: find the mesh axis the samples are split over and run a per-device body there.

Where the sample axis comes from, in order:

1. the samples' own sharding: a concrete ``NamedSharding`` (eager call) or the sharding in the
   abstract type (``jax.typeof``; Explicit mesh axes, also under ``jax.jit``);
2. otherwise the context mesh (``jax.set_mesh``), as NetKet sets it: all its axes. Under the user's
   ``jax.jit`` an Auto-axis type carries no sharding, so this is what NetKet's set-up relies on;
3. otherwise (no mesh) there is no sample axis: one device, no ``shard_map``, no collectives.

A mesh of one device still goes through ``shard_map`` (so that Explicit-axis types are handled the
same way whatever the device count); its ``psum`` is a no-op.

:func:`per_device` wraps a body in ``jax.shard_map`` so that each device sees only its own samples;
parameters stay replicated and are cast to device-varying (``pcast``) before being differentiated,
so that no implicit reduction enters the loop (see CONTEXT: netket#2228).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


class SampleAxis(NamedTuple):
    """The mesh and axis name(s) the leading sample axis is split over."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    axis: str | tuple[str, ...]

    @property
    def size(self) -> int:
        names = (self.axis,) if isinstance(self.axis, str) else self.axis
        return math.prod(self.mesh.shape[name] for name in names)


def _leading_spec(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 0:
        return sharding.spec[0]
    return None


def find_sample_axis(samples: Any) -> SampleAxis | None:
    """Returns the sample axis of ``samples`` (see module docstring), or None for one device."""
    for leaf in jax.tree.leaves(samples):
        concrete = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
        for sharding in (concrete, _typeof_sharding(leaf)):
            spec = _leading_spec(sharding)
            if spec is not None:
                return SampleAxis(sharding.mesh, spec)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    names = tuple(mesh.axis_names)
    return SampleAxis(mesh, names[0] if len(names) == 1 else names)


def _typeof_sharding(leaf: Any) -> Any:
    try:
        return jax.typeof(leaf).sharding
    except (TypeError, AttributeError):
        return None


def replicate(tree: Any, where: SampleAxis | None) -> Any:
    """Places concrete leaves replicated on the sample mesh (eager calls only).

    Keeps one input signature for the compiled function whatever the parameters' placement was
    (fresh single-device arrays, or the replicated output of a previous step), so that a second
    call does not compile again. Tracers and arrays already in place are left alone.
    """
    if where is None or not isinstance(where.mesh, jax.sharding.Mesh):
        return tree
    target = NamedSharding(where.mesh, P())

    def place(x):
        if isinstance(x, jax.core.Tracer):
            return x
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == where.mesh:
            return x  # already on the mesh: replicated, or parameter-sharded on purpose
        return jax.device_put(x, target)

    return jax.tree.map(place, tree)


def to_varying(tree: Any, where: SampleAxis | None) -> Any:
    """Casts replicated leaves to device-varying inside ``shard_map`` (no-op on one device)."""
    if where is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, where.axis, to="varying"), tree)


def local_count(n: int, where: SampleAxis | None) -> int:
    """Samples per device after :func:`pad_to_devices`: ``ceil(n / devices)``."""
    return n if where is None else -(-n // where.size)


def pad_to_devices(tree: Any, where: SampleAxis | None, fill: Any) -> tuple[Any, int]:
    """Pads the leading axis to a multiple of the device count.

    Only used when the global sample count does not divide evenly over the devices (which a sharded
    array never does); ``fill(leaf, pad)`` gives the rows to append. ``fill`` is one function or
    a pytree prefix of ``tree`` (e.g. ``(repeat_last, zeros_rows)`` for ``(samples, cotangent)``,
    whatever the structure of the samples). Returns ``(tree, n_padded)``.
    """
    n = jax.tree.leaves(tree)[0].shape[0]
    if where is None or n % where.size == 0:
        return tree, n
    pad = where.size - n % where.size

    def pad_subtree(f, sub):
        return jax.tree.map(lambda a: jnp.concatenate([a, f(a, pad)]), sub)

    return jax.tree.map(pad_subtree, fill, tree, is_leaf=callable), n + pad


def unpad(x: jax.Array, n: int, where: SampleAxis | None) -> jax.Array:
    """The first ``n`` rows of a per-sample result padded by :func:`pad_to_devices`.

    A padded global count does not divide over the devices, so the result is gathered first on
    Explicit axes (where slicing a sharded axis unevenly is a type error).
    """
    if where is not None and AxisType.Explicit in where.mesh.axis_types:
        x = jax.sharding.reshard(x, P())
    return x[:n]


def per_device(
    body: Callable[..., Any],
    where: SampleAxis | None,
    in_specs: tuple[Any, ...],
    out_specs: Any,
) -> Callable[..., Any]:
    """Runs ``body`` on each device's shard.

    A spec is ``"samples"`` (split over the sample axis), ``"params"`` (replicated), or a
    ``PartitionSpec`` pytree (e.g. from :func:`param_specs`).

    On one device ``body`` is returned unchanged.
    """
    if where is None:
        return body

    def spec(s):
        if isinstance(s, str):
            return P(where.axis) if s == "samples" else P()
        return s  # a PartitionSpec or a pytree of them (parameter-sharded layouts)

    specs = tuple(spec(s) for s in in_specs)
    run = jax.shard_map(body, mesh=where.mesh, in_specs=specs, out_specs=spec(out_specs))
    if AxisType.Explicit not in where.mesh.axis_types:
        return run

    def run_explicit(*args):
        # Explicit axes: shard_map takes inputs typed as its in_specs (e.g. replicated samples
        # under an Explicit mesh, or samples just padded to the device count): reshard them.
        return run(*(_reshard_to(a, s) for a, s in zip(args, specs)))

    return run_explicit


def _reshard_to(tree: Any, spec: Any) -> Any:
    """``reshard`` every leaf of ``tree`` to ``spec`` (one spec, or a pytree prefix of specs)."""
    is_spec = lambda s: isinstance(s, P)
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda x: jax.sharding.reshard(x, s), sub), spec, tree, is_leaf=is_spec
    )


def sum_over_devices(tree: Any, where: SampleAxis | None) -> Any:
    """The one cross-device reduction: ``psum`` over the sample axis (no-op on one device)."""
    return tree if where is None else jax.lax.psum(tree, where.axis)


def repeat_last(a: jax.Array, pad: int) -> jax.Array:
    """``pad`` copies of the last row of ``a``: valid samples to pad with."""
    return jnp.repeat(a[-1:], pad, axis=0)


def zeros_rows(a: jax.Array, pad: int) -> jax.Array:
    """``pad`` zero rows shaped like the rows of ``a``: a cotangent that adds nothing."""
    return jnp.zeros((pad, *a.shape[1:]), a.dtype)


# --- parameter-sharded (FSDP-like) models -------------------------------------------------------


def param_layout(params: Any, where: SampleAxis | None) -> tuple[int | None, ...]:
    """For each parameter leaf, the dimension split over the sample axis, or None if replicated.

    Read from the leaves' concrete sharding (eager) or their type (Explicit axes). A static,
    hashable tuple in leaf order.
    """
    if where is None:
        return tuple(None for _ in jax.tree.leaves(params))

    def dim(leaf):
        concrete = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
        for sharding in (concrete, _typeof_sharding(leaf)):
            if isinstance(sharding, NamedSharding):
                for d, entry in enumerate(sharding.spec):
                    if entry == where.axis or (isinstance(entry, tuple) and entry == (where.axis,)):
                        return d
        return None

    return tuple(dim(leaf) for leaf in jax.tree.leaves(params))


def param_specs(params: Any, layout: tuple[int | None, ...], where: SampleAxis) -> Any:
    """``PartitionSpec`` pytree for ``params``: the sample axis on each sharded leaf's dimension."""
    leaves, treedef = jax.tree.flatten(params)
    specs = [P() if d is None else P(*([None] * d), where.axis) for d in layout]
    del leaves
    return jax.tree.unflatten(treedef, specs)


def gather_params(params: Any, layout: tuple[int | None, ...], where: SampleAxis | None) -> Any:
    """Inside ``shard_map``, before the loop: all-gather sharded leaves once; cast the rest varying."""
    if where is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    out = [
        jax.lax.pcast(x, where.axis, to="varying")
        if d is None
        else jax.lax.all_gather(x, where.axis, axis=d, tiled=True)
        for x, d in zip(leaves, layout)
    ]
    return jax.tree.unflatten(treedef, out)


def reduce_params(tree: Any, layout: tuple[int | None, ...], where: SampleAxis | None) -> Any:
    """After the loop: ``psum`` replicated leaves, ``psum_scatter`` sharded ones back to shards."""
    if where is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    summed = jax.lax.psum([x for x, d in zip(leaves, layout) if d is None], where.axis)
    it = iter(summed)
    out = [
        next(it) if d is None else jax.lax.psum_scatter(x, where.axis, scatter_dimension=d, tiled=True)
        for x, d in zip(leaves, layout)
    ]
    return jax.tree.unflatten(treedef, out)
