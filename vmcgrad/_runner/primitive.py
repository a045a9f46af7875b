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
This is how :class:`vmcgrad.LinearizedQGT` keeps each chunk's ``jax.linearize`` residuals in one
pass and reads them back in every product, inside the same one loop. Per-chunk values are batched
like the rest (batch axis 1, the chunk axis stays first) but never differentiated: they are
residuals of one parameter point, and a nonzero tangent into or out of them is refused by the jvp
and transpose rules with a TypeError, which holds under ``jax.jit`` as well (the rules run wherever
the equation is transformed).

It is a :class:`jax.extend.core.Primitive`, ``vmcgrad_chunked_map_reduce``, whose lowering is the
one runner (:func:`vmcgrad._runner.runner.run_on`: padding to the device count, ``shard_map`` with
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
  axis 0, per-sample and per-chunk ones on axis 1 so the sample / chunk axis stays first). K vectors
  cost one walk over the samples, K wide.
* **checkpoint**: the primitive's equation holds no refs (they live only in its lowering), so
  ``jax.checkpoint`` sees an ordinary effect-free equation.

JAX never differentiates or batches the ``while_loop`` itself, only these rules act, so no
collective can enter the loop. The rules use only ``jax.extend`` / ``jax.interpreters`` extension
points (no ``jax._src``). A chunk function that closes over a traced value (an outer ``jit``
argument, a ``vmap`` batch) has it hoisted into an explicit replicated operand, so that its tangent
is not silently dropped. Bodies are traced with no context mesh: they run on one device's chunk.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vmcgrad._chunks.plan import Space, acc_dtype, plan_chunks
from vmcgrad._jax_private import ClosedJaxpr, Primitive, Var, ad, batching, jaxpr_as_fun, mlir, pe
from vmcgrad._runner.runner import CHUNKS, SAMPLES, Laid, run_on

chunked_p = Primitive("vmcgrad_chunked_map_reduce")
chunked_p.multiple_results = True


class Pullback(NamedTuple):
    r"""A chunk's summed output written as a pullback, so the runner can add it straight into refs.

    A chunk function may return ``Pullback(fun, primals)`` as its sums, meaning

    .. math::

        \mathrm{sums} = \mathrm{vjp}_{\mathrm{fun}}(\mathrm{primals})(c),
        \qquad (y, c) = \mathrm{fun}(\mathrm{primals})

    (``c`` is ``fun``'s auxiliary output: the cotangent, not differentiated). The untransformed
    primitive lowers it as the seed's recipe, ``jax.vjp(fun, primals, has_aux=True)`` and
    ``f_vjp.with_refs(*accumulators)(c)``: a function with a ``lax.scan`` over layers then adds each
    layer's gradient straight into the accumulator instead of first building the stacked per-layer
    gradient (measured: ``benchmarks/estimator_temp_bytes.py``). Transformation rules see the same
    sums as an ordinary value (the generic body) and bind the primitive without the pullback form.
    """

    fun: Callable[[Any], tuple[Any, Any]]
    primals: Any

    def value(self) -> Any:
        """The sums, as an ordinary value: ``f_vjp(c)``."""
        _, f_vjp, ct = jax.vjp(self.fun, self.primals, has_aux=True)
        (out,) = f_vjp(ct)
        return out


# Operands: (*replicated, *per_sample, *per_chunk). Params:
#   body:       ClosedJaxpr of g(*replicated, *per_sample_chunk, *per_chunk_slot, w)
#               -> (*sums, *maps_chunk, *slots)
#   n_rep:      how many operands are replicated
#   n_pc:       how many operands are per chunk (leading axis: devices x chunks, read at the chunk)
#   n_sum:      how many outputs are summed
#   n_slot:     how many outputs are per chunk (each chunk writes its own slot; nothing is reduced)
#   rep_layout: per replicated operand, the dimension split over the sample axis, or None
#   sum_layout: per summed output, the same (split sums are reduce-scattered)
#   space:      the rows: sample axis, N, rows per device, chunk size (vmcgrad._chunks.plan.Space)
#   pullback:   None, or (point, fwd, n_y): the sums as a pullback (see Pullback), for the lowering:
#               point(*replicated, *chunk, w) -> primal leaves; fwd(*replicated, *chunk, w, *primals)
#               -> (*y, *cotangent); sums = vjp of y at the primals with that cotangent


def _chunk_rows(space: Space) -> int:
    return plan_chunks(space.n_local, space.chunk_size).size


def _slots(space: Space) -> int:
    """The length of a per-chunk operand's or output's leading axis: every device's chunks, in
    device order."""
    devices = 1 if space.where is None else space.where.size
    return devices * plan_chunks(space.n_local, space.chunk_size).count


def _counts(body: ClosedJaxpr, n_rep: int, n_pc: int, n_sum: int, n_slot: int) -> tuple[int, int]:
    """``(n_ps, n_map)``: how many operands are per sample and how many outputs are per sample."""
    return len(body.in_avals) - 1 - n_rep - n_pc, len(body.out_avals) - n_sum - n_slot


def _explicit(space: Space) -> bool:
    return space.where is not None and AxisType.Explicit in space.where.mesh.axis_types


