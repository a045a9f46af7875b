r"""``netket_vjp``: :math:`\sum_i c_i\,\partial f_i/\partial\theta` as ``nk.jax.vjp`` has it, chunked.

NetKet's ``nk.jax.vjp`` (``netket/jax/_vjp.py``) picks one rule for the whole parameter tree:

- some leaf complex (C→C, C→R): JAX's pullback, the cotangent cast to the output dtype
  (its real part for a real output);
- all leaves real, real output, real cotangent (R→R): JAX's pullback;
- all leaves real otherwise (R→C, or R→R with a complex cotangent): the complex-linear product
  :math:`A = \sum_i c_i J_i`, :math:`J_i = \partial f_i/\partial\theta` complex, i.e. *two* real
  numbers per real parameter, :math:`\mathrm{Re}\,A` and :math:`\mathrm{Im}\,A`.

The last case needs two real pullbacks. Here both come from one :func:`vmcgrad.batched_vjp` pass
with one reduction: the function is doubled, :math:`g(\theta_a, \theta_b) = f(\theta_a) + i
f(\theta_b)` at :math:`\theta_a = \theta_b = \theta`, whose pullback with the cotangent :math:`c`
is, by JAX's rule for real parameters,

.. math::

    \mathrm{vjp}_a = \mathrm{Re}\sum_i c_i J_i = \mathrm{Re}\,A, \qquad
    \mathrm{vjp}_b = \mathrm{Re}\sum_i c_i\, i J_i = -\mathrm{Im}\,A, \qquad
    A = \mathrm{vjp}_a - i\,\mathrm{vjp}_b .

Each chunk runs the model twice on the same ``chunk_size`` samples (NetKet's rule runs two forward
traces and four pullbacks on the whole batch).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import Partial

import vmcgrad


def netket_vjp(fun: Any, params: Any, samples: Any, cotangent: jax.Array, *, chunk_size: int | None) -> Any:
    r"""``nk.jax.vjp(lambda p: fun(p, samples), params)[1](cotangent)`` (``conjugate=False``), chunked.

    Args:
        fun: ``fun(params, batch) -> (batch,)``, a plain callable or a ``jax.tree_util.Partial``.
        params: the parameter pytree.
        samples: the samples (a pytree), N along axis 0.
        cotangent: shape ``(N,)``, real or complex.
        chunk_size: samples per chunk on each device, or None.

    Returns:
        A pytree like ``params``: complex leaves for real parameters in the R→C case (see the
        module docstring), otherwise the dtypes of ``params``.
    """
    out = jax.eval_shape(fun, params, samples)
    complex_out = jnp.issubdtype(out.dtype, jnp.complexfloating)
    complex_ct = jnp.iscomplexobj(cotangent)
    if any(jnp.iscomplexobj(p) for p in jax.tree.leaves(params)):
        ct = cotangent if complex_out else jnp.real(cotangent)
        return vmcgrad.batched_vjp(fun, params, samples, ct.astype(out.dtype), chunk_size=chunk_size)
    if not complex_out and not complex_ct:
        return vmcgrad.batched_vjp(fun, params, samples, cotangent.astype(out.dtype), chunk_size=chunk_size)
    doubled = Partial(_doubled, fun)
    ct = cotangent.astype(jnp.result_type(out.dtype, 1j))
    vjp_a, vjp_b = vmcgrad.batched_vjp(doubled, (params, params), samples, ct, chunk_size=chunk_size)
    return jax.tree.map(lambda a, b: a - 1j * b, vjp_a, vjp_b)


def _doubled(fun: Any, params_ab: tuple[Any, Any], batch: Any) -> jax.Array:
    params_a, params_b = params_ab
    return fun(params_a, batch) + 1j * fun(params_b, batch)
