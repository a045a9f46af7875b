r"""Complex linearity of the tangent map: is ``fun`` holomorphic in its complex parameters?

The tangent map is complex-linear (:math:`\dot f[i t] = i\, \dot f[t]`, the Cauchy–Riemann
equations) when no tangent value passes through ``conj``, ``real``, ``imag``, ``abs``, ``complex``
or a complex-to-real cast on its way to the output (:func:`non_holomorphic_op`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from vmcgrad import _jax_private as jcore  # the JAX internals, checked at import
from vmcgrad._checks.tangent import CALL_PARAMS, body_of

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
    from vmcgrad._checks import row_rules as rules

    return frozenset(
        rules.ELEMENTWISE
        | rules.RULES.keys()
        | NOT_C_LINEAR
        | {"scan", "while", "cond", "convert_element_type"}
    )
