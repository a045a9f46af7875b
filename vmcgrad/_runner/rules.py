"""The chunked primitive's transformation rules: each binds the primitive again on a new body.

jvp (the chunk's jvp, tangents as extra operands), partial evaluation (a combined primal-and-tangent
pass splits when its primals are known), transpose (the chunk's linear transpose) and batching (the
vmapped chunk). The formulas are in :mod:`vmcgrad._runner.primitive`'s docstring. Every rule sees the
operands grouped (:class:`~vmcgrad._runner.body.Operands`) and the parameters as one
:class:`~vmcgrad._runner.primitive.Params`; importing this module registers the rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._jax_private import Var, ad, batching, pe
from vmcgrad._runner.body import Operands, Outputs, trace
from vmcgrad._runner.primitive import Params, bind, chunked_p


def _pick(seq: Sequence, idx: Sequence[int]) -> tuple:
    return tuple(seq[i] for i in idx)


def _put(base: Sequence, idx: Sequence[int], values: Sequence) -> tuple:
    """``base`` with ``values`` at the positions ``idx``."""
    out = list(base)
    for i, v in zip(idx, values):
        out[i] = v
    return tuple(out)


def _where(flags: Sequence[bool], want: bool = True) -> list[int]:
    return [i for i, f in enumerate(flags) if f == want]


# --- jvp: tangent = CMR of the chunk's jvp, tangents as extra (replicated / per-sample) operands ---


#: The refusal of a derivative in per-chunk values where the caller named them in no words of its own.
KEPT_NOT_DIFFERENTIABLE = (
    "vmcgrad: a chunked pass that keeps values per chunk, or reads kept ones, cannot be differentiated "
    "in them (jax.grad / jax.jvp / jax.jacfwd / jax.linearize, with or without jax.jit): they are "
    "constants of one point. Fix: differentiate the computation that recomputes them, or stop the "
    "gradient of its inputs (jax.lax.stop_gradient)."
)


def kept_refused(params: Any) -> TypeError:
    """The TypeError of a derivative in per-chunk values: the caller's words for them
    (``params.kept_note``), else :data:`KEPT_NOT_DIFFERENTIABLE`."""
    return TypeError(params.kept_note or KEPT_NOT_DIFFERENTIABLE)


@dataclasses.dataclass(frozen=True)
class JvpSplit:
    """How a combined primal-and-tangent pass (the jvp rule's one bind) splits in two when only its
    tangents are unknown (``jax.linearize``, ``jax.grad``, ``jax.checkpoint``) or only they are
    batched (``jax.jacfwd``).

    The combined pass reads ``Operands(rep + d_rep, samples + d_samples, chunks)`` and writes
    ``Outputs(sums + d_sums, maps + d_maps)``: the primal part is the leading operands and outputs
    of each group, with parameters ``primal``; the tangent part reads every operand and writes the
    rest, with parameters ``tangent``.
    """

    primal: Params
    tangent: Params

    def primal_operands(self, ops: Operands) -> Operands:
        n_rep, n_ps = self.primal.body.n_in
        return Operands(ops.rep[:n_rep], ops.samples[:n_ps], ops.chunks)

    def parts(self, out: Outputs) -> tuple[Outputs, Outputs]:
        """The combined outputs as (primal outputs, tangent outputs)."""
        n_sum, n_map = self.primal.body.n_out
        return Outputs(out.sums[:n_sum], out.maps[:n_map]), Outputs(out.sums[n_sum:], out.maps[n_map:])

    def join(self, primal: Outputs, tangent: Outputs) -> Outputs:
        return Outputs(primal.sums + tangent.sums, primal.maps + tangent.maps)

    def splits(self, unknown: Operands) -> bool:
        """Whether the primal operands are all known and some tangent operand is not."""
        return not any(self.primal_operands(unknown).flat()) and any(unknown.flat())


def _jvp_rule(primals, tangents, *, params: Params):
    body = params.body
    params = params.replace(jvp_split=None)  # a combined equation differentiated again: an ordinary one
    ops, dots = body.operands(primals), body.operands(tangents)
    nz = dots.map(lambda t: type(t) is not ad.Zero)
    if not any(nz.flat()):
        out = bind(params, ops).flat()
        return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    # Per-chunk values (kept linearisations) are constants of one point: a pass that writes them, or
    # one that reads them, is not differentiated in them (its derivative would need the derivative of
    # JAX's linearisation residuals). Refused here, inside the rule, so that it holds under jax.jit.
    if body.out_avals.slots or any(nz.chunks):
        raise kept_refused(params)
    moving_rep, moving_ps = _where(nz.rep), _where(nz.samples)
    n_rep, n_ps = body.n_in

    def with_tangents(o: Operands, d: Operands) -> Operands:
        """The tangent pass's operands: ``o``, then ``d`` where the tangent is nonzero, per group."""
        return Operands(o.rep + _pick(d.rep, moving_rep), o.samples + _pick(d.samples, moving_ps), o.chunks)

    def jvp_of_body(o: Operands, w) -> tuple[Outputs, Outputs]:
        def h(rep, samples):
            at = Operands(_put(o.rep[:n_rep], moving_rep, rep), _put(o.samples[:n_ps], moving_ps, samples))
            return body(at._replace(chunks=o.chunks), w)

        primal = (_pick(o.rep, moving_rep), _pick(o.samples, moving_ps))
        return jax.jvp(h, primal, (o.rep[n_rep:], o.samples[n_ps:]))

    t_ops, avals = with_tangents(ops, dots), with_tangents(body.in_avals, body.in_avals)
    tangent = Params(
        body=trace(lambda o, w: jvp_of_body(o, w)[1], avals, body.w_aval),
        rep_layout=params.rep_layout + _pick(params.rep_layout, moving_rep),
        sum_layout=params.sum_layout,
        space=params.space,
        kept_note=params.kept_note,
    )
    # One bind for primal and tangent where the primal outputs are real. jax.checkpoint's partial
    # evaluation saves them (_partial_eval_custom_rule), and jax 0.10.2 cannot save a complex value
    # there (it inserts reduce_precision, which refuses complex dtypes): complex outputs take two
    # binds, the primal part then being recomputed as checkpoint asks. The combined pass saves one
    # forward pass in jax.jvp (docs/performance.md); jax.grad and jax.linearize split it again.
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in body.jaxpr.out_avals):
        return bind(params, ops).flat(), bind(tangent, t_ops).flat()
    split = JvpSplit(primal=params, tangent=tangent)

    def both(o, w):
        return split.join(*jvp_of_body(o, w))

    combined = Params(
        body=trace(both, avals, body.w_aval),
        rep_layout=tangent.rep_layout,
        sum_layout=params.sum_layout * 2,
        space=params.space,
        kept_note=params.kept_note,
        jvp_split=split,
    )
    primal_out, tangent_out = split.parts(bind(combined, t_ops))
    return primal_out.flat(), tangent_out.flat()


