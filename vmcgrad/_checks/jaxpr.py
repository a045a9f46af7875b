r"""Two properties of the user's function, read from its jaxpr (abstract: no FLOPs, no values).

Both analyses trace the tangent map of ``fun`` in the parameters,

.. math::

    t \mapsto \dot f(\theta, X)[t] = \frac{\partial f(\theta, X)}{\partial \theta}\, t ,

on an abstract batch :math:`X` of ``B`` rows (``jax.make_jaxpr`` of ``jax.jvp``), and follow its
data flow equation by equation, into ``jit``, ``scan``, ``while``, ``cond``, ``custom_jvp`` and
``checkpoint`` bodies. Only the *tangent* output is judged: a value under
``jax.lax.stop_gradient`` has no tangent, so a stop-gradient'ed batch statistic is not a coupling.

- :func:`row_coupling` — does row :math:`i` of the tangent depend on other rows than row
  :math:`i` of the samples? Every chunked estimator assumes it does not
  (:math:`\partial f(\theta, X)_i/\partial\theta = \partial f(\theta, \sigma_i)/\partial\theta`):
  it calls ``fun`` on chunks of rows, so a batch mean inside ``fun`` becomes a chunk mean. Each
  value carries where its sample axis is (as ``jax.vmap``'s batching rules do): a reduction, a
  cumulative op, a sort, an FFT or a contraction *over* that axis is a proven coupling. A known
  primitive used in a way the rules do not follow (a partial slice of the sample axis) makes the
  value *unknown*, which is not reported (a false alarm would block a correct model; a missed one
  is what the docstrings' contract covers). A primitive the analysis has *no rule* for is never
  passed silently (:func:`rows_verdict`, :func:`settle_rows`): on concrete inputs a numerical
  check on the first rows decides; on traced ones vmcgrad warns that it assumed row-wise.
- :func:`non_holomorphic_op` — for complex parameters: is the tangent map complex-linear
  (:math:`\dot f[i t] = i\, \dot f[t]`, the Cauchy–Riemann equations)? It is when no tangent
  value passes through ``conj``, ``real``, ``imag``, ``abs``, ``complex`` or a complex-to-real
  cast; the first such operation is returned. A holomorphic function written through them (e.g.
  ``log(sign) + logabsdet`` of ``slogdet``) is reported too: the caller then checks numerically.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmcgrad import _jax_private as jcore  # the JAX internals, checked at import

# --- the abstract batch -------------------------------------------------------------------------


def abstract_batch_size(*trees: Any) -> int:
    """A prime batch size ``B >= 7`` that is no dimension of any leaf of ``trees``.

    A prime that appears nowhere else keeps the sample axis distinguishable through reshapes.
    """
    dims = {int(d) for tree in trees for leaf in jax.tree.leaves(tree) for d in np.shape(leaf)}
    b = 7
    while b in dims or any(b % p == 0 for p in range(2, int(b**0.5) + 1)):
        b += 1
    return b


def _abstract(tree: Any, rows: int | None = None) -> Any:
    def one(x):
        shape = tuple(np.shape(x))
        if rows is not None:
            shape = (rows, *shape[1:])
        return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

    return jax.tree.map(one, tree)


def tangent_jaxpr(fun: Callable, params: Any, samples: Any, rows: int) -> jcore.ClosedJaxpr:
    """The jaxpr of ``(params, tangent, samples) -> jvp`` on ``rows`` abstract samples.

    Its inputs are the leaves of ``params``, then of the tangent, then of ``samples``; its one
    output is the tangent of ``fun(params, samples)``.
    """

    def tangent(p, t, x):
        return jax.jvp(lambda q: fun(q, x), (p,), (t,))[1]

    p = _abstract(params)
    return jax.make_jaxpr(tangent)(p, p, _abstract(samples, rows))


# --- row coupling ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rows:
    """A value carrying the sample axis at ``dim``; each row's ``block`` consecutive entries along
    ``dim`` belong to one sample (``block > 1`` after a reshape merged trailing axes into it)."""

    dim: int
    block: int = 1


@dataclasses.dataclass(frozen=True)
class Mixed:
    """A value that combines several samples' rows: ``how`` says which operation did it."""

    how: str


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A value the analysis cannot judge. ``primitives`` names the primitives it has no rule for
    that made it so; empty when a known primitive is used in a way the rules do not follow (a
    partial slice of the sample axis), which is not reported (see :func:`row_coupling`)."""

    primitives: frozenset = frozenset()


ROW = "row"  # inside a loop over the samples: depends on the current sample only
UNKNOWN = Unknown()  # not judged
# None: independent of the samples


def _unknown(*states: Any) -> Unknown:
    """UNKNOWN, carrying the unknown primitives of ``states``."""
    return Unknown(frozenset().union(*(s.primitives for s in states if isinstance(s, Unknown))))


def _join(a: Any, b: Any) -> Any:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if isinstance(a, Mixed):
        return a
    if isinstance(b, Mixed):
        return b
    return _unknown(a, b)


_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz
    complex conj convert_element_type copy cos cosh device_put digamma div eq erf erf_inv erfc exp
    exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le lgamma log
    log1p logistic lt max min mul ne neg nextafter not optimization_barrier or polygamma
    population_count pow real reduce_precision regularized_incomplete_beta rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
    sub tan tanh threefry2x32 xor zeta sharding_constraint reshard pvary bitcast_convert_type
    add_any""".split()
)
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
_LINALG = frozenset(
    "cholesky lu eigh eig svd qr geqrf geqp3 householder_product schur hessenberg tridiagonal".split()
)


