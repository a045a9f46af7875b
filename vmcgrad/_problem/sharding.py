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
``psum_scatter`` back to the shards). The per-device runner that uses them is :mod:`vmcgrad._runner.runner`.

Before anything is traced, the placement of the inputs is read here too: :func:`check_not_in_shard_map`
(no call inside the user's ``shard_map``), :func:`warn_if_sharding_unseen` (traced samples whose split
cannot be seen) and :func:`check_same_devices` (per-sample arguments on the samples' devices).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._problem.validation import describe
from vmcgrad._warnings import VmcgradWarning, stacklevel_outside_package


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


def explicit_sharding(x: Any) -> NamedSharding | None:
    """``x``'s sharding where its type names Explicit mesh axes (traced code, or a concrete array
    placed on such a mesh), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    explicit = isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types
    return sharding if explicit else None


def unsplit_explicit(tree: Any) -> Any:
    """``tree`` with each leaf typed on Explicit mesh axes resharded replicated; other leaves as they are.

    On Explicit axes the split is part of the type, and slicing or indexing the split axis into a size
    the devices do not divide is a type error; code that takes such a slice of the samples outside the
    per-device pass (a strided subset, a padded copy, the first N rows), or a factorisation that wants
    the whole matrix, replicates them first.
    """

    def unsplit(a):
        sharding = explicit_sharding(a)
        return a if sharding is None else jax.sharding.reshard(a, NamedSharding(sharding.mesh, P()))

    return jax.tree.map(unsplit, tree)


def local_count(n: int, where: SampleAxis | None) -> int:
    """Rows per device after :func:`pad_to_devices`: ``ceil(n / devices)``."""
    return n if where is None else -(-n // where.size)


def pad_to_devices(tree: Any, where: SampleAxis | None) -> Any:
    """Pads the leading axis of every leaf to a multiple of the device count with copies of its last row.

    Only when the global count does not divide over the devices (a sharded array always does). The
    padded rows are valid inputs for the function and get weight 0 (:mod:`vmcgrad._chunks.plan`).
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
    """Inside ``shard_map``, before the loop: all-gather split leaves once; the others as they are.

    The runner runs the body untyped (``shard_map(..., check_vma=False)``), where JAX inserts no
    implicit "invariant -> varying" cast on a replicated leaf, hence no all-reduce in its pullback:
    replicated leaves need no cast here (:mod:`vmcgrad._runner.runner`, "Typing of the body").
    """
    if where is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = [
        x if d is None else jax.lax.all_gather(x, where.axis, axis=d, tiled=True)
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


# --- checks of where the inputs are, before anything is traced -----------------------------------


def check_same_devices(where: str, name: str, x: Any, axis: Any) -> None:
    """A per-sample argument placed on the samples' devices, in the samples' mesh order.

    ``axis`` is the problem's sample axis (:class:`vmcgrad._problem.sharding.SampleAxis`, or None). Tracers
    and uncommitted arrays are placed by the compiled program; a committed array on other devices,
    or on the same devices in another mesh order, would make JAX refuse the call with
    "incompatible devices".
    """
    mesh = getattr(axis, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):
        return
    want = tuple(mesh.devices.flat)
    for leaf in jax.tree.leaves(x):
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array) or not leaf.committed:
            continue
        sharding = leaf.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            got = tuple(sharding.mesh.devices.flat)
            same = got == want
        else:
            got = tuple(sorted(sharding.device_set, key=lambda d: d.id))
            same = set(got) == set(want)
        if not same:
            raise ValueError(
                f"{where}: `{name}` must be on the devices of the samples' mesh, in its order "
                f"(device ids {[d.id for d in want]}, mesh axes {tuple(mesh.axis_names)}); got "
                f"{describe(leaf)} on device ids {[d.id for d in got]}. JAX runs one program over "
                f"one device order. Fix: place it like the samples, e.g. "
                f"`{name} = jax.device_put({name}, samples.sharding)`, or build both on one mesh."
            )


def warn_if_sharding_unseen(where: str, samples: Any) -> None:
    """Warns (once per call site) when traced samples may be sharded in a way vmcgrad cannot see.

    Under ``jax.jit`` the samples are tracers. Their abstract type (``jax.typeof(x).sharding``)
    shows the split on Explicit mesh axes, which :func:`vmcgrad._problem.sharding.find_sample_axis` uses.
    On Auto axes (jax 0.10.2) it shows the mesh but not the split (``spec`` is all None), and an
    array placed by ``jax.jit(..., in_shardings=...)`` shows neither. With no context mesh
    (``jax.set_mesh``) vmcgrad then runs as on one device: if the samples are in fact sharded,
    every device walks all N samples. An Auto mesh in the type is used as the sample mesh
    (:func:`vmcgrad._problem.sharding.find_sample_axis`); this warns when, with no context mesh set, a traced
    leaf shows no mesh at all while there is more than one device.
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return
    leaves = jax.tree.leaves(samples)
    shardings = [_aval_sharding(x) for x in leaves]
    if any(_leading_spec(s) is not None for s in shardings):
        return  # the split is visible and used
    for leaf, sharding in zip(leaves, shardings):
        if not isinstance(leaf, jax.core.Tracer):
            continue
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            continue  # a mesh in the type: vmcgrad._problem.sharding.find_sample_axis splits over it
        if jax.device_count() > 1:
            seen = f"with no sharding visible in their type, and there are {jax.device_count()} devices"
        else:
            continue
        n = leaf.shape[0] if leaf.ndim else "all"
        warnings.warn(
            f"{where}: `samples` (shape {tuple(leaf.shape)}) are traced {seen}, and no mesh is "
            "set, so vmcgrad cannot tell whether they are split over devices; it runs them as on "
            f"one device: if they are sharded, every device walks all {n} samples and holds their "
            "activations. Fix: call your jitted function inside `with jax.set_mesh(mesh):` "
            "(vmcgrad then splits the samples over all the mesh's axes), or give the mesh "
            "AxisType.Explicit axes so that the split is part of the type. If the samples are on "
            "one device on purpose, ignore this warning.",
            VmcgradWarning,
            stacklevel=stacklevel_outside_package(),
        )
        return


def _aval_sharding(x: Any) -> Any:
    """``x``'s concrete sharding (an eager array), else the one in its type."""
    concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    return concrete if concrete is not None else _typeof_sharding(x)


def check_not_in_shard_map(where: str) -> None:
    """Refuses a call inside the user's ``jax.shard_map`` (manual mesh axes in context).

    vmcgrad's estimators are global operations that shard themselves over the samples; inside a
    ``shard_map`` each device would see only its own rows as "all samples" and the one reduction
    would be missing.
    """
    try:
        manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    except AttributeError:  # no abstract mesh API: nothing to detect
        return
    if manual:
        raise ValueError(
            f"{where} was called inside jax.shard_map (manual mesh axes {manual}); vmcgrad's "
            "estimators are global operations that split the samples over the devices themselves and "
            "reduce once. Fix: call it outside shard_map, on the global (sharded) arrays."
        )