ad.primitive_jvps[chunked_p] = _jvp_rule


# --- partial evaluation: a combined equation with known primals splits into its two parts ---------


def _partial_eval_rule(trace, *tracers, params: Params):
    """``jax.linearize`` / ``jax.grad``: the primal part runs now, the tangent part is staged."""
    split = params.jvp_split
    ops = params.body.operands(tracers)
    if split is None or not split.splits(ops.map(lambda t: not t.pval.is_known())):
        return trace.default_process_primitive(chunked_p, tracers, {"params": params})
    known = split.primal_operands(ops).map(lambda t: t.pval.get_known())
    primal_out = bind(split.primal, known, place=False).map(trace.new_const)
    tangent_out = trace.default_process_primitive(chunked_p, tracers, {"params": split.tangent})
    return split.join(primal_out, split.tangent.body.outputs(tangent_out)).flat()


def _partial_eval_custom_rule(saveable, unks_in, inst_in, eqn):
    """The same split for ``jax.checkpoint``'s partial evaluation: the primal part is a known
    equation whose outputs are saved, the tangent part a staged one reading the primal operands."""
    params = eqn.params["params"]
    split, body = params.jvp_split, params.body
    residuals = [v for v, inst in zip(eqn.invars, inst_in) if isinstance(v, Var) and not inst]
    n_out = len(eqn.outvars)
    if split is None or not split.splits(body.operands(unks_in)):  # what JAX does without a rule
        if any(unks_in):
            return None, eqn, [True] * n_out, [True] * n_out, residuals
        if _saved(saveable, eqn):
            return eqn, None, [False] * n_out, [False] * n_out, []
        return eqn, eqn, [False] * n_out, [True] * n_out, residuals  # recomputed where it is needed
    invars, outvars = body.operands(eqn.invars), body.outputs(eqn.outvars)
    primal_vars, tangent_vars = split.parts(outvars)
    known = eqn.replace(
        invars=split.primal_operands(invars).flat(),
        outvars=primal_vars.flat(),
        params={"params": split.primal},
        effects=split.primal.body.jaxpr.effects,
    )
    staged = eqn.replace(
        outvars=tangent_vars.flat(),
        params={"params": split.tangent},
        effects=split.tangent.body.jaxpr.effects,
    )
    primal_out, tangent_out = split.parts(outvars.map(lambda _: True))
    unknown_out = split.join(primal_out.map(lambda _: False), tangent_out).flat()
    # the staged part reads the primal operands: those not already available there are residuals
    inst = body.operands(inst_in)
    residuals = [
        v
        for v, i in zip(split.primal_operands(invars).flat(), split.primal_operands(inst).flat())
        if isinstance(v, Var) and not i
    ]
    return known, staged, unknown_out, unknown_out, residuals


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


