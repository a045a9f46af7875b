"""Sharding: which mesh axis the samples are split over, how leaves are laid out, the collectives.

Where the sample axis comes from, in order:

1. the samples' own sharding: a concrete ``NamedSharding`` (eager call) or the sharding in the
   abstract type (``jax.typeof``; Explicit mesh axes, also under ``jax.jit``);
2. otherwise the context mesh (``jax.set_mesh``), as NetKet sets it: all its axes. Under the user's
   ``jax.jit`` an Auto-axis type carries no split, so this is what NetKet's set-up relies on;
   with no context mesh, the Auto mesh a traced sample's type names (all its axes);
3. otherwise (no mesh) there is no sample axis: one device, no ``shard_map``, no collectives.

A mesh of one device still goes through ``shard_map`` (so that Explicit-axis types are handled the
same way whatever the device count); its ``psum`` is a no-op.

Leaves (parameters, vectors like them) are replicated or split along one dimension over the sample
axis (parameter-sharded, FSDP-like models): :func:`layout_of` reads which, :func:`gather` all-gathers
split leaves once before the loop and :func:`reduce` is the one reduction after it (``psum``, or
``psum_scatter`` back to the shards). The per-device runner that uses them is :mod:`vmcgrad._runner`.
"""

from __future__ import annotations

import math
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
        mesh = _traced_auto_mesh(samples)
    if mesh is None or mesh.empty:
        return None
    names = tuple(mesh.axis_names)
    return SampleAxis(mesh, names[0] if len(names) == 1 else names)


def _traced_auto_mesh(samples: Any) -> Any:
    """Under the user's ``jax.jit`` with no context mesh: the Auto-axis mesh (of more than one device)
    in a traced sample's type, or None. On Auto axes jax 0.10.2 types show the mesh but not the split,
    so the samples are split over all its axes, as under ``jax.set_mesh(mesh)`` (a replicated array
    is then just sliced)."""
    for leaf in jax.tree.leaves(samples):
        if not isinstance(leaf, jax.core.Tracer):
            continue
        mesh = getattr(_typeof_sharding(leaf), "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1 and AxisType.Auto in mesh.axis_types:
            return mesh
    return None


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


def local_count(n: int, where: SampleAxis | None) -> int:
    """Rows per device after :func:`pad_to_devices`: ``ceil(n / devices)``."""
    return n if where is None else -(-n // where.size)


def pad_to_devices(tree: Any, where: SampleAxis | None) -> Any:
    """Pads the leading axis of every leaf to a multiple of the device count with copies of its last row.

    Only when the global count does not divide over the devices (a sharded array always does). The
    padded rows are valid inputs for the function and get weight 0 (:mod:`vmcgrad._chunking`).
    """
    n = jax.tree.leaves(tree)[0].shape[0]
    if where is None or n % where.size == 0:
        return tree
    pad = where.size - n % where.size
    return jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), tree)


# --- layouts: which dimension of each leaf is split over the sample axis -------------------------


def layout_of(tree: Any, where: SampleAxis | None) -> tuple[int | None, ...]:
    """For each leaf, the dimension split over the sample axis, or None if replicated.

    Read from the leaves' concrete sharding (eager) or their type (Explicit axes). A static,
    hashable tuple in leaf order.
    """
    if where is None:
        return tuple(None for _ in jax.tree.leaves(tree))

    def dim(leaf):
        concrete = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
        for sharding in (concrete, _typeof_sharding(leaf)):
            if isinstance(sharding, NamedSharding):
                for d, entry in enumerate(sharding.spec):
                    if entry == where.axis or (isinstance(entry, tuple) and entry == (where.axis,)):
                        return d
        return None

    return tuple(dim(leaf) for leaf in jax.tree.leaves(tree))


def specs(tree: Any, layout: tuple[int | None, ...], where: SampleAxis) -> Any:
    """``PartitionSpec`` pytree for ``tree``: the sample axis on each split leaf's dimension."""
    treedef = jax.tree.structure(tree)
    return jax.tree.unflatten(treedef, [P() if d is None else P(*([None] * d), where.axis) for d in layout])


def gather(tree: Any, layout: tuple[int | None, ...], where: SampleAxis | None) -> Any:
    """Inside ``shard_map``, before the loop: all-gather split leaves once; cast the rest varying.

    The runner runs the body untyped (``shard_map(..., check_vma=False)``), where JAX inserts no
    implicit "invariant -> varying" cast, so no all-reduce in the pullback: that, not this cast, is
    what keeps the reduction out of the loop, and here ``pcast(..., to='varying')`` changes nothing
    (the compiled program is the same with and without it). It is kept for a typed body
    (``check_vma=True``), where the cast before the loop is what moves the transpose's all-reduce
    out of it (netket#2228).
    """
    if where is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = [
        jax.lax.pcast(x, where.axis, to="varying")
        if d is None
        else jax.lax.all_gather(x, where.axis, axis=d, tiled=True)
        for x, d in zip(leaves, layout)
    ]
    return jax.tree.unflatten(treedef, out)


def reduce(tree: Any, layout: tuple[int | None, ...] | None, where: SampleAxis | None) -> Any:
    """The one reduction, after the loop: ``psum`` of replicated leaves (``layout`` None: all of
    them), ``psum_scatter`` of split ones back to their shards (reduce-scatter)."""
    if where is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    layout = layout or (None,) * len(leaves)
    summed = iter(jax.lax.psum([x for x, d in zip(leaves, layout) if d is None], where.axis))
    out = [
        next(summed) if d is None else jax.lax.psum_scatter(x, where.axis, scatter_dimension=d, tiled=True)
        for x, d in zip(leaves, layout)
    ]
    return jax.tree.unflatten(treedef, out)
