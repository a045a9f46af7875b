r"""Complex linearity of the tangent map: is ``fun`` holomorphic in its complex parameters?

The tangent map is complex-linear (:math:`\dot f[i t] = i\, \dot f[t]`, the Cauchy–Riemann
equations) when no tangent value passes through ``conj``, ``real``, ``imag``, ``abs``, ``complex``
or a complex-to-real cast on its way to the output (:func:`non_holomorphic_op`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad import _jax_private as jcore  # the JAX internals, checked at import
from vmcgrad._checks import row_rules as rules
from vmcgrad._checks.tangent import (
    CALL_PARAMS,
    analyse,
    body_of,
    once_per_signature,
    recall,
    remember,
    signature_key,
)

NOT_C_LINEAR = frozenset("conj real imag abs complex sign".split())


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
        body = body_of(p["jaxpr"])[0]
        consts, xs = ins[:nc], ins[nc + nk :]
        last: list = []

        def step(carry):
            last[:] = _linear_jaxpr(body, consts + carry + xs)
            return last[:nk]

        carry = _fixpoint(step, list(ins[nc : nc + nk]))
        return [_lin_join(a, b) for a, b in zip(carry, last[:nk])] + last[nk:]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        body = body_of(p["body_jaxpr"])[0]
        return _fixpoint(lambda carry: _linear_jaxpr(body, ins[cn : cn + bn] + carry), list(ins[cn + bn :]))
    if name == "cond":
        outs: list = [None] * n_out
        for branch in p["branches"]:
            outs = [_lin_join(a, b) for a, b in zip(outs, _linear_jaxpr(body_of(branch)[0], ins[1:]))]
        return outs
    for key in CALL_PARAMS:
        body = p.get(key)
        if isinstance(body, (jcore.Jaxpr, jcore.ClosedJaxpr)) and len(body_of(body)[0].invars) == len(ins):
            return _linear_jaxpr(body_of(body)[0], ins)
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


def primitive_names() -> frozenset[str]:
    """Every primitive name the two analyses (row coupling's rule tables and this module's) match by
    string, as the tables are now; the tests check each against the installed JAX
    (:func:`vmcgrad._jax_private.missing_primitives`)."""
    return frozenset(
        rules.ELEMENTWISE
        | rules.RULES.keys()
        | NOT_C_LINEAR
        | {"scan", "while", "cond", "convert_element_type"}
    )


def holomorphic_violation(fun: Any, params: Any, samples: Any) -> str | None:
    r"""Why ``fun`` is not holomorphic in ``params``, or None if it is (proved, or checked numerically).

    1. Proof, from the jaxpr of the tangent map (no FLOPs; once per function and input shapes):
       no tangent value on its way to the output passes through ``conj``, ``real``, ``imag``,
       ``abs`` or ``complex`` (:func:`non_holomorphic_op`). This covers the
       holomorphic NetKet models (complex RBM with ``log_cosh``, ``LogStateVector``, ...).
    2. Otherwise, on concrete inputs, the Cauchy–Riemann test on the first rows (NetKet's
       ``is_probably_holomorphic``, with one tangent instead of the Jacobian): with a random
       complex direction :math:`t`, a holomorphic :math:`f` has :math:`\dot f[i t] = i \dot f[t]`;
       a non-holomorphic one differs by :math:`-2i\,\partial_{\bar\theta} f\;\bar t`. It fails
       when :math:`\lVert \dot f[it] - i \dot f[t]\rVert > \sqrt{\epsilon}\,\lVert \dot f[t]\rVert`.
       A pass is remembered for the function and input shapes.
    3. On traced inputs (inside ``jax.jit``) that step cannot run: the operation found in 1. is
       returned, with a note.
    """
    n_params = len(jax.tree.leaves(params))

    def proof():
        return analyse(fun, params, samples, lambda jaxpr: non_holomorphic_op(jaxpr, n_params) or "")

    op = once_per_signature("holomorphic", fun, params, samples, proof)
    if not op:  # "" proved complex-linear; None: the analysis could not run (fun fails abstractly)
        return None
    passed = signature_key("holomorphic-numeric", fun, params, samples)
    if recall(passed) is True:
        return None
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, samples))):
        return (
            f"its derivative passes through {op}, and the numerical check cannot run on traced "
            "inputs (inside jax.jit); build the QGT once outside jax.jit with these shapes (a "
            "numerical pass is remembered)"
        )
    err = _cauchy_riemann_error(fun, params, samples)
    tol = float(jnp.finfo(jnp.result_type(*jax.tree.leaves(params))).eps) ** 0.5
    if not err > tol:  # NaN (non-finite rows): undecided, not refused
        remember(passed, True)
        return None
    return (
        f"its derivative passes through {op}, and on the first samples it violates the "
        f"Cauchy-Riemann equations (relative error {err:.2g})"
    )


_CR_ROWS = 8


def _cauchy_riemann_error(fun: Any, params: Any, samples: Any) -> float:
    r""":math:`\lVert \dot f[it] - i\dot f[t]\rVert / \lVert \dot f[t]\rVert` on the first rows."""
    rows = jax.tree.map(lambda x: x[:_CR_ROWS], samples)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    t = treedef.unflatten([jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])

    def jvp(direction):
        return jax.jvp(lambda p: fun(p, rows), (params,), (direction,))[1]

    d1 = jvp(t)
    d2 = jvp(jax.tree.map(lambda x: 1j * x, t))
    num, den = jnp.linalg.norm(d2 - 1j * d1), jnp.linalg.norm(d1)
    return float(num / den) if float(den) > 0 else float(num)