def _transpose_rule(cts, *args, params: Params):
    body = params.body
    ops, lin = body.operands(args), body.operands(args).map(ad.is_undefined_primal)
    ct_nz = body.outputs(cts).map(lambda c: type(c) is not ad.Zero)
    if body.out_avals.slots or any(lin.chunks):  # per-chunk values are never linear (see the jvp rule)
        raise kept_refused(params)
    cts = body.outputs(cts)
    lin_rep, lin_ps = _where(lin.rep), _where(lin.samples)
    const_rep, const_ps = _where(lin.rep, False), _where(lin.samples, False)
    ct_sum, ct_map = _where(ct_nz.sums), _where(ct_nz.maps)
    if not ct_sum and not ct_map:
        return [ad.Zero(a.aval.to_tangent_aval()) if is_lin else None for is_lin, a in zip(lin.flat(), args)]
    in_avals, out_avals = body.in_avals, body.out_avals

    def g_transpose(o: Operands, w) -> Outputs:
        # o: Operands(const rep + sum cotangents, const per-sample + map cotangents, per-chunk)
        c_rep, c_sum = o.rep[: len(const_rep)], o.rep[len(const_rep) :]
        c_ps, c_map = o.samples[: len(const_ps)], o.samples[len(const_ps) :]

        def linear(rep, samples):
            full = Operands(
                _put(_put(in_avals.rep, const_rep, c_rep), lin_rep, rep),
                _put(_put(in_avals.samples, const_ps, c_ps), lin_ps, samples),
                o.chunks,
            )
            return body(full, w)

        keep = lambda c: jnp.where(w.reshape(w.shape + (1,) * (c.ndim - 1)), c, jnp.zeros_like(c))
        zeros = out_avals.map(lambda a: jnp.zeros(a.shape, a.dtype))
        out_ct = Outputs(
            _put(zeros.sums, ct_sum, c_sum), _put(zeros.maps, ct_map, tuple(map(keep, c_map))), zeros.slots
        )
        struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
        lin_avals = (
            tuple(map(struct, _pick(in_avals.rep, lin_rep))),
            tuple(map(struct, _pick(in_avals.samples, lin_ps))),
        )
        rep_ct, ps_ct = jax.linear_transpose(linear, *lin_avals)(out_ct)
        return Outputs(tuple(rep_ct), tuple(ps_ct))

    avals = Operands(
        _pick(in_avals.rep, const_rep) + _pick(out_avals.sums, ct_sum),
        _pick(in_avals.samples, const_ps) + _pick(out_avals.maps, ct_map),
        in_avals.chunks,
    )
    transposed = Params(
        body=trace(g_transpose, avals, body.w_aval),
        rep_layout=_pick(params.rep_layout, const_rep) + _pick(params.sum_layout, ct_sum),
        sum_layout=_pick(params.rep_layout, lin_rep),
        space=params.space,
        kept_note=params.kept_note,
    )
    res = bind(
        transposed,
        Operands(
            _pick(ops.rep, const_rep) + _pick(cts.sums, ct_sum),
            _pick(ops.samples, const_ps) + _pick(cts.maps, ct_map),
            ops.chunks,
        ),
    )
    none = ops.map(lambda _: None)
    return Operands(
        _put(none.rep, lin_rep, res.sums), _put(none.samples, lin_ps, res.maps), none.chunks
    ).flat()


