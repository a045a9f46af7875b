r"""The chunked map-reduce primitive: how every estimator composes with JAX's transformations.

Every estimator is one instance of a single computation. Given a *chunk function* ``g`` and inputs
split into *replicated* ones ``r`` (parameters, tangent vectors, model state, parameter-shaped
cotangents) and *per-sample* ones ``s`` (samples, per-sample cotangents; sample axis 0, length N),

.. math::

    \mathrm{CMR}_g(r, s) = \Big(\sum_k \mathrm{sums}_g(r, s_{[k]}, w_{[k]}),\;
                           \mathrm{concat}_k\, \mathrm{maps}_g(r, s_{[k]}, w_{[k]})\Big)

over the chunks ``k`` of the rows, with ``w`` the row weights of :mod:`vmcgrad._chunks.plan` (a bool
mask here: True for a row that counts in this chunk). The contract on ``g``: its summed outputs do
not depend on rows of weight False (it masks its per-row factors with ``w``); its per-sample
outputs of those rows are dropped.

**Per-chunk values.** ``g`` may also read *per-chunk* operands ``c`` (leading axis: every device's
chunks, ``devices * chunks``, split like the devices; chunk ``k`` reads slot ``k``) and write
per-chunk outputs (chunk ``k`` writes slot ``k``; nothing is reduced, nothing leaves its device).
So a caller can keep each chunk's ``jax.linearize`` residuals in one pass and read them back in
every product, inside the same one loop. Per-chunk values are batched like the rest (batch axis 1,
the chunk axis stays first) but never differentiated: they are residuals of one point, and a nonzero
tangent into or out of them is refused by the jvp and transpose rules with a TypeError in the
caller's words (``kept_note``), which holds under ``jax.jit`` as well (the rules run wherever the
equation is transformed).

It is a :class:`jax.extend.core.Primitive`, ``vmcgrad_chunked_map_reduce``, whose lowering is the
one runner (:func:`vmcgrad._runner.runner.run_on`: padding to the device count, ``shard_map`` with
parameter-sharded leaves all-gathered once, one ``lax.while_loop`` over the chunks with the sums in
``jax.new_ref`` accumulators at float32 or better, one ``psum`` / ``psum_scatter`` after the loop).
The family is closed under JAX's transformations, and each rule (:mod:`vmcgrad._runner.rules`) binds
the primitive again, so every transformed estimator is again one chunked pass with one reduction:

* **jvp**: the tangent of ``CMR_g`` is ``CMR_{jvp g}`` with the tangents as extra operands
  (tangents of replicated operands replicated, of per-sample ones per sample). The derivative of
  ``batched_vjp`` in the parameters is thus a chunked forward-over-reverse pass.
* **transpose**: for ``g`` linear in some operands, ``CMR_{g^T}`` with ``g^T`` the chunk's
  ``jax.linear_transpose``: cotangents of the sums are replicated operands, of the per-sample
  outputs per-sample operands (masked by ``w``); cotangents of replicated operands come out summed,
  of per-sample ones per sample. The transpose of ``batched_vjp`` in its cotangent is a
  ``batched_jvp``. With the jvp rule: ``jax.grad``, ``jax.vjp``, ``jax.linearize``, any order.
* **vmap**: ``CMR_{vmap g}``, the batch axis inside the chunk (replicated operands batched on
  axis 0, per-sample and per-chunk ones on axis 1 so the sample / chunk axis stays first). K vectors
  cost one walk over the samples, K wide.
* **checkpoint**: the primitive's equation holds no refs (they live only in its lowering), so
  ``jax.checkpoint`` sees an ordinary effect-free equation.

JAX never differentiates or batches the ``while_loop`` itself, only these rules act, so no
collective can enter the loop. The rules use ``jax.extend`` / ``jax.interpreters`` extension points
and, for partial evaluation, a few ``jax._src`` internals, all read through
:mod:`vmcgrad._jax_private` (one table, checked against the installed JAX at import). A chunk
function that closes over a traced value (an outer ``jit`` argument, a ``vmap`` batch) has it
hoisted into an explicit replicated operand, so that its tangent is not silently dropped. Bodies are
traced with no context mesh: they run on one device's chunk.

**Parameters.** The primitive has one parameter, ``params``, a frozen and hashable :class:`Params`:
the chunk's :class:`~vmcgrad._runner.body.Body` (its jaxpr, with the operand and output counts per
placement), the layouts, the rows (``space``), and two optional forms: the sums as a pullback
(:mod:`vmcgrad._runner.refs`) and a combined primal-and-tangent pass
(:class:`vmcgrad._runner.rules.JvpSplit`).
Operands are flattened and grouped only at the edge (:class:`~vmcgrad._runner.body.Operands`,
:class:`~vmcgrad._runner.body.Outputs`), so the rules read groups, not positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._chunks.plan import Space, acc_dtype
from vmcgrad._jax_private import Primitive, mlir
from vmcgrad._runner.body import Body, Operands, Outputs, hoist
from vmcgrad._runner.refs import Pullback, open_pullback, pullback_body, pullback_jaxprs, writable
from vmcgrad._runner.runner import CHUNKS, SAMPLES, Laid, device_pass, run_on

chunked_p = Primitive("vmcgrad_chunked_map_reduce")
chunked_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class Params:
    """The primitive's one parameter (frozen, hashable: a ``jax.jit`` cache key).

    Attributes:
        body: one chunk's computation (:class:`~vmcgrad._runner.body.Body`), which also says how
            many operands and outputs each placement has.
        rep_layout: per replicated operand, the dimension split over the sample axis, or None.
        sum_layout: per summed output, the same (split sums are reduce-scattered).
        space: the rows: sample axis, N, rows per device, chunk size (:class:`~vmcgrad._chunks.plan.Space`).
        pullback: None, or the sums as a pullback for the lowering
            (:class:`~vmcgrad._runner.refs.PullbackJaxprs`); rules ignore it (they see ``body``).
        jvp_split: None, or how a combined primal-and-tangent pass splits into its two parts
            (:class:`~vmcgrad._runner.rules.JvpSplit`).
        kept_note: the caller's words for its per-chunk values, the TypeError a derivative in
            them raises (:func:`~vmcgrad._runner.rules.kept_refused`; "": the runner's own).
    """

    body: Body
    rep_layout: tuple
    sum_layout: tuple
    space: Space
    pullback: Any = None
    jvp_split: Any = None
    kept_note: str = ""

    def replace(self, **changes: Any) -> Params:
        return dataclasses.replace(self, **changes)


def bind(params: Params, ops: Operands, *, place: bool = True) -> Outputs:
    """Binds the primitive on ``ops``: flattened here, outputs grouped here.

    Args:
        params: the parameters; ``params.body`` reads ``ops``.
        ops: the operands.
        place: place them on the sample mesh first (:func:`_place`); False for the operands of an
            equation being split, which were placed when it was bound.
    """
    ops = _place(ops, params) if place else ops
    return params.body.outputs(chunked_p.bind(*ops.flat(), params=params))


def _slots(space: Space) -> int:
    """The length of a per-chunk operand's or output's leading axis: every device's chunks, in
    device order."""
    devices = 1 if space.where is None else space.where.size
    return devices * space.plan.count


def _explicit(space: Space) -> bool:
    return space.where is not None and AxisType.Explicit in space.where.mesh.axis_types


def _dim_spec(d: int | None, ndim: int, space: Space) -> P:
    return P() if d is None else P(*([None] * d), space.where.axis)


def _abstract_eval(*args, params: Params):
    del args
    space, out = params.space, params.body.out_avals
    explicit = _explicit(space)
    mesh = space.where.mesh.abstract_mesh if explicit else None

    def typed(shape, dtype, spec):
        if not explicit:
            return jax.core.ShapedArray(shape, dtype)
        return jax.core.ShapedArray(shape, dtype, sharding=NamedSharding(mesh, spec))

    sums = [typed(a.shape, a.dtype, _dim_spec(d, a.ndim, space)) for a, d in zip(out.sums, params.sum_layout)]
    # Per-sample outputs stay split like the samples, or come back replicated when the devices do not
    # divide N (the runner cuts the padded rows off after gathering them: vmcgrad._runner.runner._cut).
    split = explicit and space.n % space.where.size == 0
    row_spec = P(space.where.axis) if split else P()
    maps = [typed((space.n, *a.shape[1:]), a.dtype, row_spec) for a in out.maps]
    # Per-chunk outputs: every device's chunks in device order, split like the devices.
    slot_spec = P(space.where.axis) if explicit else P()
    slots = [typed((_slots(space), *a.shape), a.dtype, slot_spec) for a in out.slots]
    return sums + maps + slots, params.body.jaxpr.effects


chunked_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(*args, params: Params):
    """The lowering: :func:`~vmcgrad._runner.runner.device_pass` on every device's rows, reduced once."""
    body = params.body
    ops = body.operands(args)

    def local(chunks, rep, samples, per_chunk):
        out = device_pass(
            body, params.pullback, Operands(tuple(rep), tuple(samples), tuple(per_chunk)), chunks
        )
        return list(out.sums), list(out.maps), list(out.slots)

    sum_avals = body.out_avals.sums
    like = [jax.ShapeDtypeStruct(a.shape, acc_dtype(a.dtype)) for a in sum_avals]
    sums, maps, slots = run_on(
        params.space,
        local,
        (list(ops.rep), params.rep_layout),
        (list(ops.samples), SAMPLES),
        (list(ops.chunks), CHUNKS),
        out=(Laid(like, params.sum_layout), SAMPLES, CHUNKS),
    )
    return [s.astype(a.dtype) for s, a in zip(sums, sum_avals)] + list(maps) + list(slots)


chunked_p.def_impl(jax.jit(_impl, static_argnames=("params",)))
mlir.register_lowering(chunked_p, mlir.lower_fun(_impl, multiple_results=True))


def _place(ops: Operands, params: Params) -> Operands:
    """Places the operands on the sample mesh *in the jaxpr*, at bind time.

    The runner's ``shard_map`` exists only in the primitive's lowering, so a ``jax.jit`` whose
    arguments are all unsharded (sharded samples closed over, no context mesh) would not know it
    spans the mesh and would compile for one device. A sharding constraint (Auto axes) or a
    ``reshard`` (Explicit axes, where it also types operands that transformations create, e.g.
    jacfwd's basis) on a concrete mesh tells it. Per-sample operands the devices do not divide are
    left to the runner, which pads them first. Per-chunk operands are split like the devices.
    """
    space = params.space
    where = space.where
    if where is None or not isinstance(where.mesh, jax.sharding.Mesh):
        return ops
    put = jax.sharding.reshard if _explicit(space) else jax.lax.with_sharding_constraint
    mesh, rows = where.mesh, P(where.axis)
    return Operands(
        tuple(
            put(a, NamedSharding(mesh, _dim_spec(d, a.ndim, space)))
            for a, d in zip(ops.rep, params.rep_layout)
        ),
        tuple(put(a, NamedSharding(mesh, rows)) if a.shape[0] % where.size == 0 else a for a in ops.samples),
        tuple(put(a, NamedSharding(mesh, rows)) for a in ops.chunks),
    )


# --- the entry points estimators use ---------------------------------------------------------------


def map_reduce(
    space: Space,
    chunk_fun: Callable[..., tuple],
    replicated: Sequence[tuple[Any, Any]],
    per_sample: Sequence[Any],
    *,
    per_chunk: Sequence[Any] = (),
    sum_layout: tuple | None = None,
    kept_note: str = "",
) -> tuple:
    r"""Runs ``chunk_fun`` over the rows chunk by chunk: sums one part, concatenates another, and
    keeps a third per chunk.

    .. math::

        (\Sigma, M, K) = \Big(\sum_k \mathrm{sums}(r, s_{[k]}, c_k, w_{[k]}),\;
                           \mathrm{concat}_k\, \mathrm{maps}(r, s_{[k]}, c_k, w_{[k]}),\;
                           \mathrm{stack}_k\, \mathrm{slots}(r, s_{[k]}, c_k, w_{[k]})\Big)

    with ``c_k`` chunk ``k``'s slot of the per-chunk operands.

    Differentiable (forward and reverse, any order), vmappable and checkpointable in the replicated
    and per-sample inputs; each transformed computation is again one chunked pass with one reduction
    (module docstring). Per-chunk values are batched by ``jax.vmap`` but not differentiated: a pass
    that reads or writes them refuses a nonzero tangent with a TypeError (they are constants of
    one point: a caller's kept linearisations, say), in the caller's words ``kept_note``.
    ``chunk_fun`` is traced once; sums given as a :class:`~vmcgrad._runner.refs.Pullback` are
    written through ``with_refs`` by the untransformed primitive (:mod:`vmcgrad._runner.refs`).

    Args:
        space: the rows (:class:`vmcgrad._chunks.plan.Space`).
        chunk_fun: ``chunk_fun(*replicated_trees, *chunk_trees, *slot_trees, w) -> (sums, maps)``
            or ``-> (sums, maps, slots)``, with ``w`` the ``(size,)`` bool row mask; ``sums`` (a
            pytree, or a :class:`~vmcgrad._runner.refs.Pullback`) must not depend on rows where
            ``w`` is False; ``maps`` is a pytree of arrays with leading axis ``size``; ``slots`` a
            pytree of arrays, this chunk's own values.
        replicated: ``(tree, layout)`` pairs, ``layout`` one split dimension or None per leaf.
        per_sample: trees with the N rows on axis 0.
        per_chunk: trees with every device's chunks on axis 0 (``devices * chunks``, in device
            order: a ``slots`` output of a pass over the same ``space``); ``chunk_fun`` gets slot
            ``k`` of each leaf for chunk ``k``.
        sum_layout: per leaf of the summed outputs, the split dimension or None (default: all
            replicated).
        kept_note: what the per-chunk values are, and how to differentiate instead, in the caller's
            terms: the text of the TypeError a derivative in them raises ("": a generic one).

    Returns:
        ``(sums, maps)``, or ``(sums, maps, slots)`` where ``chunk_fun`` returns three: the sums
        at the dtypes ``chunk_fun`` returns them (accumulated at float32 or better), the maps with
        leading axis N, split like the samples, the slots with leading axis ``devices * chunks``,
        split like the devices.
    """
    rep_leaves, rep_trees = _flatten([t for t, _ in replicated])
    ps_leaves, ps_trees = _flatten(per_sample)
    pc_leaves, pc_trees = _flatten(per_chunk)
    rep_layout = tuple(d for _, layout in replicated for d in layout)
    size = space.plan.size
    slots = _slots(space)
    if any(x.ndim == 0 or x.shape[0] != slots for x in pc_leaves):
        raise ValueError(
            f"vmcgrad: per-chunk values must have leading axis {slots} (devices x chunks of this pass); "
            f"got shapes {sorted({tuple(x.shape) for x in pc_leaves})}. They were kept at another chunk "
            "plan. Fix: read them with a pass over the rows, devices and chunk size that wrote them."
        )
    avals = Operands(
        tuple(jax.typeof(x) for x in rep_leaves),
        tuple(jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype) for x in ps_leaves),
        tuple(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in pc_leaves),
    )
    body, hoisted, pullback, found = _trace_chunk_fun(chunk_fun, (rep_trees, ps_trees, pc_trees), avals, size)
    n_sum = body.n_out[0]
    params = Params(
        body=body,
        rep_layout=(None,) * len(hoisted) + rep_layout,
        sum_layout=(None,) * n_sum if sum_layout is None else tuple(sum_layout),
        space=space,
        pullback=pullback,
        kept_note=kept_note,
    )
    out = bind(params, Operands((*hoisted, *rep_leaves), tuple(ps_leaves), tuple(pc_leaves)))
    sums = jax.tree.unflatten(found["sums"], out.sums)
    maps = jax.tree.unflatten(found["maps"], out.maps)
    if not found["three"]:
        return sums, maps
    return sums, maps, jax.tree.unflatten(found["slots"], out.slots)


