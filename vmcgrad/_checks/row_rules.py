r"""The row-coupling analysis' value states and its rules per JAX primitive.

A value's state says where its sample axis is (:class:`Rows`), that it mixes samples
(:class:`Mixed`), that it is independent of them (None), or that the analysis cannot judge it
(:class:`Unknown`). A rule maps the states of an equation's inputs to its outputs' states, as
``jax.vmap``'s batching rules map batch dimensions; the interpreter that applies them is
:mod:`vmcgrad._checks.row_coupling`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


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


def unknown_of(*states: Any) -> Unknown:
    """UNKNOWN, carrying the unknown primitives of ``states``."""
    return Unknown(frozenset().union(*(s.primitives for s in states if isinstance(s, Unknown))))


def join(a: Any, b: Any) -> Any:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if isinstance(a, Mixed):
        return a
    if isinstance(b, Mixed):
        return b
    return unknown_of(a, b)


ELEMENTWISE = frozenset(
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


def shape_of(v: Any) -> tuple:
    return tuple(v.aval.shape) if hasattr(v.aval, "shape") else ()


def elementwise(eqn: Any, ins: list) -> list:
    """Operands of the output's rank (size-1 axes broadcast) or scalars: a sample axis stays put."""
    batched = {s for s in ins if isinstance(s, Rows)}
    if len(batched) != 1:
        return [UNKNOWN] * len(eqn.outvars)
    (s,) = batched
    out_shapes = {shape_of(v) for v in eqn.outvars}
    shapes = [shape_of(v) for v, st in zip(eqn.invars, ins) if st == s]
    ok = len(out_shapes) == 1 and all(
        len(shape) == len(out) and shape[s.dim] == out[s.dim] for shape in shapes for out in out_shapes
    )
    return [s if ok else UNKNOWN] * len(eqn.outvars)


def only(ins: list, i: int = 0) -> Any:
    """The state of input ``i`` when every other input is sample-independent, else UNKNOWN."""
    others = [s for j, s in enumerate(ins) if j != i]
    return ins[i] if all(s is None for s in others) and isinstance(ins[i], Rows) else UNKNOWN


def _reduce(eqn, ins):
    s = (
        only(ins)
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
    s = only(ins)
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
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    if s.dim == len(shape_of(eqn.invars[0])) - 1:
        return Mixed("`top_k` along the sample axis")
    return s


def _fft(eqn, ins):
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    nd = len(shape_of(eqn.invars[0]))
    if s.dim >= nd - len(eqn.params["fft_lengths"]):
        return Mixed("`fft` along the sample axis")
    return s


def _broadcast_in_dim(eqn, ins):
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    return Rows(eqn.params["broadcast_dimensions"][s.dim], s.block)


def _tile(eqn, ins):
    """``tile[reps]`` (reps aligned with the operand's axes): other axes tiled keep the rows; a
    sample axis tiled repeats them, which the later operations may or may not undo (a slice of the
    first copy is row-wise, a shifted slice is not): not followed, the numerical check decides."""
    s = only(ins)
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
    s = only(ins)
    if not isinstance(s, Rows) or eqn.params.get("dimensions") is not None:
        return UNKNOWN
    old, new = shape_of(eqn.invars[0]), tuple(eqn.params["new_sizes"])
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
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    size = shape_of(eqn.invars[0])[s.dim]
    strides = eqn.params.get("strides") or (1,) * len(shape_of(eqn.invars[0]))
    full = eqn.params["start_indices"][s.dim] == 0 and eqn.params["limit_indices"][s.dim] == size
    return s if full and strides[s.dim] == 1 else UNKNOWN


def _dynamic_slice(eqn, ins):
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    full = eqn.params["slice_sizes"][s.dim] == shape_of(eqn.invars[0])[s.dim]
    return s if full else UNKNOWN


def _dynamic_update_slice(eqn, ins):
    op, upd, idx = ins[0], ins[1], ins[2:]
    if any(s is not None for s in idx):
        return UNKNOWN
    states = {x for x in (op, upd) if x is not None}
    if len(states) != 1:
        return UNKNOWN
    (s,) = states
    if upd is not None and shape_of(eqn.invars[1])[s.dim] != shape_of(eqn.invars[0])[s.dim]:
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
    s = only(ins)
    if not isinstance(s, Rows):
        return UNKNOWN
    return s if tuple(eqn.params["padding_config"][s.dim]) == (0, 0, 0) else UNKNOWN


def _rev(eqn, ins):
    s = ins[0]
    return UNKNOWN if s.dim in tuple(eqn.params["dimensions"]) else s


def _dot_general(eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    nl, nr = len(shape_of(eqn.invars[0])), len(shape_of(eqn.invars[1]))
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
    op_shape, idx_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    out_rank = len(shape_of(eqn.outvars[0]))
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
    nd = len(shape_of(eqn.invars[1]))
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
    nd = len(shape_of(eqn.invars[0]))
    ok = isinstance(s, Rows) and s.block == 1 and s.dim < nd - 2
    return [s if ok else UNKNOWN] * len(eqn.outvars)


def _pivots(eqn, ins):
    s = ins[0]
    ok = s.block == 1 and s.dim < len(shape_of(eqn.invars[0])) - 1
    return s if ok else UNKNOWN


RULES: dict[str, Callable] = {
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