ad.primitive_transposes[chunked_p] = _transpose_rule


# --- vmap: CMR of the vmapped chunk function (replicated batch axis 0, per-sample axis 1) ---------


def _batch_rule(args, dims, *, params: Params):
    body, split = params.body, params.jvp_split
    ops, dims = body.operands(args), body.operands(dims)
    if split is not None and all(d is None for d in split.primal_operands(dims).flat()):
        # Batched tangents only (jax.jacfwd, jax.hessian): the primal part stays unbatched.
        primal_out = bind(split.primal, split.primal_operands(ops), place=False)
        t_out, t_dims = _batch_rule(args, dims.flat(), params=split.tangent)
        t_out, t_dims = split.tangent.body.outputs(t_out), split.tangent.body.outputs(t_dims)
        out = split.join(primal_out, t_out).flat()
        return out, split.join(primal_out.map(lambda _: None), t_dims).flat()
    size = next(a.shape[d] for a, d in zip(args, dims.flat()) if d is not None)
    # Where the batch axis goes: replicated operands on axis 0 (axis 0 in the body); per-sample ones
    # on axis 1 (axis 1 of the chunk: the sample axis stays first); per-chunk ones on axis 1 (axis 0
    # of the slot the body reads: the chunk axis stays first).
    outer, inner = Operands(0, 1, 1), Operands(0, 1, 0)

    def move(group: int):
        def one(a, d, aval):
            if d is None:
                return a, None, aval
            shape = list(aval.shape)
            shape.insert(inner[group], size)
            return (
                jnp.moveaxis(a, d, outer[group]),
                inner[group],
                jax.core.ShapedArray(tuple(shape), aval.dtype),
            )

        return list(zip(*map(one, ops[group], dims[group], body.in_avals[group]))) or [(), (), ()]

    moved, in_axes, avals = (Operands(*parts) for parts in zip(*map(move, range(3))))
    out_axes = Outputs(*((a,) * n for a, n in zip((0, 1, 0), map(len, body.out_avals))))
    batched = jax.vmap(body, in_axes=(in_axes, None), out_axes=out_axes)
    shift = lambda d, b: d if d is None or b is None else d + 1
    out = bind(
        Params(
            body=trace(batched, avals, body.w_aval),
            rep_layout=tuple(map(shift, params.rep_layout, in_axes.rep)),
            sum_layout=tuple(d if d is None else d + 1 for d in params.sum_layout),
            space=params.space,
            kept_note=params.kept_note,
        ),
        moved,
    )
    return out.flat(), Outputs(*((a,) * len(group) for a, group in zip((0, 1, 1), out))).flat()


batching.primitive_batchers[chunked_p] = _batch_rule