def _shape(v: Any) -> tuple:
    return tuple(v.aval.shape) if hasattr(v.aval, "shape") else ()


def row_coupling(jaxpr: jcore.ClosedJaxpr, n_unbatched: int) -> str | None:
    """How the output of ``jaxpr`` couples the rows of its last inputs (all with the sample axis
    first), or None when it provably does not, or the analysis cannot tell (see
    :func:`row_state` for which).

    Args:
        jaxpr: from :func:`tangent_jaxpr`.
        n_unbatched: how many leading inputs (parameters and tangent) carry no sample axis.
    """
    out = row_state(jaxpr, n_unbatched)
    return out.how if isinstance(out, Mixed) else None


def row_state(jaxpr: jcore.ClosedJaxpr, n_unbatched: int) -> Any:
    """The state of the output of ``jaxpr`` (arguments as :func:`row_coupling`'s): ``Mixed`` (a
    proven coupling), ``Rows`` or None (provably none), ``ROW``, or ``Unknown``, whose
    ``primitives`` name the primitives without a rule on the way to the output."""
    n_in = len(jaxpr.jaxpr.invars)
    states = [None] * n_unbatched + [Rows(0)] * (n_in - n_unbatched)
    (out,) = _batch_jaxpr(jaxpr.jaxpr, [None] * len(jaxpr.jaxpr.constvars), states)
    return out


def _batch_jaxpr(jaxpr: jcore.Jaxpr, const_states: Sequence, in_states: Sequence) -> list:
    env: dict = {}
    for v, s in zip(jaxpr.constvars, const_states):
        env[v] = s
    for v, s in zip(jaxpr.invars, in_states):
        env[v] = s

    def read(v):
        return None if isinstance(v, jcore.Literal) else env.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _batch_eqn(eqn, ins)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _closed(j: Any) -> tuple[jcore.Jaxpr, list]:
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, [None] * len(j.jaxpr.constvars)
    return j, [None] * len(j.constvars)


def _call(j: Any, ins: Sequence) -> list:
    jaxpr, consts = _closed(j)
    return _batch_jaxpr(jaxpr, consts, ins)


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _batch_eqn(eqn: Any, ins: list) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    # higher-order primitives: follow each input into the body, so that a coupled value that does
    # not reach an output (a stop-gradient'ed statistic in a jit) does not taint the others
    if name == "scan":
        return _batch_scan(eqn, ins)
    if name == "while":
        return _batch_while(eqn, ins)
    if name == "cond":
        return _batch_cond(eqn, ins)
    for key in _CALL_PARAMS:
        if key in eqn.params and isinstance(eqn.params[key], (jcore.Jaxpr, jcore.ClosedJaxpr)):
            body = eqn.params[key]
            if len(_closed(body)[0].invars) == len(ins):
                return _call(body, ins)
    mixed = next((s for s in ins if isinstance(s, Mixed)), None)
    if mixed is not None:
        return [mixed] * n_out
    if all(s is None for s in ins):
        return [None] * n_out
    if any(isinstance(s, Unknown) for s in ins):
        return [_unknown(*ins)] * n_out
    if any(isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr)) for p in eqn.params.values()):
        return [Unknown(frozenset({name}))] * n_out  # a body the analysis does not follow
    if any(s == ROW for s in ins):
        return [ROW if not any(isinstance(s, Rows) for s in ins) else UNKNOWN] * n_out
    rule = _RULES.get(name)
    if rule is None:
        if name in _ELEMENTWISE:
            return _elementwise(eqn, ins)
        return [Unknown(frozenset({name}))] * n_out  # no rule: reported (rows_verdict)
    out = rule(eqn, ins)
    return out if isinstance(out, list) else [out] * n_out