def _abstract_eval(
    *args, body, n_rep, n_pc, n_sum, n_slot, rep_layout, sum_layout, space, pullback, jvp_split
):
    del args, n_rep, n_pc, rep_layout, pullback, jvp_split
    outs = body.out_avals
    n_map = len(outs) - n_sum - n_slot
    explicit = _explicit(space)
    mesh = space.where.mesh.abstract_mesh if explicit else None

    def typed(shape, dtype, spec):
        if not explicit:
            return jax.core.ShapedArray(shape, dtype)
        return jax.core.ShapedArray(shape, dtype, sharding=NamedSharding(mesh, spec))

    sums = [typed(a.shape, a.dtype, _dim_spec(d, a.ndim, space)) for a, d in zip(outs[:n_sum], sum_layout)]
    # Per-sample outputs stay split like the samples, or come back replicated when the devices do not
    # divide N (the runner cuts the padded rows off after gathering them: vmcgrad._runner.runner._cut).
    split = explicit and space.n % space.where.size == 0
    row_spec = P(space.where.axis) if split else P()
    maps = [typed((space.n, *a.shape[1:]), a.dtype, row_spec) for a in outs[n_sum : n_sum + n_map]]
    # Per-chunk outputs: every device's chunks in device order, split like the devices.
    slot_spec = P(space.where.axis) if explicit else P()
    slots = [typed((_slots(space), *a.shape), a.dtype, slot_spec) for a in outs[n_sum + n_map :]]
    return sums + maps + slots, body.effects


def _dim_spec(d: int | None, ndim: int, space: Space) -> P:
    return P() if d is None else P(*([None] * d), space.where.axis)


chunked_p.def_effectful_abstract_eval(_abstract_eval)


def _loop(
    g: Callable,
    rep: list,
    per_sample: list,
    per_chunk: list,
    chunks: Any,
    sum_avals: Sequence,
    map_avals: Sequence,
    slot_avals: Sequence,
    pullback: tuple | None = None,
):
    """One device's pass: a ``while_loop`` over chunks; sums into ref accumulators, rows and
    per-chunk slots into the carry.

    A ``while_loop`` over an int32 counter, not a ``scan``: a scan's index array costs temp memory,
    and the loop is never differentiated (the primitive's rules act instead). Rows of weight False
    keep the buffer's earlier value (an earlier chunk's, or zeros for padded rows, which are cut).
    Per-chunk operands are read at the chunk's index ``k`` on their leading axis, and chunk ``k``
    writes slot ``k`` of each per-chunk output. Sums given as a :class:`Pullback` are written by
    ``f_vjp.with_refs(*accumulators)``, every leaf a whole ref (jax#32468, and a ref view under
    ``jit`` accumulates nothing: CONTEXT.md); other sums by ``acc[...] += part``.
    """
    accs = [jax.new_ref(jnp.zeros(a.shape, acc_dtype(a.dtype))) for a in sum_avals]
    bufs = [jnp.zeros((chunks.plan.n, *a.shape[1:]), a.dtype) for a in map_avals]
    slots = [jnp.zeros((chunks.plan.count, *a.shape), a.dtype) for a in slot_avals]
    size = chunks.plan.size
    n_acc, n_map = len(accs), len(bufs)
    assert pullback is None or not per_chunk, "the pullback form reads no per-chunk operands"

    def step(carry):
        k, bufs, slots = carry
        *chunk, w = chunks.take(k, *per_sample, dtype=jnp.bool_)
        own = [jax.lax.dynamic_index_in_dim(a, k, keepdims=False) for a in per_chunk]
        if pullback is None:
            outs = g(*rep, *chunk, *own, w)
            for acc, part in zip(accs, outs[:n_acc]):
                acc[...] += part.astype(acc.dtype)
        else:
            if not _has_uncounted_rows(chunks):
                _pull_into(accs, pullback, rep, chunk, w)
            else:  # rows of weight 0 must add an exact zero (see _finite_stand_ins)
                chunk = _finite_stand_ins(pullback, rep, per_sample, chunks, k, w)
                jax.lax.cond(jnp.any(w), lambda: _pull_into(accs, pullback, rep, chunk, w), lambda: None)
            outs = g(*rep, *chunk, w) if bufs or slots else [None] * n_acc  # only the rest is used
        start = chunks.start(k)
        new = []
        for buf, rows in zip(bufs, outs[n_acc : n_acc + n_map]):
            old = jax.lax.dynamic_slice_in_dim(buf, start, size)
            keep = w.reshape((size,) + (1,) * (rows.ndim - 1))
            new.append(jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, rows, old), start, 0))
        new_slots = [
            jax.lax.dynamic_update_index_in_dim(slot, out.astype(slot.dtype), k, 0)
            for slot, out in zip(slots, outs[n_acc + n_map :])
        ]
        return k + 1, new, new_slots

    _, bufs, slots = jax.lax.while_loop(lambda c: c[0] < chunks.plan.count, step, (jnp.int32(0), bufs, slots))
    return [jax.ref.freeze(a) for a in accs], bufs, slots


def _has_uncounted_rows(chunks: Any) -> bool:
    """Whether any chunk on any device holds rows of weight False (known statically: padding to the
    device count, or a shifted last chunk)."""
    plan = chunks.plan
    return plan.count * plan.size != plan.n or plan.n * chunks.devices != chunks.n_total