def _trace_chunk_fun(chunk_fun: Callable, trees: tuple, avals: Operands, size: int) -> tuple:
    """The one trace of ``chunk_fun`` on a chunk of ``size`` rows: ``(body, hoisted, pullback,
    found)``, the :class:`~vmcgrad._runner.body.Body` (its loop-invariant constants ``hoisted`` out,
    :func:`~vmcgrad._runner.body.hoist`), the sums' pullback for the lowering where they are
    written through ``with_refs`` (or None), and ``found``: the output trees, and whether
    ``chunk_fun`` returned slots (``"three"``)."""
    found: dict[str, Any] = {}

    def call(ops: Operands, w) -> Outputs:
        args = [_unflatten(t, group) for t, group in zip(trees, ops)]
        sums, maps, *rest = chunk_fun(*args[0], *args[1], *args[2], w)
        found["three"] = bool(rest)
        if isinstance(sums, Pullback) and not ops.chunks:  # the pullback form reads no per-chunk operands
            sum_leaves, found["opened"] = open_pullback(sums)
            found["sums"] = found["opened"].primal_tree
        else:
            sum_leaves, found["sums"] = jax.tree.flatten(sums.value() if isinstance(sums, Pullback) else sums)
        m_leaves, found["maps"] = jax.tree.flatten(maps)
        k_leaves, found["slots"] = jax.tree.flatten(rest[0] if rest else ())
        return Outputs(tuple(sum_leaves), tuple(m_leaves), tuple(k_leaves))

    body, hoisted = hoist(call, avals, jax.ShapeDtypeStruct((size,), jnp.bool_))
    pullback = None
    if "opened" in found:
        pre = pullback_jaxprs(body, found["opened"])
        body = pullback_body(pre)
        pullback = pre if writable(pre, hoisted=bool(hoisted)) else None
    return body, hoisted, pullback, found


