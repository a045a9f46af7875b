r"""Sums written as a pullback: the runner adds them into ``jax.new_ref`` accumulators through
``jax.vjp(...).with_refs``.

A chunk function may return its sums as a :class:`Pullback`. :func:`open_pullback` reads it inside
the one trace of the chunk function (:func:`vmcgrad._runner.primitive.map_reduce`): the chunk's
primal leaves and the values the pullback's function closes over become outputs of that trace
(the *pre* body), and the function itself one jaxpr on them (*fwd*). From the two,
:func:`pullback_body` composes the generic body that the transformation rules see, and the
untransformed primitive's loop (:func:`vmcgrad._runner.runner.device_pass`) calls
:func:`pull_chunk`, which writes ``f_vjp.with_refs(*accumulators)(c)``: a function with a
``lax.scan`` over layers then adds each layer's gradient straight into the accumulator instead of
first building the stacked per-layer gradient (measured: ``benchmarks/estimator_temp_bytes.py``).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vmcgrad._chunks.plan import acc_dtype, slice_rows
from vmcgrad._jax_private import ClosedJaxpr, jaxpr_as_fun
from vmcgrad._runner.body import Body, Operands, trace, trace_flat


class Pullback(NamedTuple):
    r"""A chunk's summed output written as a pullback, so the runner can add it straight into refs.

    A chunk function may return ``Pullback(fun, primals)`` as its sums, meaning

    .. math::

        \mathrm{sums} = \mathrm{vjp}_{\mathrm{fun}}(\mathrm{primals})(c),
        \qquad (y, c) = \mathrm{fun}(\mathrm{primals})

    (``c`` is ``fun``'s auxiliary output: the cotangent, not differentiated). The untransformed
    primitive lowers it as ``jax.vjp(fun, primals, has_aux=True)`` and
    ``f_vjp.with_refs(*accumulators)(c)``. Transformation rules see the same sums as an ordinary
    value (the generic body) and bind the primitive without the pullback form.
    """

    fun: Callable[[Any], tuple[Any, Any]]
    primals: Any

    def value(self) -> Any:
        """The sums, as an ordinary value: ``f_vjp(c)``."""
        _, f_vjp, ct = jax.vjp(self.fun, self.primals, has_aux=True)
        (out,) = f_vjp(ct)
        return out


@dataclasses.dataclass(frozen=True)
class PullbackJaxprs:
    """A chunk's sums as a pullback, for the lowering (the primitive's ``pullback`` parameter).

    Attributes:
        pre: the chunk function's one trace, with the sums replaced by ``(*primals, *closed)``: the
            primal leaves and the values ``fwd`` closes over (maps and slots as they are).
        fwd: ``fwd(*closed, *primals) -> (*y, *c)``: the pullback's function and its cotangent.
        n_primals: how many primal leaves.
        n_y: how many leaves ``y`` has.
    """

    pre: Body
    fwd: ClosedJaxpr
    n_primals: int
    n_y: int

    def vjp(self, pre_sums: Sequence) -> tuple[Callable, Any]:
        """``(f_vjp, c)`` of ``fwd`` at the primals ``pre`` gave (``pre_sums``)."""
        primals, closed = pre_sums[: self.n_primals], pre_sums[self.n_primals :]

        def f(*theta):
            outs = jaxpr_as_fun(self.fwd)(*closed, *theta)
            return list(outs[: self.n_y]), list(outs[self.n_y :])

        _, f_vjp, ct = jax.vjp(f, *primals, has_aux=True)
        return f_vjp, ct


@dataclasses.dataclass
class Opened:
    """What :func:`open_pullback` recorded during the trace: ``fun``'s jaxpr on the primals, its
    constants (None where a constant is a value of the enclosing trace, which is then an output
    of ``pre``), and the structure of the primals."""

    jaxpr: Any
    consts: list
    n_y: int
    primal_tree: Any


def open_pullback(pull: Pullback) -> tuple[list, Opened]:
    """Inside the chunk function's trace: ``pull``'s primal leaves and the traced values its
    function closes over (the outputs that replace the sums in ``pre``), and the record of it."""
    leaves, tree = jax.tree.flatten(pull.primals)
    n_y = []

    def fwd(*theta):
        y, ct = pull.fun(jax.tree.unflatten(tree, theta))
        y_leaves = jax.tree.leaves(y)
        n_y.append(len(y_leaves))
        return [*y_leaves, *jax.tree.leaves(ct)]

    closed = jax.make_jaxpr(fwd)(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves))
    traced = [c for c in closed.consts if isinstance(c, jax.core.Tracer)]
    consts = [None if isinstance(c, jax.core.Tracer) else c for c in closed.consts]
    return [*leaves, *traced], Opened(closed.jaxpr, consts, n_y[0], tree)


def pullback_jaxprs(pre: Body, opened: Opened) -> PullbackJaxprs:
    """``pre`` and the pullback's function as a closed jaxpr on ``(*closed, *primals)``."""
    n_primals = opened.primal_tree.num_leaves
    sums = pre.out_avals.sums
    n_closed = len(sums) - n_primals

    def fwd(*args):
        it = iter(args[:n_closed])
        consts = [next(it) if c is None else c for c in opened.consts]
        return jax.core.eval_jaxpr(opened.jaxpr, consts, *args[n_closed:])

    closed = trace_flat(fwd, [*sums[n_primals:], *sums[:n_primals]])
    return PullbackJaxprs(pre, closed, n_primals, opened.n_y)