def _finite_stand_ins(pullback: tuple, rep: list, per_sample: list, chunks: Any, k: Any, w: Any) -> list:
    r"""The chunk with every row of weight False replaced by a copy of a counted row whose derivative
    is finite (when one exists), so that rows that do not count add an exact zero.

    A row of weight 0 (re-read by the shifted last chunk, or padding) enters the pullback with
    cotangent 0, and :math:`0 \cdot \infty` is NaN: one re-read row with an infinite derivative
    would turn the whole sum into NaN where ``jax.vjp`` gives ``inf``. A row's derivative
    :math:`J_r` is finite exactly when :math:`J_r \cdot \mathbf 1` is (a sum with an infinite or
    NaN term is never finite), so one forward-mode pass over the chunk finds the rows that may stand
    in. Run only for chunks that hold rows of weight 0 (at most two per device and pass).
    """
    point, fwd, n_y = pullback

    def find(per_sample):
        *chunk, _ = chunks.take(k, *per_sample)
        primals = jaxpr_as_fun(point)(*rep, *chunk, w)
        ones = [jnp.ones_like(p) for p in primals]
        _, y_dot = jax.jvp(lambda *t: list(jaxpr_as_fun(fwd)(*rep, *chunk, w, *t)[:n_y]), primals, ones)
        finite = w
        for t in y_dot:
            finite = finite & jnp.all(jnp.isfinite(t).reshape(t.shape[0], -1), axis=1)
        return jnp.any(finite), jnp.argmax(finite).astype(jnp.int32)

    # Only the stand-in's index leaves the cond, and the chunk is sliced from the device's rows once,
    # fused with the replacement (a second chunk-sized buffer would cost temp memory).
    none = lambda _: (jnp.bool_(False), jnp.int32(0))
    found, stand_in = jax.lax.cond(jnp.all(w), none, find, per_sample)
    keep = w | ~found
    start = chunks.start(k)
    size = w.shape[0]

    def put(a):
        rows = jax.lax.dynamic_slice_in_dim(a, start, size)
        row = jax.lax.dynamic_slice_in_dim(a, start + stand_in, 1)
        return jnp.where(keep.reshape((size,) + (1,) * (a.ndim - 1)), rows, row)

    return jax.tree.map(put, list(per_sample))


def _pull_into(accs: list, pullback: tuple, rep: list, chunk: list, w: Any) -> None:
    """The seed's recipe: one chunk's pullback added straight into the accumulators."""
    point, fwd, n_y = pullback
    primals = jaxpr_as_fun(point)(*rep, *chunk, w)

    def f(*theta):
        outs = jaxpr_as_fun(fwd)(*rep, *chunk, w, *theta)
        return list(outs[:n_y]), list(outs[n_y:])

    _, f_vjp, ct = jax.vjp(f, *primals, has_aux=True)
    f_vjp.with_refs(*accs)(ct)


def _impl(*args, body, n_rep, n_pc, n_sum, n_slot, rep_layout, sum_layout, space, pullback, jvp_split):
    del jvp_split  # the combined body computes both parts in one pass
    n_ps, n_map = _counts(body, n_rep, n_pc, n_sum, n_slot)
    rep, per_sample, per_chunk = _split(args, [n_rep, n_ps])
    g = jaxpr_as_fun(body)
    sum_avals, map_avals, slot_avals = _split(body.out_avals, [n_sum, n_map])

    def local(chunks, rep, per_sample, per_chunk):
        return _loop(g, rep, per_sample, per_chunk, chunks, sum_avals, map_avals, slot_avals, pullback)

    like = [jax.ShapeDtypeStruct(a.shape, acc_dtype(a.dtype)) for a in sum_avals]
    sums, maps, slots = run_on(
        space,
        local,
        (rep, tuple(rep_layout)),
        (per_sample, SAMPLES),
        (per_chunk, CHUNKS),
        out=(Laid(like, tuple(sum_layout)), SAMPLES, CHUNKS),
    )
    return [s.astype(a.dtype) for s, a in zip(sums, sum_avals)] + list(maps) + list(slots)


_impl_jit = jax.jit(
    _impl,
    static_argnames=(
        "body",
        "n_rep",
        "n_pc",
        "n_sum",
        "n_slot",
        "rep_layout",
        "sum_layout",
        "space",
        "pullback",
        "jvp_split",
    ),
)
chunked_p.def_impl(_impl_jit)
mlir.register_lowering(chunked_p, mlir.lower_fun(_impl, multiple_results=True))

_NO_MESH = jax.sharding.AbstractMesh((), ())