def _elementwise(eqn: Any, ins: list) -> list:
    """Operands of the output's rank (size-1 axes broadcast) or scalars: a sample axis stays put."""
    batched = {s for s in ins if isinstance(s, Rows)}
    if len(batched) != 1:
        return [UNKNOWN] * len(eqn.outvars)
    (s,) = batched
    out_shapes = {_shape(v) for v in eqn.outvars}
    shapes = [_shape(v) for v, st in zip(eqn.invars, ins) if st == s]
    ok = len(out_shapes) == 1 and all(
        len(shape) == len(out) and shape[s.dim] == out[s.dim] for shape in shapes for out in out_shapes
    )
    return [s if ok else UNKNOWN] * len(eqn.outvars)


def _only(ins: list, i: int = 0) -> Any:
    """The state of input ``i`` when every other input is sample-independent, else UNKNOWN."""
    others = [s for j, s in enumerate(ins) if j != i]
    return ins[i] if all(s is None for s in others) and isinstance(ins[i], Rows) else UNKNOWN


def _reduce(eqn, ins):
    s = (
        _only(ins)
        if eqn.primitive.name != "reduce"
        else _same_rows(ins[: len(ins) // 2], ins[len(ins) // 2 :])
    )
    if not isinstance(s, Rows):
        return UNKNOWN
    axes = tuple(eqn.params.get("axes", eqn.params.get("dimensions", ())))
    if s.dim in axes:
        return Mixed(f"`{eqn.primitive.name}` over the sample axis")
    return Rows(s.dim - sum(a < s.dim for a in axes), s.block)


def _same_rows(batched: list, constant: list) -> Any:
    states = {s for s in batched if s is not None}
    if len(states) != 1 or any(s is not None for s in constant):
        return UNKNOWN
    (s,) = states
    return s if isinstance(s, Rows) else UNKNOWN


def _cumulative(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    if eqn.params["axis"] == s.dim:
        return Mixed(f"`{eqn.primitive.name}` along the sample axis")
    return s


def _sort(eqn, ins):
    s = _same_rows(ins, [])
    if not isinstance(s, Rows):
        states = {x for x in ins if x is not None}
        s = states.pop() if len(states) == 1 else UNKNOWN
    if not isinstance(s, Rows):
        return UNKNOWN
    if eqn.params["dimension"] == s.dim:
        return Mixed("`sort` along the sample axis")
    return s


def _top_k(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    if s.dim == len(_shape(eqn.invars[0])) - 1:
        return Mixed("`top_k` along the sample axis")
    return s


def _fft(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    nd = len(_shape(eqn.invars[0]))
    if s.dim >= nd - len(eqn.params["fft_lengths"]):
        return Mixed("`fft` along the sample axis")
    return s


def _broadcast_in_dim(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    return Rows(eqn.params["broadcast_dimensions"][s.dim], s.block)


def _tile(eqn, ins):
    """``tile[reps]`` (reps aligned with the operand's axes): other axes tiled keep the rows; a
    sample axis tiled repeats them, which the later operations may or may not undo (a slice of the
    first copy is row-wise, a shifted slice is not): not followed, the numerical check decides."""
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    if tuple(eqn.params["reps"])[s.dim] != 1:
        return Unknown(frozenset({"tile along the sample axis"}))
    return s


def _transpose(eqn, ins):
    s = ins[0]
    return Rows(tuple(eqn.params["permutation"]).index(s.dim), s.block)


def _squeeze(eqn, ins):
    s = ins[0]
    dims = tuple(eqn.params["dimensions"])
    if s.dim in dims:
        return UNKNOWN
    return Rows(s.dim - sum(d < s.dim for d in dims), s.block)


def _reshape(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows) or eqn.params.get("dimensions") is not None:
        return UNKNOWN
    old, new = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    rows = old[s.dim] // s.block
    pre = int(np.prod(old[: s.dim], dtype=np.int64))
    acc = 1
    for j, size in enumerate(new):
        if acc == pre and size % rows == 0 and size > 1:
            return Rows(j, size // rows)
        acc *= size
        if acc > pre:
            break
    return UNKNOWN


def _slice(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    size = _shape(eqn.invars[0])[s.dim]
    strides = eqn.params.get("strides") or (1,) * len(_shape(eqn.invars[0]))
    full = eqn.params["start_indices"][s.dim] == 0 and eqn.params["limit_indices"][s.dim] == size
    return s if full and strides[s.dim] == 1 else UNKNOWN


def _dynamic_slice(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    full = eqn.params["slice_sizes"][s.dim] == _shape(eqn.invars[0])[s.dim]
    return s if full else UNKNOWN


def _dynamic_update_slice(eqn, ins):
    op, upd, idx = ins[0], ins[1], ins[2:]
    if any(s is not None for s in idx):
        return UNKNOWN
    states = {x for x in (op, upd) if x is not None}
    if len(states) != 1:
        return UNKNOWN
    (s,) = states
    if upd is not None and _shape(eqn.invars[1])[s.dim] != _shape(eqn.invars[0])[s.dim]:
        return UNKNOWN
    return s


def _split_concat_axis(eqn, ins, key):
    states = {x for x in ins if x is not None}
    if len(states) != 1:
        return UNKNOWN
    (s,) = states
    if not isinstance(s, Rows) or eqn.params[key] == s.dim:
        return UNKNOWN
    return s


def _pad(eqn, ins):
    s = _only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    return s if tuple(eqn.params["padding_config"][s.dim]) == (0, 0, 0) else UNKNOWN


def _rev(eqn, ins):
    s = ins[0]
    return UNKNOWN if s.dim in tuple(eqn.params["dimensions"]) else s


def _dot_general(eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    l_free = [d for d in range(nl) if d not in lc and d not in lb]
    r_free = [d for d in range(nr) if d not in rc and d not in rb]
    if (isinstance(lhs, Rows) and lhs.dim in lc) or (isinstance(rhs, Rows) and rhs.dim in rc):
        return Mixed("a contraction (`dot_general`) over the sample axis")
    if isinstance(lhs, Rows) and isinstance(rhs, Rows):
        if (
            lhs.dim in lb
            and rhs.dim in rb
            and lb.index(lhs.dim) == rb.index(rhs.dim)
            and lhs.block == rhs.block
        ):
            return Rows(list(lb).index(lhs.dim), lhs.block)
        return UNKNOWN
    if isinstance(lhs, Rows):
        if lhs.dim in lb:
            return Rows(list(lb).index(lhs.dim), lhs.block)
        return Rows(len(lb) + l_free.index(lhs.dim), lhs.block)
    if rhs.dim in rb:
        return Rows(list(rb).index(rhs.dim), rhs.block)
    return Rows(len(lb) + len(l_free) + r_free.index(rhs.dim), rhs.block)


def _conv(eqn, ins):
    lhs, rhs = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    if rhs is not None or not isinstance(lhs, Rows) or lhs.block != 1:
        return UNKNOWN
    if eqn.params.get("batch_group_count", 1) != 1 or lhs.dim != dn.lhs_spec[0]:
        return UNKNOWN
    return Rows(dn.out_spec[0])


def _gather(eqn, ins):
    op, idx = ins
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_rank = len(_shape(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]  # one per index dim but the last
    if isinstance(op, Rows) and idx is None:
        d = op.dim
        if d in dn.start_index_map or d in dn.collapsed_slice_dims or d in dn.operand_batching_dims:
            return UNKNOWN
        if eqn.params["slice_sizes"][d] != op_shape[d]:
            return UNKNOWN
        window = [
            k
            for k in range(len(op_shape))
            if k not in dn.collapsed_slice_dims and k not in dn.operand_batching_dims
        ]
        return Rows(dn.offset_dims[window.index(d)], op.block)
    if isinstance(idx, Rows):
        if idx.dim == len(idx_shape) - 1 or idx.block != 1:
            return UNKNOWN
        if isinstance(op, Rows):
            pairs = list(zip(dn.operand_batching_dims, dn.start_indices_batching_dims))
            if (op.dim, idx.dim) not in pairs or op.block != 1:
                return UNKNOWN
        return Rows(batch_out[idx.dim])
    return UNKNOWN


def _triangular_solve(eqn, ins):
    a, b = ins
    nd = len(_shape(eqn.invars[1]))
    states = {x for x in (a, b) if x is not None}
    if len(states) != 1:
        return UNKNOWN
    (s,) = states
    if s.block != 1:
        return UNKNOWN
    if s.dim < nd - 2:
        return s
    if a is None and s.dim == (nd - 1 if eqn.params["left_side"] else nd - 2):
        return s
    return UNKNOWN


def _linalg(eqn, ins):
    states = {x for x in ins if x is not None}
    if len(states) != 1:
        return [UNKNOWN] * len(eqn.outvars)
    (s,) = states
    nd = len(_shape(eqn.invars[0]))
    ok = isinstance(s, Rows) and s.block == 1 and s.dim < nd - 2
    return [s if ok else UNKNOWN] * len(eqn.outvars)


def _pivots(eqn, ins):
    s = ins[0]
    ok = s.block == 1 and s.dim < len(_shape(eqn.invars[0])) - 1
    return s if ok else UNKNOWN


_RULES: dict[str, Callable] = {
    **dict.fromkeys(_REDUCTIONS | {"reduce"}, _reduce),
    **dict.fromkeys(_CUMULATIVE, _cumulative),
    **dict.fromkeys(_LINALG, _linalg),
    "sort": _sort,
    "top_k": _top_k,
    "fft": _fft,
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "tile": _tile,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": lambda e, i: _split_concat_axis(e, i, "dimension"),
    "split": lambda e, i: _split_concat_axis(e, i, "axis"),
    "pad": _pad,
    "rev": _rev,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "triangular_solve": _triangular_solve,
    "lu_pivots_to_permutation": _pivots,
    "iota": lambda e, i: None,
}


def _batch_scan(eqn, ins):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]

    def slice_x(s):
        if isinstance(s, Rows):
            return (
                ROW if s.dim == 0 and s.block == 1 else (Rows(s.dim - 1, s.block) if s.dim > 0 else UNKNOWN)
            )
        return s

    body_xs = [slice_x(s) for s in xs]
    for _ in range(len(carry) + 2):
        outs = _call(p["jaxpr"], list(consts) + list(carry) + body_xs)
        new = [_join(c, o) for c, o in zip(carry, outs[:nk])]
        if new == list(carry):
            break
        carry = new
    else:
        carry = [s if s is None or isinstance(s, (Mixed, Unknown)) else UNKNOWN for s in carry]
        outs = _call(p["jaxpr"], list(consts) + list(carry) + body_xs)

    carried = Mixed("a loop (`scan`) over the samples that carries a value from one to the next")
    if any(s == ROW for s in carry):  # outputs that read such a carry depend on earlier samples
        outs = _call(p["jaxpr"], list(consts) + [carried if s == ROW else s for s in carry] + body_xs)

    def carry_out(s):
        return carried if s == ROW else s

    def stack(s):
        if s == ROW:
            return Rows(0)
        return Rows(s.dim + 1, s.block) if isinstance(s, Rows) else s

    return [carry_out(s) for s in carry] + [stack(s) for s in outs[nk:]]


def _batch_while(eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], list(ins[cn + bn :])
    for _ in range(len(carry) + 2):
        outs = _call(p["body_jaxpr"], list(bconsts) + carry)
        new = [_join(c, o) for c, o in zip(carry, outs)]
        if new == carry:
            break
        carry = new
    else:
        carry = [s if s is None or isinstance(s, (Mixed, Unknown)) else UNKNOWN for s in carry]
    (pred,) = _call(p["cond_jaxpr"], list(cconsts) + carry)
    return _guarded(pred, carry)


def _guarded(pred: Any, outs: list) -> list:
    """Outputs of a loop or branch whose control depends on ``pred``. Inside a loop over the
    samples (``pred`` is ROW) they depend on the current sample. A batch-wide predicate (an input
    check such as ``any(x < 0)`` guarding an error branch) is not reported: control dependence is
    not followed, only data flow."""
    if pred == ROW:
        return [ROW if s is None else (UNKNOWN if isinstance(s, Rows) else s) for s in outs]
    return outs


def _batch_cond(eqn, ins):
    index, ops = ins[0], ins[1:]
    outs = None
    for branch in eqn.params["branches"]:
        b = _call(branch, ops)
        outs = b if outs is None else [_join(x, y) for x, y in zip(outs, b)]
    return _guarded(index, outs)


# --- what no rule decides: a numerical check on concrete rows, else a warning -------------------


@dataclasses.dataclass(frozen=True)
class Unjudged:
    """The analysis could not judge the output: the ``primitives`` it has no rule for reached it,
    or the analysis itself failed on this JAX's jaxpr (``failure``)."""

    primitives: tuple[str, ...] = ()
    failure: str = ""

    def what(self) -> str:
        if not self.primitives:
            return f"an equation the analysis failed on ({self.failure})"
        names = ", ".join(f"`{p}`" for p in self.primitives)
        return f"the JAX primitive{'s' if len(self.primitives) > 1 else ''} {names}"


def rows_verdict(fun: Callable, params: Any, samples: Any) -> str | Unjudged | None:
    """The abstract verdict of :func:`row_coupling` on ``fun``'s tangent map: how it couples the
    rows (a string), None (it provably does not, or a known primitive is used in a way the rules
    do not follow, or ``fun`` cannot be traced abstractly), or :class:`Unjudged` when a primitive
    without a rule (or a failure of the analysis) decides the output: see :func:`settle_rows`."""
    n_params = len(jax.tree.leaves(params))

    def analysis(jaxpr):
        try:
            return row_state(jaxpr, 2 * n_params)
        except Exception as err:  # a rule that does not fit this JAX's jaxprs: not silent either
            return Unjudged(failure=f"{type(err).__name__}: {err}")

    state = analyse(fun, params, samples, analysis)
    if isinstance(state, Mixed):
        return state.how
    if isinstance(state, Unknown) and state.primitives:
        return Unjudged(tuple(sorted(state.primitives)))
    return state if isinstance(state, Unjudged) else None


@dataclasses.dataclass(frozen=True)
class Unsettled:
    """The numerical check could not decide (``reason``)."""

    reason: str


_CHECK_ROWS = 8  # the rows the numerical check evaluates (as the holomorphy check's)


def settle_rows(
    where: str, arg: str, fun: Callable, params: Any, samples: Any, unjudged: Unjudged
) -> str | None:
    """The conservative answer for what :func:`rows_verdict` left :class:`Unjudged`.

    On concrete inputs, :func:`numerical_row_coupling` decides: how the rows are coupled, or None
    (a decided answer is remembered for ``fun`` and the input shapes, so that later traced calls
    use it). Otherwise (traced inputs inside ``jax.jit``, samples over several processes, a check
    that cannot run) vmcgrad assumes the rows are independent and says so with an
    :class:`~vmcgrad._warnings.UnknownPrimitiveWarning` that names the primitive, the assumption,
    and how to decide or silence it.
    """
    key = signature_key("rows-numeric", fun, params, samples)
    decided = recall(key)
    if decided is not _MISSING:
        return decided
    reason = _not_concrete(fun, params, samples)
    result = Unsettled(reason) if reason else numerical_row_coupling(fun, params, samples, unjudged)
    if not isinstance(result, Unsettled):
        remember(key, result)
        return result
    import warnings

    from vmcgrad._warnings import UnknownPrimitiveWarning, stacklevel_outside_package

    head = f"vmcgrad: no row-coupling rule for {unjudged.what()}"
    warnings.warn(
        f"{head}, which the derivative of `{arg}(params, samples)` passes through ({where}), and "
        f"no numerical check could decide: {result.reason}. vmcgrad assumed that row i of "
        f"`{arg}(params, samples)` depends on sample i only, as its chunks require; if it "
        "combines samples (a batch statistic without jax.lax.stop_gradient), the result is wrong "
        f"and depends on chunk_size. To decide it: call {where} once with concrete (not traced) "
        f"params and samples, outside jax.jit; a check on the first {_CHECK_ROWS} samples then "
        "runs, and its answer is kept for this function and these shapes. To silence this "
        f'warning: warnings.filterwarnings("ignore", message=r"{_literal(head)}", '
        "category=vmcgrad.VmcgradWarning).",
        UnknownPrimitiveWarning,
        stacklevel=stacklevel_outside_package(),
    )
    return None


def _literal(text: str) -> str:
    """``text`` as a regular expression that matches it (its metacharacters escaped)."""
    return re.sub(r"[.^$*+?{}\[\]\\|()]", r"\\\g<0>", text)


_TRACED = "its inputs are traced (the call is inside jax.jit, jax.vmap or a derivative)"


def _not_concrete(fun: Callable, params: Any, samples: Any) -> str:
    """Why ``fun`` cannot be evaluated on these inputs now ("" if it can)."""
    from vmcgrad._problem.function import split_fun

    leaves = jax.tree.leaves((params, samples, split_fun(fun)[1]))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return _TRACED
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return "the samples span several processes"
    return ""


def _copies(rows: Any, j: int, m: int) -> Any:
    """The batch of ``m`` copies of row ``j`` of ``rows``."""
    return jax.tree.map(lambda x: x[j : j + 1].repeat(m, 0), rows)


def numerical_row_coupling(
    fun: Callable, params: Any, samples: Any, unjudged: Unjudged
) -> str | Unsettled | None:
    r"""How ``fun``'s rows are coupled, measured on its first rows, or None, or :class:`Unsettled`.

    With a random parameter direction :math:`t` and the first :math:`m \le 8` samples
    :math:`X = (\sigma_1 \dots \sigma_m)`, a ``fun`` whose row :math:`i` depends on sample
    :math:`i` only has :math:`\dot f(\theta, X)[t]_j = \dot f(\theta, (\sigma_j, \dots,
    \sigma_j))[t]_i` for every :math:`i, j`: the batch of :math:`m` copies of :math:`\sigma_j` is
    row-wise the same computation (one compiled program, one batch shape). A batch statistic (a
    mean, max, sort or cumulative sum over the rows) or a dependence on the row's position breaks
    it. Coupled when a difference exceeds :math:`\sqrt{\epsilon}\max_j |\dot f(\theta, X)[t]_j|`
    (rounding is far below it, a statistic over :math:`m` rows far above), or when a copy is not
    finite where the row is. A pass is evidence on these rows, not a proof.
    """
    leaves = jax.tree.leaves(samples)
    m = min(int(leaves[0].shape[0]), _CHECK_ROWS)
    with jax.ensure_compile_time_eval():  # a slice of concrete arrays, also under the user's jit
        rows = jax.tree.map(lambda x: np.asarray(x[:m]), samples)
    if all(np.array_equal(x, x[:1].repeat(m, 0)) for x in jax.tree.leaves(rows)):
        return Unsettled(f"the first {m} samples are all equal, which no check can separate")
    rng = np.random.default_rng(0)  # on the host: jax.random would compile once per leaf shape

    def normal(p):
        x = rng.standard_normal(p.shape)
        if jnp.issubdtype(p.dtype, jnp.complexfloating):
            x = x + 1j * rng.standard_normal(p.shape)
        return x.astype(p.dtype)

    t = jax.tree.map(normal, params)
    tangent = jax.jit(lambda p, t, x: jax.jvp(lambda q: fun(q, x), (p,), (t,))[1])
    try:
        full = tangent(params, t, rows)
        if isinstance(full, jax.core.Tracer):  # fun closes over a traced value: staged, not run
            return Unsettled(_TRACED)
        copies = [tangent(params, t, _copies(rows, j, m)) for j in range(m)]
        full, copies = np.asarray(full), np.stack([np.asarray(c) for c in copies])
    except Exception as err:  # fun fails on m rows, a primitive without an implementation, ...
        return Unsettled(f"evaluating it on {m} samples failed ({type(err).__name__}: {err})")
    finite = np.isfinite(full)
    if not finite.any():
        return Unsettled(f"its derivative is not finite on the first {m} samples")
    scale = float(np.abs(full[finite]).max())
    dev = np.abs(copies - full[:, None])  # dev[j, i]: row i of the copies of sample j against row j
    dev = np.where(np.isfinite(dev), dev, np.inf)[finite]
    j, i = np.unravel_index(int(np.argmax(dev)), dev.shape)
    if not dev[j, i] > np.sqrt(np.finfo(full.dtype).eps) * scale:
        return None
    j = int(np.flatnonzero(finite)[j])
    return (
        f"{unjudged.what()}, which vmcgrad's analysis has no rule for: a numerical check on the "
        f"first {m} samples, along a random parameter direction, found that row {j}'s derivative "
        f"changes by {float(dev.max()) / max(scale, np.finfo(full.dtype).tiny):.1%} of the largest "
        f"row's when the other rows are replaced by copies of sample {j}"
    )


# --- complex linearity of the tangent map --------------------------------------------------------

_NOT_C_LINEAR = frozenset("conj real imag abs complex sign".split())


def primitive_names() -> frozenset[str]:
    """Every primitive name the two analyses match by string (their tables as they are now); the
    tests check each against the installed JAX (:func:`vmcgrad._jax_private.missing_primitives`)."""
    return frozenset(
        _ELEMENTWISE | _RULES.keys() | _NOT_C_LINEAR | {"scan", "while", "cond", "convert_element_type"}
    )


def non_holomorphic_op(jaxpr: jcore.ClosedJaxpr, n_params: int) -> str | None:
    """The first operation a tangent value passes through on its way to the output that is not
    complex-linear (``conj``, ``real``, ``imag``, ``abs``, ``complex``, a complex-to-real cast, or
    a primitive with a body the analysis does not follow), or None: the tangent map is
    complex-linear. Tangent values that do not reach the output (``real(t)`` feeding a ``signbit``,
    as in NetKet's ``log_cosh``) do not count.

    Args:
        jaxpr: from :func:`tangent_jaxpr`.
        n_params: the number of parameter leaves (the tangent leaves follow them).
    """
    n_in = len(jaxpr.jaxpr.invars)
    states = [None] * n_params + [True] * n_params + [None] * (n_in - 2 * n_params)
    (out,) = _linear_jaxpr(jaxpr.jaxpr, states)
    return out if isinstance(out, str) else None


# a value's state: None (no tangent), True (a complex-linear function of the tangent), or a string
# naming the first non-complex-linear operation on its way from the tangent


def _lin_join(a: Any, b: Any) -> Any:
    if isinstance(a, str):
        return a
    if isinstance(b, str):
        return b
    return a or b or None


def _linear_jaxpr(jaxpr: jcore.Jaxpr, in_states: Sequence) -> list:
    env = dict(zip(jaxpr.invars, in_states))

    def read(v):
        return None if isinstance(v, jcore.Literal) else env.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _linear_eqn(eqn, ins) if any(s is not None for s in ins) else [None] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _is_complex_var(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.complexfloating)


def _fixpoint(body: Callable, carry: list) -> list:
    for _ in range(len(carry) + 2):
        outs = body(carry)
        new = [_lin_join(a, b) for a, b in zip(carry, outs)]
        if new == carry:
            return outs
        carry = new
    return body(carry)


def _linear_eqn(eqn: Any, ins: list) -> list:
    name, p = eqn.primitive.name, eqn.params
    n_out = len(eqn.outvars)
    if name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        body = _closed(p["jaxpr"])[0]
        consts, xs = ins[:nc], ins[nc + nk :]
        last: list = []

        def step(carry):
            last[:] = _linear_jaxpr(body, consts + carry + xs)
            return last[:nk]

        carry = _fixpoint(step, list(ins[nc : nc + nk]))
        return [_lin_join(a, b) for a, b in zip(carry, last[:nk])] + last[nk:]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        body = _closed(p["body_jaxpr"])[0]
        return _fixpoint(lambda carry: _linear_jaxpr(body, ins[cn : cn + bn] + carry), list(ins[cn + bn :]))
    if name == "cond":
        outs: list = [None] * n_out
        for branch in p["branches"]:
            outs = [_lin_join(a, b) for a, b in zip(outs, _linear_jaxpr(_closed(branch)[0], ins[1:]))]
        return outs
    for key in _CALL_PARAMS:
        body = p.get(key)
        if isinstance(body, (jcore.Jaxpr, jcore.ClosedJaxpr)) and len(_closed(body)[0].invars) == len(ins):
            return _linear_jaxpr(_closed(body)[0], ins)
    first = next((s for s in ins if isinstance(s, str)), None)
    if first is not None:
        return [first] * n_out
    if any(isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr)) for x in p.values()):
        return [f"`{name}` (a primitive with a body the check does not follow)"] * n_out
    tangent_in = [v for v, s in zip(eqn.invars, ins) if s is not None]
    if name in ("conj", "real", "imag", "abs", "sign") and any(_is_complex_var(v) for v in tangent_in):
        return [f"`{name}`"] * n_out
    if name == "complex":
        return ["`complex`"] * n_out
    if (
        name == "convert_element_type"
        and _is_complex_var(eqn.invars[0])
        and not _is_complex_var(eqn.outvars[0])
    ):
        return ["a complex-to-real `convert_element_type`"] * n_out
    return [True] * n_out


# --- once per signature -----------------------------------------------------------------------------

# imported here, with the cache it serves (the analyses above need nothing of it)
from vmcgrad._cache import Cache  # noqa: E402

_CACHE_SIZE = 512
#: The analyses' verdicts per function and input signature (:func:`signature_key`).
_CACHE = Cache(maxsize=_CACHE_SIZE, name="jaxpr analyses per function and input signature")


def _avals(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def signature_key(kind: str, fun: Callable, params: Any, samples: Any) -> Any:
    """The cache key of ``kind`` for ``fun`` (:func:`vmcgrad._problem.function.cache_key`: held weakly
    where it can be) and the shapes and dtypes of ``fun``'s arrays, ``params`` and ``samples``;
    None if unhashable."""
    from vmcgrad._problem.function import split_fun

    _, data = split_fun(fun)
    return Cache.key(fun, kind, _avals(data), _avals(params), _avals(samples))


_MISSING = object()


def recall(key: Any) -> Any:
    """The value remembered for ``key``, or ``_MISSING``."""
    return _CACHE.get(key, _MISSING)


def remember(key: Any, value: Any) -> None:
    _CACHE[key] = value


def once_per_signature(kind: str, fun: Callable, params: Any, samples: Any, compute: Callable) -> Any:
    """``compute()``, remembered per :func:`signature_key` (a ``fun`` that cannot be hashed is
    analysed at every call; the estimator then refuses it)."""
    key = signature_key(kind, fun, params, samples)
    value = recall(key)
    if value is _MISSING:
        value = compute()
        remember(key, value)
    return value


def analyse(fun: Callable, params: Any, samples: Any, analysis: Callable) -> Any:
    """``analysis(jaxpr)`` of ``fun``'s tangent map on an abstract batch, or None when ``fun`` cannot
    be traced on it (an error of ``fun`` itself surfaces where the estimator traces it)."""
    rows = abstract_batch_size(params, samples)
    try:
        return analysis(tangent_jaxpr(fun, params, samples, rows))
    except Exception:
        return None  # do not expect: no verdict (an error of fun surfaces where the estimator traces it)