def pullback_body(pb: PullbackJaxprs) -> Body:
    """The generic body: ``pre``, with its sums the pullback's value ``f_vjp(c)``."""

    def body(ops, w):
        out = pb.pre(ops, w)
        f_vjp, ct = pb.vjp(out.sums)
        return out._replace(sums=tuple(f_vjp(ct)))

    return trace(body, pb.pre.in_avals, pb.pre.w_aval)


def writable(pb: PullbackJaxprs, hoisted: bool) -> bool:
    """Whether the lowering can write this pullback through ``with_refs``.

    ``with_refs`` adds into refs of the primals' own shapes and dtypes, so the form is kept only
    where those are the accumulators' (at least float32); only where nothing traced is closed over
    (``hoisted``: an outer transformation's value, which the primitive's operands must carry); and
    only where JAX can transpose the function into refs (:func:`_with_refs_traces`).
    """
    primals = pb.pre.out_avals.sums[: pb.n_primals]
    if hoisted or any(p.dtype != acc_dtype(p.dtype) for p in primals):
        return False
    return _with_refs_traces(pb)


#: What JAX raises where a transpose rule cannot accumulate into refs (jax 0.10.2): a shape rule's
#: TypeError / ValueError (a ``dot_general`` shape error, "'NoneType' object is not iterable" from a
#: slice's transpose) or a missing rule's NotImplementedError.
_REFS_UNSUPPORTED = (TypeError, ValueError, NotImplementedError)


def _with_refs_traces(pb: PullbackJaxprs) -> bool:
    """Whether JAX can write this pullback through ``with_refs`` (``fwd``'s jaxpr traced once into
    fresh refs, not run; the chunk function is not traced again).

    Not every transpose rule in jax 0.10.2 accumulates into refs: a model that slices or indexes its
    parameters (``W[:, 0]``, ``W[0]``) fails inside ``with_refs``. Such a pullback takes the generic
    body (``acc[...] += part``), which every transpose supports. The failure is caught inside the
    probe's trace, so that the trace ends normally and keeps none of the model's constants alive.
    """
    ok = []
    sums = pb.pre.out_avals.sums

    def probe(*sums):
        accs = [jax.new_ref(jnp.zeros(a.shape, a.dtype)) for a in sums[: pb.n_primals]]
        try:  # inside the trace, so that the trace itself ends normally and keeps nothing alive
            f_vjp, ct = pb.vjp(sums)
            f_vjp.with_refs(*accs)(ct)
            ok.append(True)
        except _REFS_UNSUPPORTED as err:
            _drop_frames(err)
            ok.append(False)
        return [jax.ref.freeze(a) for a in accs]

    trace_flat(probe, sums)
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


