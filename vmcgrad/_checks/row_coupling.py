r"""Row coupling: does row :math:`i` of ``fun``'s tangent depend on other samples than :math:`\sigma_i`?

The interpreter follows the tangent map's jaxpr (:mod:`vmcgrad._checks.tangent`) equation by
equation with the states and rules of :mod:`vmcgrad._checks.row_rules`, into ``jit``, ``scan``,
``while``, ``cond`` and ``custom_jvp`` bodies. What no rule decides is settled by a numerical check
on concrete rows, else a warning (:func:`settle_rows`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmcgrad import _jax_private as jcore  # the JAX internals, checked at import
from vmcgrad._checks import row_rules as rules
from vmcgrad._checks.row_rules import ROW, UNKNOWN, Mixed, Rows, Unknown, join, unknown_of
from vmcgrad._checks.tangent import CALL_PARAMS, MISSING, analyse, body_of, recall, remember, signature_key
from vmcgrad._function import split_fun
from vmcgrad._warnings import UnknownPrimitiveWarning, stacklevel_outside_package


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


def _call(j: Any, ins: Sequence) -> list:
    jaxpr, consts = body_of(j)
    return _batch_jaxpr(jaxpr, consts, ins)


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
    for key in CALL_PARAMS:
        if key in eqn.params and isinstance(eqn.params[key], (jcore.Jaxpr, jcore.ClosedJaxpr)):
            body = eqn.params[key]
            if len(body_of(body)[0].invars) == len(ins):
                return _call(body, ins)
    mixed = next((s for s in ins if isinstance(s, Mixed)), None)
    if mixed is not None:
        return [mixed] * n_out
    if all(s is None for s in ins):
        return [None] * n_out
    if any(isinstance(s, Unknown) for s in ins):
        return [unknown_of(*ins)] * n_out
    if any(isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr)) for p in eqn.params.values()):
        return [Unknown(frozenset({name}))] * n_out  # a body the analysis does not follow
    if any(s == ROW for s in ins):
        return [ROW if not any(isinstance(s, Rows) for s in ins) else UNKNOWN] * n_out
    rule = rules.RULES.get(name)
    if rule is None:
        if name in rules.ELEMENTWISE:
            return rules.elementwise(eqn, ins)
        return [Unknown(frozenset({name}))] * n_out  # no rule: reported (rows_verdict)
    out = rule(eqn, ins)
    return out if isinstance(out, list) else [out] * n_out


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
        new = [join(c, o) for c, o in zip(carry, outs[:nk])]
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
        new = [join(c, o) for c, o in zip(carry, outs)]
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
        outs = b if outs is None else [join(x, y) for x, y in zip(outs, b)]
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
    if decided is not MISSING:
        return decided
    reason = _not_concrete(fun, params, samples)
    result = Unsettled(reason) if reason else numerical_row_coupling(fun, params, samples, unjudged)
    if not isinstance(result, Unsettled):
        remember(key, result)
        return result
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