def _trace(fn: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """``fn``'s closed jaxpr on abstract chunk values, traced with no context mesh (the body runs on
    one device's chunk inside the runner's ``shard_map``)."""
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


def _place(
    rep: list, rep_layout: Sequence, per_sample: list, per_chunk: list, space: Space
) -> tuple[list, list, list]:
    """Places the operands on the sample mesh *in the jaxpr*, at bind time.

    The runner's ``shard_map`` exists only in the primitive's lowering, so a ``jax.jit`` whose
    arguments are all unsharded (sharded samples closed over, no context mesh) would not know it
    spans the mesh and would compile for one device. A sharding constraint (Auto axes) or a
    ``reshard`` (Explicit axes, where it also types operands that transformations create, e.g.
    jacfwd's basis) on a concrete mesh tells it. Per-sample operands the devices do not divide are
    left to the runner, which pads them first. Per-chunk operands are split like the devices.
    """
    where = space.where
    if where is None or not isinstance(where.mesh, jax.sharding.Mesh):
        return rep, per_sample, per_chunk
    put = jax.sharding.reshard if _explicit(space) else jax.lax.with_sharding_constraint
    mesh = where.mesh
    rep = [put(a, NamedSharding(mesh, _dim_spec(d, a.ndim, space))) for a, d in zip(rep, rep_layout)]
    rows = P(where.axis)
    per_sample = [
        put(a, NamedSharding(mesh, rows)) if a.shape[0] % where.size == 0 else a for a in per_sample
    ]
    per_chunk = [put(a, NamedSharding(mesh, rows)) for a in per_chunk]
    return rep, per_sample, per_chunk


def _bind(
    rep,
    per_sample,
    per_chunk=(),
    *,
    body,
    rep_layout,
    n_sum,
    sum_layout,
    space,
    n_slot=0,
    pullback=None,
    jvp_split=None,
):
    rep, per_sample, per_chunk = _place(list(rep), rep_layout, list(per_sample), list(per_chunk), space)
    return chunked_p.bind(
        *rep,
        *per_sample,
        *per_chunk,
        body=body,
        n_rep=len(rep),
        n_pc=len(per_chunk),
        n_sum=n_sum,
        n_slot=n_slot,
        rep_layout=tuple(rep_layout),
        sum_layout=tuple(sum_layout),
        space=space,
        pullback=pullback,
        jvp_split=jvp_split,
    )


def _split(seq: Sequence, sizes: Sequence[int]) -> list:
    out, i = [], 0
    for s in sizes:
        out.append(list(seq[i : i + s]))
        i += s
    out.append(list(seq[i:]))
    return out


# --- jvp: tangent = CMR of the chunk's jvp, tangents as extra (replicated / per-sample) operands ---


KEPT_NOT_DIFFERENTIABLE = (
    "vmcgrad.LinearizedQGT cannot be differentiated in its kept linearisations (jax.grad / jax.jvp / "
    "jax.jacfwd of S.linearize() in the parameters, or of a product or solve in the kept maps, with or "
    "without jax.jit): the kept linear maps are constants of one parameter point. Products and solves "
    "of a LinearizedQGT are differentiable in their vector, and jax.vmap works. Fix: differentiate the "
    "operator that recomputes the forward pass, vmcgrad.QGT(...) @ v or vmcgrad.QGT(...).solve(b) "
    "(every transformation works there), or wrap the parameters in jax.lax.stop_gradient."
)


def _jvp_rule(
    primals, tangents, *, body, n_rep, n_pc, n_sum, n_slot, rep_layout, sum_layout, space, pullback, jvp_split
):
    del jvp_split  # a combined equation differentiated again: its body is an ordinary one
    params = dict(body=body, n_sum=n_sum, n_slot=n_slot, rep_layout=rep_layout, sum_layout=sum_layout)
    params["space"] = space
    n_ps, _ = _counts(body, n_rep, n_pc, n_sum, n_slot)
    nz = [type(t) is not ad.Zero for t in tangents]
    if not any(nz):
        rep, ps, pc = _split(primals, [n_rep, n_ps])
        out = _bind(rep, ps, pc, **params, pullback=pullback)
        return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    # Per-chunk values (kept linearisations) are constants of one point: a pass that writes them, or
    # one that reads them, is not differentiated in them (its derivative would need the derivative of
    # JAX's linearisation residuals). Refused here, inside the rule, so that it holds under jax.jit.
    if n_slot or any(nz[n_rep + n_ps :]):
        raise TypeError(KEPT_NOT_DIFFERENTIABLE)
    # One bind for primal and tangent where the primal outputs are real. jax.checkpoint's partial
    # evaluation saves them (_partial_eval_custom_rule), and jax 0.10.2 cannot save a complex value
    # there (it inserts reduce_precision, which refuses complex dtypes): complex outputs take two
    # binds, the primal part then being recomputed as checkpoint asks.
    combine = all(jnp.issubdtype(a.dtype, jnp.floating) for a in body.out_avals)
    in_avals = body.in_avals  # (*rep, *per_sample_chunk, *per_chunk_slot, w)
    n_in = len(in_avals) - 1
    nz_rep = [i for i in range(n_rep) if nz[i]]
    nz_ps = [i for i in range(n_rep, n_rep + n_ps) if nz[i]]
    moving = nz_rep + nz_ps

    def jvp_of_body(args):
        rep, d_rep, ps, d_ps, pc, (w,) = _split(args, [n_rep, len(nz_rep), n_ps, len(nz_ps), n_pc])
        primal = rep + ps + pc

        def h(*vals):
            full = list(primal)
            for i, v in zip(moving, vals):
                full[i] = v
            return jaxpr_as_fun(body)(*full, w)

        return jax.jvp(h, tuple(primal[i] for i in moving), tuple(d_rep + d_ps))

    def g_tangent(*args):
        return jvp_of_body(args)[1]

    def g_both(*args):  # (*sums, *tangent sums, *maps, *tangent maps)
        out, t_out = jvp_of_body(args)
        return [*out[:n_sum], *t_out[:n_sum], *out[n_sum:], *t_out[n_sum:]]

    avals = (
        list(in_avals[:n_rep])
        + [in_avals[i] for i in nz_rep]
        + list(in_avals[n_rep : n_rep + n_ps])
        + [in_avals[i] for i in nz_ps]
        + list(in_avals[n_rep + n_ps : n_in])
        + [in_avals[-1]]
    )
    rep_in = list(primals[:n_rep]) + [tangents[i] for i in nz_rep]
    ps_in = list(primals[n_rep : n_rep + n_ps]) + [tangents[i] for i in nz_ps]
    pc_in = list(primals[n_rep + n_ps :])
    tangent = dict(
        body=_trace(g_tangent, avals),
        n_rep=len(rep_in),
        n_pc=n_pc,
        n_sum=n_sum,
        n_slot=0,
        rep_layout=tuple(rep_layout) + tuple(rep_layout[i] for i in nz_rep),
        sum_layout=sum_layout,
        space=space,
        pullback=None,
        jvp_split=None,
    )
    bind_tangent = {k: v for k, v in tangent.items() if k not in ("n_rep", "n_pc")}
    if not combine:
        out = _bind(primals[:n_rep], primals[n_rep : n_rep + n_ps], pc_in, **params, pullback=pullback)
        return out, _bind(rep_in, ps_in, pc_in, **bind_tangent)
    n_out = len(body.out_avals)
    first_pc = len(rep_in) + len(ps_in)
    split = _JvpSplit(
        primal_in=tuple(range(n_rep))
        + tuple(range(len(rep_in), len(rep_in) + n_ps))
        + tuple(range(first_pc, first_pc + n_pc)),
        primal=tuple(
            sorted({**params, "n_rep": n_rep, "n_pc": n_pc, "pullback": pullback, "jvp_split": None}.items())
        ),
        tangent=tuple(sorted(tangent.items())),
        primal_out=tuple(range(n_sum)) + tuple(range(2 * n_sum, n_sum + n_out)),
        tangent_out=tuple(range(n_sum, 2 * n_sum)) + tuple(range(n_sum + n_out, 2 * n_out)),
    )
    both = _bind(
        rep_in,
        ps_in,
        pc_in,
        body=_trace(g_both, avals),
        rep_layout=tangent["rep_layout"],
        n_sum=2 * n_sum,
        sum_layout=tuple(sum_layout) * 2,
        space=space,
        jvp_split=split,
    )
    return [both[i] for i in split.primal_out], [both[i] for i in split.tangent_out]


class _JvpSplit(NamedTuple):
    """How a combined primal-and-tangent equation (the jvp rule's one bind) splits in two when only
    its tangents are unknown (``jax.linearize``, ``jax.grad``, ``jax.checkpoint``): operand and output
    positions of the primal part, and the bind parameters of each part (as sorted items: hashable)."""

    primal_in: tuple
    primal: tuple
    tangent: tuple
    primal_out: tuple
    tangent_out: tuple

    def splits(self, unknown_in: Sequence[bool]) -> bool:
        """Whether the primal operands are all known and some tangent operand is not."""
        primal = set(self.primal_in)
        return not any(unknown_in[i] for i in primal) and any(
            u for i, u in enumerate(unknown_in) if i not in primal
        )


ad.primitive_jvps[chunked_p] = _jvp_rule


# --- partial evaluation: a combined equation with known primals splits into its two parts ---------


def _partial_eval_rule(trace, *tracers, **params):
    """``jax.linearize`` / ``jax.grad``: the primal part runs now, the tangent part is staged."""
    split = params["jvp_split"]
    if split is None or not split.splits([not t.pval.is_known() for t in tracers]):
        return trace.default_process_primitive(chunked_p, tracers, params)
    known = [tracers[i].pval.get_known() for i in split.primal_in]
    primal_out = chunked_p.bind(*known, **dict(split.primal))
    tangent_out = trace.default_process_primitive(chunked_p, tracers, dict(split.tangent))
    out = [None] * (len(primal_out) + len(tangent_out))
    for i, o in zip(split.primal_out, primal_out):
        out[i] = trace.new_const(o)
    for i, o in zip(split.tangent_out, tangent_out):
        out[i] = o
    return out


def _partial_eval_custom_rule(saveable, unks_in, inst_in, eqn):
    """The same split for ``jax.checkpoint``'s partial evaluation: the primal part is a known
    equation whose outputs are saved, the tangent part a staged one reading the primal operands."""
    split = eqn.params["jvp_split"]
    residuals = [v for v, inst in zip(eqn.invars, inst_in) if isinstance(v, Var) and not inst]
    n_out = len(eqn.outvars)
    if split is None or not split.splits(unks_in):  # what JAX does for a primitive without a rule
        if any(unks_in):
            return None, eqn, [True] * n_out, [True] * n_out, residuals
        if _saved(saveable, eqn):
            return eqn, None, [False] * n_out, [False] * n_out, []
        return eqn, eqn, [False] * n_out, [True] * n_out, residuals  # recomputed where it is needed
    primal_params, tangent_params = dict(split.primal), dict(split.tangent)
    known = eqn.replace(
        invars=[eqn.invars[i] for i in split.primal_in],
        outvars=[eqn.outvars[i] for i in split.primal_out],
        params=primal_params,
        effects=primal_params["body"].effects,
    )
    staged = eqn.replace(
        outvars=[eqn.outvars[i] for i in split.tangent_out],
        params=tangent_params,
        effects=tangent_params["body"].effects,
    )
    unks_out, inst_out = [True] * n_out, [True] * n_out
    for i in split.primal_out:
        unks_out[i], inst_out[i] = False, False
    # the staged part reads the primal operands: those not already available there are residuals
    residuals = [eqn.invars[i] for i in split.primal_in if isinstance(eqn.invars[i], Var) and not inst_in[i]]
    return known, staged, unks_out, inst_out, residuals


def _saved(saveable: Callable, eqn: Any) -> bool:
    """Whether ``jax.checkpoint``'s policy saves this equation's outputs (rather than recomputing
    them): a policy answers True, or a saveable / offloadable case (JAX's enum, read by name)."""
    answer = saveable(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
    if isinstance(answer, bool):
        return answer
    return type(answer).__name__ in ("SaveableType", "Offloadable")


pe.custom_partial_eval_rules[chunked_p] = _partial_eval_rule
pe.partial_eval_jaxpr_custom_rules[chunked_p] = _partial_eval_custom_rule


# --- transpose: CMR of the chunk's linear transpose; per-sample cotangents masked by w -------------


def _transpose_rule(
    cts, *args, body, n_rep, n_pc, n_sum, n_slot, rep_layout, sum_layout, space, pullback, jvp_split
):
    del pullback, jvp_split  # the transposed body is the generic one
    lin = [ad.is_undefined_primal(a) for a in args]
    in_avals, out_avals = body.in_avals, body.out_avals
    n_in = len(in_avals) - 1
    n_ps, n_map = _counts(body, n_rep, n_pc, n_sum, n_slot)
    ct_nz = [type(c) is not ad.Zero for c in cts]
    if n_slot or any(lin[n_rep + n_ps :]):  # per-chunk values are never linear inputs (see the jvp rule)
        raise TypeError(KEPT_NOT_DIFFERENTIABLE)
    lin_rep = [i for i in range(n_rep) if lin[i]]
    lin_ps = [i for i in range(n_rep, n_rep + n_ps) if lin[i]]
    const_rep = [i for i in range(n_rep) if not lin[i]]
    const_ps = [i for i in range(n_rep, n_rep + n_ps) if not lin[i]]
    const_pc = list(range(n_rep + n_ps, n_in))
    ct_sum = [j for j in range(n_sum) if ct_nz[j]]
    ct_map = [j for j in range(n_sum, n_sum + n_map) if ct_nz[j]]
    if not ct_sum and not ct_map:
        return [ad.Zero(a.aval.to_tangent_aval()) if is_lin else None for is_lin, a in zip(lin, args)]

    def g_transpose(*vals):
        c_rep, c_sum, c_ps, c_map, c_pc, (w,) = _split(
            vals, [len(const_rep), len(ct_sum), len(const_ps), len(ct_map), len(const_pc)]
        )
        consts = dict(zip(const_rep + const_ps + const_pc, c_rep + c_ps + c_pc))

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
        + [in_avals[i] for i in const_pc]
        + [in_avals[-1]]
    )
    res = _bind(
        [args[i] for i in const_rep] + [cts[j] for j in ct_sum],
        [args[i] for i in const_ps] + [cts[j] for j in ct_map],
        [args[i] for i in const_pc],
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


def _batch_rule(
    args, dims, *, body, n_rep, n_pc, n_sum, n_slot, rep_layout, sum_layout, space, pullback, jvp_split
):
    del pullback  # the batched body is the generic one
    if jvp_split is not None and all(dims[i] is None for i in jvp_split.primal_in):
        # Batched tangents only (jax.jacfwd, jax.hessian): the primal part stays unbatched.
        primal_out = chunked_p.bind(*(args[i] for i in jvp_split.primal_in), **dict(jvp_split.primal))
        t_out, t_dims = _batch_rule(args, dims, **dict(jvp_split.tangent))
        out, out_dims = [None] * (len(primal_out) + len(t_out)), [None] * (len(primal_out) + len(t_out))
        for i, o in zip(jvp_split.primal_out, primal_out):
            out[i] = o
        for i, o, d in zip(jvp_split.tangent_out, t_out, t_dims):
            out[i], out_dims[i] = o, d
        return out, out_dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    in_avals = body.in_avals
    n_ps, n_map = _counts(body, n_rep, n_pc, n_sum, n_slot)
    # Where the batch axis goes: replicated operands on axis 0 (axis 0 in the body); per-sample ones
    # on axis 1 (axis 1 of the chunk: the sample axis stays first); per-chunk ones on axis 1 (axis 0
    # of the slot the body reads: the chunk axis stays first).
    outer = [0] * n_rep + [1] * n_ps + [1] * n_pc
    inner = [0] * n_rep + [1] * n_ps + [0] * n_pc
    moved, in_axes, avals = [], [], []
    for i, (a, d) in enumerate(zip(args, dims)):
        aval = in_avals[i]
        if d is None:
            moved.append(a)
            in_axes.append(None)
            avals.append(aval)
            continue
        moved.append(jnp.moveaxis(a, d, outer[i]))
        in_axes.append(inner[i])
        shape = list(aval.shape)
        shape.insert(inner[i], size)
        avals.append(jax.core.ShapedArray(tuple(shape), aval.dtype))
    body_out = [0] * n_sum + [1] * n_map + [0] * n_slot
    out_axes = [0] * n_sum + [1] * n_map + [1] * n_slot
    batched = jax.vmap(jaxpr_as_fun(body), in_axes=(*in_axes, None), out_axes=body_out)
    shift = lambda d, b: d if d is None or b is None else d + 1
    rep, ps, pc = _split(moved, [n_rep, n_ps])
    outs = _bind(
        rep,
        ps,
        pc,
        body=_trace(lambda *a: batched(*a), [*avals, in_avals[-1]]),
        rep_layout=tuple(shift(d, b) for d, b in zip(rep_layout, in_axes[:n_rep])),
        n_sum=n_sum,
        n_slot=n_slot,
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


def _pullback_jaxprs(chunk_fun: Callable, unpack: Callable, avals: list, sum_avals: Sequence) -> tuple | None:
    """The ``pullback`` parameter of a chunk function whose sums are a :class:`Pullback`, or None
    where the lowering cannot write them through ``with_refs`` (then the generic body runs).

    Two jaxprs on the body's operands: ``point`` gives the primal leaves, ``fwd`` the function's
    outputs and the cotangent at given primals. ``with_refs`` adds into refs of the primals' own
    shapes and dtypes, so the form is kept only where those are the accumulators' (the sums'
    dtypes promoted to at least float32); and only where nothing traced is closed over (an outer
    transformation's value: the primitive's operands must carry it, as :func:`_hoist` makes them).
    """
    structure = []

    def point(*args):
        rep, chunk, _, w = unpack(args)
        pull = chunk_fun(*rep, *chunk, w)[0]
        leaves, tree = jax.tree.flatten(pull.primals)
        structure.append(tree)
        return leaves

    point_jaxpr = _trace(point, avals)
    primal_avals = point_jaxpr.out_avals
    n_y = []

    def fwd(*args):
        rep, chunk, _, w = unpack(args[: len(avals)])
        pull = chunk_fun(*rep, *chunk, w)[0]
        y, ct = pull.fun(jax.tree.unflatten(structure[0], args[len(avals) :]))
        y_leaves, ct_leaves = jax.tree.leaves(y), jax.tree.leaves(ct)
        n_y.append(len(y_leaves))
        return [*y_leaves, *ct_leaves]

    fwd_jaxpr = _trace(fwd, [*avals, *primal_avals])
    like = len(primal_avals) == len(sum_avals) and all(
        p.shape == a.shape and p.dtype == a.dtype == acc_dtype(a.dtype)
        for p, a in zip(primal_avals, sum_avals)
    )
    traced = any(isinstance(c, jax.core.Tracer) for j in (point_jaxpr, fwd_jaxpr) for c in j.consts)
    if not like or traced:
        return None
    pullback = (point_jaxpr, fwd_jaxpr, n_y[0])
    return pullback if _with_refs_traces(pullback, avals, sum_avals) else None


def _with_refs_traces(pullback: tuple, avals: list, sum_avals: Sequence) -> bool:
    """Whether JAX can write this pullback through ``with_refs`` (traced once, not run).

    Not every transpose rule in jax 0.10.2 accumulates into refs: a model that slices or indexes its
    parameters (``W[:, 0]``, ``W[0]``) or calls ``slogdet`` fails inside ``with_refs`` ("'NoneType'
    object is not iterable", a ``dot_general`` shape error). Such a pullback takes the generic body
    (``acc[...] += part``), which every transpose supports. The failure is caught inside the probe's
    trace, so that the trace ends normally and keeps none of the model's constants alive.
    """
    ok = []

    def probe(*args):
        accs = [jax.new_ref(jnp.zeros(a.shape, a.dtype)) for a in sum_avals]
        try:  # inside the trace, so that the trace itself ends normally and keeps nothing alive
            _pull_into(accs, pullback, list(args[:-1]), [], args[-1])  # operands in the body's order
            ok.append(True)
        except Exception as err:  # any failure inside JAX's ref transposes: use the generic body
            _drop_frames(err)
            ok.append(False)
        return [jax.ref.freeze(a) for a in accs]

    with jax.sharding.use_abstract_mesh(_NO_MESH):
        jax.make_jaxpr(probe)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
    return ok[0]


def _drop_frames(err: BaseException) -> None:
    """Clears the frames of a failed probe's exception chain: they hold the abandoned trace, whose
    constants (a user's closure) would otherwise outlive the call."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


def map_reduce(
    space: Space,
    chunk_fun: Callable[..., tuple],
    replicated: Sequence[tuple[Any, Any]],
    per_sample: Sequence[Any],
    *,
    per_chunk: Sequence[Any] = (),
    sum_layout: tuple | None = None,
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
    that reads or writes them refuses a nonzero tangent with a TypeError (they are
    :class:`vmcgrad.LinearizedQGT`'s kept linearisations, constants of one parameter point).

    Args:
        space: the rows (:class:`vmcgrad._chunks.plan.Space`).
        chunk_fun: ``chunk_fun(*replicated_trees, *chunk_trees, *slot_trees, w) -> (sums, maps)``
            or ``-> (sums, maps, slots)``, with ``w`` the ``(size,)`` bool row mask; ``sums`` (a
            pytree) must not depend on rows where ``w`` is False; ``maps`` is a pytree of arrays
            with leading axis ``size``; ``slots`` a pytree of arrays, this chunk's own values.
        replicated: ``(tree, layout)`` pairs, ``layout`` one split dimension or None per leaf.
        per_sample: trees with the N rows on axis 0.
        per_chunk: trees with every device's chunks on axis 0 (``devices * chunks``, in device
            order: a ``slots`` output of a pass over the same ``space``); ``chunk_fun`` gets slot
            ``k`` of each leaf for chunk ``k``.
        sum_layout: per leaf of the summed outputs, the split dimension or None (default: all
            replicated).

    Returns:
        ``(sums, maps)``, or ``(sums, maps, slots)`` where ``chunk_fun`` returns three: the sums
        at the dtypes ``chunk_fun`` returns them (accumulated at float32 or better), the maps with
        leading axis N, split like the samples, the slots with leading axis ``devices * chunks``,
        split like the devices.
    """
    rep_trees = [t for t, _ in replicated]
    rep_flat = [jax.tree.flatten(t) for t in rep_trees]
    ps_flat = [jax.tree.flatten(t) for t in per_sample]
    pc_flat = [jax.tree.flatten(t) for t in per_chunk]
    rep_leaves = [x for leaves, _ in rep_flat for x in leaves]
    ps_leaves = [x for leaves, _ in ps_flat for x in leaves]
    pc_leaves = [x for leaves, _ in pc_flat for x in leaves]
    rep_layout = tuple(d for _, layout in replicated for d in layout)
    size = _chunk_rows(space)
    slots = _slots(space)
    if any(x.ndim == 0 or x.shape[0] != slots for x in pc_leaves):
        raise ValueError(
            f"vmcgrad: per-chunk values must have leading axis {slots} (devices x chunks of this pass); "
            f"got shapes {sorted({tuple(x.shape) for x in pc_leaves})}. They were kept at another chunk "
            "plan. Fix: keep them (S.linearize()) and use them with the same operator."
        )
    trees = []

    def unpack(args):
        it = iter(args)
        rep = [jax.tree.unflatten(td, [next(it) for _ in leaves]) for leaves, td in rep_flat]
        chunk = [jax.tree.unflatten(td, [next(it) for _ in leaves]) for leaves, td in ps_flat]
        own = [jax.tree.unflatten(td, [next(it) for _ in leaves]) for leaves, td in pc_flat]
        return rep, chunk, own, next(it)

    def flat(*args):
        rep, chunk, own, w = unpack(args)
        sums, maps, *rest = chunk_fun(*rep, *chunk, *own, w)
        pull = isinstance(sums, Pullback)
        if pull:
            sums = sums.value()
        s_leaves, s_tree = jax.tree.flatten(sums)
        m_leaves, m_tree = jax.tree.flatten(maps)
        k_leaves, k_tree = jax.tree.flatten(rest[0] if rest else ())
        trees.append((s_tree, m_tree, k_tree, len(s_leaves), len(k_leaves), pull, bool(rest)))
        return [*s_leaves, *m_leaves, *k_leaves]

    avals = (
        [jax.typeof(x) for x in rep_leaves]
        + [jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype) for x in ps_leaves]
        + [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in pc_leaves]
        + [jax.ShapeDtypeStruct((size,), jnp.bool_)]
    )
    body, hoisted = _hoist(flat, avals)
    s_tree, m_tree, k_tree, n_sum, n_slot, pull, three = trees[0]
    pull = pull and not pc_leaves  # the pullback form reads no per-chunk operands
    pullback = _pullback_jaxprs(chunk_fun, unpack, avals, body.out_avals[:n_sum]) if pull else None
    layout = (None,) * n_sum if sum_layout is None else tuple(sum_layout)
    outs = _bind(
        [*hoisted, *rep_leaves],
        ps_leaves,
        pc_leaves,
        body=body,
        rep_layout=(None,) * len(hoisted) + rep_layout,
        n_sum=n_sum,
        n_slot=n_slot,
        sum_layout=layout,
        space=space,
        pullback=None if hoisted else pullback,
    )
    n_map = len(outs) - n_sum - n_slot
    sums = jax.tree.unflatten(s_tree, outs[:n_sum])
    maps = jax.tree.unflatten(m_tree, outs[n_sum : n_sum + n_map])
    if not three:
        return sums, maps
    return sums, maps, jax.tree.unflatten(k_tree, outs[n_sum + n_map :])


def map_reduce_problem(
    prob: Any,
    inputs: Any,
    chunk_fun: Callable[..., tuple],
    *extra: tuple[Any, Any],
    sum_layout=None,
) -> tuple:
    """:func:`map_reduce` over a problem's rows: ``chunk_fun(fun, params, x, w, *extra) -> (sums, maps)``
    (or ``(sums, maps, slots)``).

    ``fun`` is the user's function (its ``Partial`` arrays are replicated operands, so they are
    differentiated and batched too), ``params`` the full parameters, ``x`` the chunk of samples;
    ``extra`` are ``(value, placement)`` pairs, placement :data:`~vmcgrad._runner.runner.SAMPLES`,
    :data:`~vmcgrad._runner.runner.CHUNKS` (one slot per chunk), :data:`~vmcgrad._runner.runner.REPLICATED`
    or a layout tuple, passed to ``chunk_fun`` in order (per-sample ones chunked, per-chunk ones at the
    chunk's slot).
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

    return map_reduce(prob.space, g, rep, per_sample, per_chunk=per_chunk, sum_layout=sum_layout)