# --- in the lowering: one chunk's pullback added into the accumulators ------------------------------


def pull_chunk(
    accs: list,
    pb: PullbackJaxprs,
    rep: Sequence,
    chunk: Sequence,
    samples: Sequence,
    chunks: Any,
    k: Any,
    w: Any,
) -> Any:
    """Chunk ``k``'s sums added into ``accs`` through ``with_refs``; returns ``pre``'s outputs on
    the chunk (its maps and slots are the chunk's). ``chunk`` is the chunk of ``samples``."""
    if not has_uncounted_rows(chunks):
        out = pb.pre(Operands(tuple(rep), tuple(chunk)), w)
        _pull_into(accs, pb, out.sums)
        return out
    # rows of weight 0 must add an exact zero (see _finite_stand_ins)
    chunk = _finite_stand_ins(pb, rep, samples, chunks, k, w)
    out = pb.pre(Operands(tuple(rep), tuple(chunk)), w)
    jax.lax.cond(jnp.any(w), lambda: _pull_into(accs, pb, out.sums), lambda: None)
    return out


def _pull_into(accs: list, pb: PullbackJaxprs, pre_sums: Sequence) -> None:
    f_vjp, ct = pb.vjp(pre_sums)
    f_vjp.with_refs(*accs)(ct)


def has_uncounted_rows(chunks: Any) -> bool:
    """Whether any chunk on any device holds rows of weight False (known statically: padding to the
    device count, or a shifted last chunk)."""
    return not chunks.every_row


def _finite_stand_ins(
    pb: PullbackJaxprs, rep: Sequence, samples: Sequence, chunks: Any, k: Any, w: Any
) -> list:
    r"""The chunk with every row of weight False replaced by a copy of a counted row whose derivative
    is finite (when one exists), so that rows that do not count add an exact zero.

    A row of weight 0 (re-read by the shifted last chunk, or padding) enters the pullback with
    cotangent 0, and :math:`0 \cdot \infty` is NaN: one re-read row with an infinite derivative
    would turn the whole sum into NaN where ``jax.vjp`` gives ``inf``. A row's derivative
    :math:`J_r` is finite exactly when :math:`J_r \cdot \mathbf 1` is (a sum with an infinite or
    NaN term is never finite), so one forward-mode pass over the chunk finds the rows that may stand
    in. Run only for chunks that hold rows of weight 0 (at most two per device and pass).
    """

    def find(samples):
        *chunk, _ = chunks.take(k, *samples)
        sums = pb.pre(Operands(tuple(rep), tuple(chunk)), w).sums
        primals, closed = sums[: pb.n_primals], sums[pb.n_primals :]
        ones = [jnp.ones_like(p) for p in primals]
        fwd = lambda *t: list(jaxpr_as_fun(pb.fwd)(*closed, *t)[: pb.n_y])
        _, y_dot = jax.jvp(fwd, tuple(primals), tuple(ones))
        finite = w
        for t in y_dot:
            finite = finite & jnp.all(jnp.isfinite(t).reshape(t.shape[0], -1), axis=1)
        return jnp.any(finite), jnp.argmax(finite).astype(jnp.int32)

    # Only the stand-in's index leaves the cond, and the chunk is sliced from the device's rows once,
    # fused with the replacement (a second chunk-sized buffer would cost temp memory).
    none = lambda _: (jnp.bool_(False), jnp.int32(0))
    found, stand_in = jax.lax.cond(jnp.all(w), none, find, list(samples))
    keep = w | ~found
    start = chunks.start(k)
    size = w.shape[0]

    def put(a):
        rows = slice_rows(a, start, size)
        row = slice_rows(a, start + stand_in, 1)
        return jnp.where(keep.reshape((size,) + (1,) * (a.ndim - 1)), rows, row)

    return jax.tree.map(put, list(samples))
