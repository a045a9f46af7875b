r"""The chunked map-reduce primitive: how every estimator composes with JAX's transformations.

Every estimator is one instance of a single computation. Given a *chunk function* ``g`` and inputs
split into *replicated* ones ``r`` (parameters, tangent vectors, model state, parameter-shaped
cotangents) and *per-sample* ones ``s`` (samples, per-sample cotangents; sample axis 0, length N),

.. math::

    \mathrm{CMR}_g(r, s) = \Big(\sum_k \mathrm{sums}_g(r, s_{[k]}, w_{[k]}),\;
                           \mathrm{concat}_k\, \mathrm{maps}_g(r, s_{[k]}, w_{[k]})\Big)

over the chunks ``k`` of the rows, with ``w`` the row weights of :mod:`vmcgrad._chunking` (a bool
mask here: True for a row that counts in this chunk). The contract on ``g``: its summed outputs do
not depend on rows of weight False (it masks its per-row factors with ``w``); its per-sample
outputs of those rows are dropped.

It is a :class:`jax.extend.core.Primitive`, ``vmcgrad_chunked_map_reduce``, whose lowering is the
one runner (:func:`vmcgrad._runner.run_on`: padding to the device count, ``shard_map`` with
parameter-sharded leaves all-gathered once, one ``lax.while_loop`` over the chunks with the sums in
``jax.new_ref`` accumulators at float32 or better, one ``psum`` / ``psum_scatter`` after the loop).
The family is closed under JAX's transformations, and each rule below binds the primitive again, so
every transformed estimator is again one chunked pass with one reduction:

* **jvp**: the tangent of ``CMR_g`` is ``CMR_{jvp g}`` with the tangents as extra operands
  (tangents of replicated operands replicated, of per-sample ones per sample). The derivative of
  ``batched_vjp`` in the parameters is thus a chunked forward-over-reverse pass.
* **transpose**: for ``g`` linear in some operands, ``CMR_{g^T}`` with ``g^T`` the chunk's
  ``jax.linear_transpose``: cotangents of the sums are replicated operands, of the per-sample
  outputs per-sample operands (masked by ``w``); cotangents of replicated operands come out summed,
  of per-sample ones per sample. The transpose of ``batched_vjp`` in its cotangent is a
  ``batched_jvp``. With the jvp rule: ``jax.grad``, ``jax.vjp``, ``jax.linearize``, any order.
* **vmap**: ``CMR_{vmap g}``, the batch axis inside the chunk (replicated operands batched on
  axis 0, per-sample ones on axis 1 so the sample axis stays first). K vectors cost one walk over
  the samples, K wide.
* **checkpoint**: the primitive's equation holds no refs (they live only in its lowering), so
  ``jax.checkpoint`` sees an ordinary effect-free equation.

JAX never differentiates or batches the ``while_loop`` itself, only these rules act, so no
collective can enter the loop. The rules use only ``jax.extend`` / ``jax.interpreters`` extension
points (no ``jax._src``). A chunk function that closes over a traced value (an outer ``jit``
argument, a ``vmap`` batch) has it hoisted into an explicit replicated operand, so that its tangent
is not silently dropped. Bodies are traced with no context mesh: they run on one device's chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ._chunking import plan_chunks
from ._runner import SAMPLES, Laid, Space, acc_dtype, run_on

chunked_p = Primitive("vmcgrad_chunked_map_reduce")
chunked_p.multiple_results = True

# Operands: (*replicated, *per_sample). Params:
#   body:       ClosedJaxpr of g(*replicated, *per_sample_chunk, w) -> (*sums, *maps_chunk)
#   n_rep:      how many operands are replicated
#   n_sum:      how many outputs are summed
#   rep_layout: per replicated operand, the dimension split over the sample axis, or None
#   sum_layout: per summed output, the same (split sums are reduce-scattered)
#   space:      the rows: sample axis, N, rows per device, chunk size (vmcgrad._runner.Space)


def _chunk_rows(space: Space) -> int:
    return plan_chunks(space.n_local, space.chunk_size).size


def _explicit(space: Space) -> bool:
    return space.where is not None and AxisType.Explicit in space.where.mesh.axis_types


def _abstract_eval(*args, body, n_rep, n_sum, rep_layout, sum_layout, space):
    del args, n_rep, rep_layout
    outs = body.out_avals
    explicit = _explicit(space)
    mesh = space.where.mesh.abstract_mesh if explicit else None

    def typed(shape, dtype, spec):
        if not explicit:
            return jax.core.ShapedArray(shape, dtype)
        return jax.core.ShapedArray(shape, dtype, sharding=NamedSharding(mesh, spec))

    sums = [typed(a.shape, a.dtype, _dim_spec(d, a.ndim, space)) for a, d in zip(outs[:n_sum], sum_layout)]
    # Per-sample outputs stay split like the samples, or come back replicated when the devices do not
    # divide N (the runner cuts the padded rows off after gathering them: vmcgrad._runner._cut).
    split = explicit and space.n % space.where.size == 0
    row_spec = P(space.where.axis) if split else P()
    maps = [typed((space.n, *a.shape[1:]), a.dtype, row_spec) for a in outs[n_sum:]]
    return sums + maps, body.effects


def _dim_spec(d: int | None, ndim: int, space: Space) -> P:
    return P() if d is None else P(*([None] * d), space.where.axis)


chunked_p.def_effectful_abstract_eval(_abstract_eval)


def _loop(g: Callable, rep: list, per_sample: list, chunks: Any, sum_avals: Sequence, map_avals: Sequence):
    """One device's pass: a ``while_loop`` over chunks; sums into ref accumulators, rows into a carry.

    A ``while_loop`` over an int32 counter, not a ``scan``: a scan's index array costs temp memory,
    and the loop is never differentiated (the primitive's rules act instead). Rows of weight False
    keep the buffer's earlier value (an earlier chunk's, or zeros for padded rows, which are cut).
    """
    accs = [jax.new_ref(jnp.zeros(a.shape, acc_dtype(a.dtype))) for a in sum_avals]
    bufs = [jnp.zeros((chunks.plan.n, *a.shape[1:]), a.dtype) for a in map_avals]
    size = chunks.plan.size

    def step(carry):
        k, bufs = carry
        *chunk, w = chunks.take(k, *per_sample, dtype=jnp.bool_)
        outs = g(*rep, *chunk, w)
        for acc, part in zip(accs, outs[: len(accs)]):
            acc[...] += part.astype(acc.dtype)
        start = chunks.start(k)
        new = []
        for buf, rows in zip(bufs, outs[len(accs) :]):
            old = jax.lax.dynamic_slice_in_dim(buf, start, size)
            keep = w.reshape((size,) + (1,) * (rows.ndim - 1))
            new.append(jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, rows, old), start, 0))
        return k + 1, new

    _, bufs = jax.lax.while_loop(lambda c: c[0] < chunks.plan.count, step, (jnp.int32(0), bufs))
    return [jax.ref.freeze(a) for a in accs], bufs


def _impl(*args, body, n_rep, n_sum, rep_layout, sum_layout, space):
    rep, per_sample = list(args[:n_rep]), list(args[n_rep:])
    g = jaxpr_as_fun(body)
    sum_avals, map_avals = body.out_avals[:n_sum], body.out_avals[n_sum:]

    def local(chunks, rep, per_sample):
        return _loop(g, rep, per_sample, chunks, sum_avals, map_avals)

    like = [jax.ShapeDtypeStruct(a.shape, acc_dtype(a.dtype)) for a in sum_avals]
    sums, maps = run_on(
        space,
        local,
        (rep, tuple(rep_layout)),
        (per_sample, SAMPLES),
        out=(Laid(like, tuple(sum_layout)), SAMPLES),
    )
    return [s.astype(a.dtype) for s, a in zip(sums, sum_avals)] + list(maps)


_impl_jit = jax.jit(_impl, static_argnames=("body", "n_rep", "n_sum", "rep_layout", "sum_layout", "space"))
chunked_p.def_impl(_impl_jit)
mlir.register_lowering(chunked_p, mlir.lower_fun(_impl, multiple_results=True))

_NO_MESH = jax.sharding.AbstractMesh((), ())


def _trace(fn: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """``fn``'s closed jaxpr on abstract chunk values, traced with no context mesh (the body runs on
    one device's chunk inside the runner's ``shard_map``)."""
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


def _place(rep: list, rep_layout: Sequence, per_sample: list, space: Space) -> tuple[list, list]:
    """Places the operands on the sample mesh *in the jaxpr*, at bind time.

    The runner's ``shard_map`` exists only in the primitive's lowering, so a ``jax.jit`` whose
    arguments are all unsharded (sharded samples closed over, no context mesh) would not know it
    spans the mesh and would compile for one device. A sharding constraint (Auto axes) or a
    ``reshard`` (Explicit axes, where it also types operands that transformations create, e.g.
    jacfwd's basis) on a concrete mesh tells it. Per-sample operands the devices do not divide are
    left to the runner, which pads them first.
    """
    where = space.where
    if where is None or not isinstance(where.mesh, jax.sharding.Mesh):
        return rep, per_sample
    put = jax.sharding.reshard if _explicit(space) else jax.lax.with_sharding_constraint
    mesh = where.mesh
    rep = [put(a, NamedSharding(mesh, _dim_spec(d, a.ndim, space))) for a, d in zip(rep, rep_layout)]
    rows = P(where.axis)
    per_sample = [
        put(a, NamedSharding(mesh, rows)) if a.shape[0] % where.size == 0 else a for a in per_sample
    ]
    return rep, per_sample


def _bind(rep, per_sample, *, body, rep_layout, n_sum, sum_layout, space):
    rep, per_sample = _place(list(rep), rep_layout, list(per_sample), space)
    return chunked_p.bind(
        *rep,
        *per_sample,
        body=body,
        n_rep=len(rep),
        n_sum=n_sum,
        rep_layout=tuple(rep_layout),
        sum_layout=tuple(sum_layout),
        space=space,
    )


def _split(seq: Sequence, sizes: Sequence[int]) -> list:
    out, i = [], 0
    for s in sizes:
        out.append(list(seq[i : i + s]))
        i += s
    out.append(list(seq[i:]))
    return out


# --- jvp: tangent = CMR of the chunk's jvp, tangents as extra (replicated / per-sample) operands ---


def _jvp_rule(primals, tangents, *, body, n_rep, n_sum, rep_layout, sum_layout, space):
    out = _bind(
        primals[:n_rep],
        primals[n_rep:],
        body=body,
        rep_layout=rep_layout,
        n_sum=n_sum,
        sum_layout=sum_layout,
        space=space,
    )
    nz = [type(t) is not ad.Zero for t in tangents]
    if not any(nz):
        return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    in_avals = body.in_avals  # (*rep, *per_sample_chunk, w)
    n_in = len(in_avals) - 1
    nz_rep = [i for i in range(n_rep) if nz[i]]
    nz_ps = [i for i in range(n_rep, n_in) if nz[i]]
    moving = nz_rep + nz_ps

    def g_tangent(*args):
        rep, d_rep, ps, d_ps, (w,) = _split(args, [n_rep, len(nz_rep), n_in - n_rep, len(nz_ps)])
        primal = rep + ps

        def h(*vals):
            full = list(primal)
            for i, v in zip(moving, vals):
                full[i] = v
            return jaxpr_as_fun(body)(*full, w)

        return jax.jvp(h, tuple(primal[i] for i in moving), tuple(d_rep + d_ps))[1]

    avals = (
        list(in_avals[:n_rep])
        + [in_avals[i] for i in nz_rep]
        + list(in_avals[n_rep:n_in])
        + [in_avals[i] for i in nz_ps]
        + [in_avals[-1]]
    )
    t_out = _bind(
        list(primals[:n_rep]) + [tangents[i] for i in nz_rep],
        list(primals[n_rep:]) + [tangents[i] for i in nz_ps],
        body=_trace(g_tangent, avals),
        rep_layout=tuple(rep_layout) + tuple(rep_layout[i] for i in nz_rep),
        n_sum=n_sum,
        sum_layout=sum_layout,
        space=space,
    )
    return out, t_out


ad.primitive_jvps[chunked_p] = _jvp_rule


# --- transpose: CMR of the chunk's linear transpose; per-sample cotangents masked by w -------------


def _transpose_rule(cts, *args, body, n_rep, n_sum, rep_layout, sum_layout, space):
    lin = [ad.is_undefined_primal(a) for a in args]
    in_avals, out_avals = body.in_avals, body.out_avals
    n_in = len(in_avals) - 1
    ct_nz = [type(c) is not ad.Zero for c in cts]
    lin_rep = [i for i in range(n_rep) if lin[i]]
    lin_ps = [i for i in range(n_rep, n_in) if lin[i]]
    const_rep = [i for i in range(n_rep) if not lin[i]]
    const_ps = [i for i in range(n_rep, n_in) if not lin[i]]
    ct_sum = [j for j in range(n_sum) if ct_nz[j]]
    ct_map = [j for j in range(n_sum, len(out_avals)) if ct_nz[j]]
    if not ct_sum and not ct_map:
        return [ad.Zero(a.aval.to_tangent_aval()) if is_lin else None for is_lin, a in zip(lin, args)]

    def g_transpose(*vals):
        c_rep, c_sum, c_ps, c_map, (w,) = _split(
            vals, [len(const_rep), len(ct_sum), len(const_ps), len(ct_map)]
        )
        consts = dict(zip(const_rep + const_ps, c_rep + c_ps))

        def linear(*xs):
            full = dict(consts)
            full.update(zip(lin_rep + lin_ps, xs))
            return jaxpr_as_fun(body)(*(full[i] for i in range(n_in)), w)

        out_ct = [jnp.zeros(a.shape, a.dtype) for a in out_avals]
        for j, c in zip(ct_sum, c_sum):
            out_ct[j] = c
        for j, c in zip(ct_map, c_map):
            keep = w.reshape(w.shape + (1,) * (c.ndim - 1))
            out_ct[j] = jnp.where(keep, c, jnp.zeros_like(c))
        lin_avals = [jax.ShapeDtypeStruct(in_avals[i].shape, in_avals[i].dtype) for i in lin_rep + lin_ps]
        return list(jax.linear_transpose(linear, *lin_avals)(out_ct))

    avals = (
        [in_avals[i] for i in const_rep]
        + [out_avals[j] for j in ct_sum]
        + [in_avals[i] for i in const_ps]
        + [out_avals[j] for j in ct_map]
        + [in_avals[-1]]
    )
    res = _bind(
        [args[i] for i in const_rep] + [cts[j] for j in ct_sum],
        [args[i] for i in const_ps] + [cts[j] for j in ct_map],
        body=_trace(g_transpose, avals),
        rep_layout=tuple(rep_layout[i] for i in const_rep) + tuple(sum_layout[j] for j in ct_sum),
        n_sum=len(lin_rep),
        sum_layout=tuple(rep_layout[i] for i in lin_rep),
        space=space,
    )
    out = [None] * len(args)
    for i, r in zip(lin_rep + lin_ps, res):
        out[i] = r
    return out


ad.primitive_transposes[chunked_p] = _transpose_rule


# --- vmap: CMR of the vmapped chunk function (replicated batch axis 0, per-sample axis 1) ---------


def _batch_rule(args, dims, *, body, n_rep, n_sum, rep_layout, sum_layout, space):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    in_avals = body.in_avals
    moved, in_axes, avals = [], [], []
    for i, (a, d) in enumerate(zip(args, dims)):
        aval = in_avals[i]
        if d is None:
            moved.append(a)
            in_axes.append(None)
            avals.append(aval)
            continue
        target = 0 if i < n_rep else 1
        moved.append(jnp.moveaxis(a, d, target))
        in_axes.append(target)
        shape = list(aval.shape)
        shape.insert(target, size)
        avals.append(jax.core.ShapedArray(tuple(shape), aval.dtype))
    n_out = len(body.out_avals)
    out_axes = [0] * n_sum + [1] * (n_out - n_sum)
    batched = jax.vmap(jaxpr_as_fun(body), in_axes=(*in_axes, None), out_axes=out_axes)
    shift = lambda d, b: d if d is None or b is None else d + 1
    outs = _bind(
        moved[:n_rep],
        moved[n_rep:],
        body=_trace(lambda *a: batched(*a), [*avals, in_avals[-1]]),
        rep_layout=tuple(shift(d, b) for d, b in zip(rep_layout, in_axes[:n_rep])),
        n_sum=n_sum,
        sum_layout=tuple(d if d is None else d + 1 for d in sum_layout),
        space=space,
    )
    return outs, out_axes


batching.primitive_batchers[chunked_p] = _batch_rule


# --- the entry point estimators use ---------------------------------------------------------------


def _hoist(fn: Callable, avals: Sequence[Any]) -> tuple[ClosedJaxpr, list[Any]]:
    """Traces ``fn`` and turns the tracers it closes over into explicit leading replicated operands."""
    closed = _trace(fn, avals)
    is_tracer = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    hoisted = [c for c, t in zip(closed.consts, is_tracer) if t]
    if not hoisted:
        return closed, []

    def explicit(*args):
        it = iter(args[: len(hoisted)])
        consts = [next(it) if t else c for c, t in zip(closed.consts, is_tracer)]
        return jax.core.eval_jaxpr(closed.jaxpr, consts, *args[len(hoisted) :])

    return _trace(explicit, [jax.typeof(h) for h in hoisted] + list(avals)), hoisted


def map_reduce(
    space: Space,
    chunk_fun: Callable[..., tuple[Any, Any]],
    replicated: Sequence[tuple[Any, Any]],
    per_sample: Sequence[Any],
    *,
    sum_layout: tuple | None = None,
) -> tuple[Any, Any]:
    r"""Runs ``chunk_fun`` over the rows chunk by chunk: sums one part, concatenates the other.

    .. math::

        (\Sigma, M) = \Big(\sum_k \mathrm{sums}(r, s_{[k]}, w_{[k]}),\;
                           \mathrm{concat}_k\, \mathrm{maps}(r, s_{[k]}, w_{[k]})\Big)

    Differentiable (forward and reverse, any order), vmappable and checkpointable in every input;
    each transformed computation is again one chunked pass with one reduction (module docstring).

    Args:
        space: the rows (:class:`vmcgrad._runner.Space`).
        chunk_fun: ``chunk_fun(*replicated_trees, *chunk_trees, w) -> (sums, maps)`` with ``w`` the
            ``(size,)`` bool row mask; ``sums`` (a pytree) must not depend on rows where ``w`` is
            False; ``maps`` is a pytree of arrays with leading axis ``size``.
        replicated: ``(tree, layout)`` pairs, ``layout`` one split dimension or None per leaf.
        per_sample: trees with the N rows on axis 0.
        sum_layout: per leaf of the summed outputs, the split dimension or None (default: all
            replicated).

    Returns:
        ``(sums, maps)``: the sums at the dtypes ``chunk_fun`` returns them (accumulated at float32
        or better), the maps with leading axis N, split like the samples.
    """
    rep_trees = [t for t, _ in replicated]
    rep_flat = [jax.tree.flatten(t) for t in rep_trees]
    ps_flat = [jax.tree.flatten(t) for t in per_sample]
    rep_leaves = [x for leaves, _ in rep_flat for x in leaves]
    ps_leaves = [x for leaves, _ in ps_flat for x in leaves]
    rep_layout = tuple(d for _, layout in replicated for d in layout)
    size = _chunk_rows(space)
    trees = []

    def flat(*args):
        it = iter(args)
        rep = [jax.tree.unflatten(td, [next(it) for _ in leaves]) for leaves, td in rep_flat]
        chunk = [jax.tree.unflatten(td, [next(it) for _ in leaves]) for leaves, td in ps_flat]
        (w,) = list(it)
        sums, maps = chunk_fun(*rep, *chunk, w)
        s_leaves, s_tree = jax.tree.flatten(sums)
        m_leaves, m_tree = jax.tree.flatten(maps)
        trees.append((s_tree, m_tree, len(s_leaves)))
        return [*s_leaves, *m_leaves]

    avals = (
        [jax.typeof(x) for x in rep_leaves]
        + [jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype) for x in ps_leaves]
        + [jax.ShapeDtypeStruct((size,), jnp.bool_)]
    )
    body, hoisted = _hoist(flat, avals)
    s_tree, m_tree, n_sum = trees[0]
    layout = (None,) * n_sum if sum_layout is None else tuple(sum_layout)
    outs = _bind(
        [*hoisted, *rep_leaves],
        ps_leaves,
        body=body,
        rep_layout=(None,) * len(hoisted) + rep_layout,
        n_sum=n_sum,
        sum_layout=layout,
        space=space,
    )
    return jax.tree.unflatten(s_tree, outs[:n_sum]), jax.tree.unflatten(m_tree, outs[n_sum:])


def map_reduce_problem(
    prob: Any,
    inputs: Any,
    chunk_fun: Callable[..., tuple[Any, Any]],
    *extra: tuple[Any, Any],
    sum_layout=None,
) -> tuple[Any, Any]:
    """:func:`map_reduce` over a problem's rows: ``chunk_fun(fun, params, x, w, *extra) -> (sums, maps)``.

    ``fun`` is the user's function (its ``Partial`` arrays are replicated operands, so they are
    differentiated and batched too), ``params`` the full parameters, ``x`` the chunk of samples;
    ``extra`` are ``(value, placement)`` pairs, placement :data:`~vmcgrad._runner.SAMPLES`,
    :data:`~vmcgrad._runner.REPLICATED` or a layout tuple, passed to ``chunk_fun`` in order (per-sample
    ones chunked).
    """
    rep = [(inputs.fun_data, (None,) * len(inputs.fun_data)), (inputs.params, prob.layout)]
    where_rep, where_ps, per_sample = [], [], [inputs.samples]
    for i, (value, kind) in enumerate(extra):
        if isinstance(kind, str) and kind == SAMPLES:
            where_ps.append(i)
            per_sample.append(value)
        else:
            where_rep.append(i)
            layout = (None,) * len(jax.tree.leaves(value)) if isinstance(kind, str) else kind
            rep.append((value, layout))

    def g(fun_data, params, *args):
        reps, rest = args[: len(where_rep)], args[len(where_rep) :]
        x, chunks, w = rest[0], rest[1:-1], rest[-1]
        values = [None] * len(extra)
        for i, v in zip(where_rep, reps):
            values[i] = v
        for i, v in zip(where_ps, chunks):
            values[i] = v
        return chunk_fun(prob.user_fun(fun_data), params, x, w, *values)

    return map_reduce(prob.space, g, rep, per_sample, sum_layout=sum_layout)