def _flatten(trees: Sequence[Any]) -> tuple[list, list]:
    flat = [jax.tree.flatten(t) for t in trees]
    return [x for leaves, _ in flat for x in leaves], [tree for _, tree in flat]


def _unflatten(trees: Sequence[Any], leaves: Sequence[Any]) -> list:
    it = iter(leaves)
    return [jax.tree.unflatten(t, [next(it) for _ in range(t.num_leaves)]) for t in trees]


def map_reduce_problem(
    prob: Any,
    inputs: Any,
    chunk_fun: Callable[..., tuple],
    *extra: tuple[Any, Any],
    sum_layout=None,
    kept_note: str = "",
) -> tuple:
    """:func:`map_reduce` over a problem's rows: ``chunk_fun(fun, params, x, w, *extra) -> (sums, maps)``
    (or ``(sums, maps, slots)``).

    ``fun`` is the user's function (its ``Partial`` arrays are replicated operands, so they are
    differentiated and batched too), ``params`` the full parameters, ``x`` the chunk of samples;
    ``extra`` are ``(value, placement)`` pairs, placement :data:`~vmcgrad._runner.runner.SAMPLES`,
    :data:`~vmcgrad._runner.runner.CHUNKS` (one slot per chunk), :data:`~vmcgrad._runner.runner.REPLICATED`
    or a layout tuple, passed to ``chunk_fun`` in order (per-sample ones chunked, per-chunk ones at the
    chunk's slot). ``kept_note`` as for :func:`map_reduce`.
    """
    rep = [(inputs.fun_data, (None,) * len(inputs.fun_data)), (inputs.params, prob.layout)]
    where_rep, where_ps, where_pc, per_sample, per_chunk = [], [], [], [inputs.samples], []
    for i, (value, kind) in enumerate(extra):
        if isinstance(kind, str) and kind == SAMPLES:
            where_ps.append(i)
            per_sample.append(value)
        elif isinstance(kind, str) and kind == CHUNKS:
            where_pc.append(i)
            per_chunk.append(value)
        else:
            where_rep.append(i)
            layout = (None,) * len(jax.tree.leaves(value)) if isinstance(kind, str) else kind
            rep.append((value, layout))

    def g(fun_data, params, *args):
        reps, rest = args[: len(where_rep)], args[len(where_rep) :]
        x, chunks, own, w = rest[0], rest[1 : len(per_sample)], rest[len(per_sample) : -1], rest[-1]
        values = [None] * len(extra)
        for i, v in zip(where_rep + where_ps + where_pc, [*reps, *chunks, *own]):
            values[i] = v
        return chunk_fun(prob.user_fun(fun_data), params, x, w, *values)

    return map_reduce(
        prob.space, g, rep, per_sample, per_chunk=per_chunk, sum_layout=sum_layout, kept_note=kept_note
    )
