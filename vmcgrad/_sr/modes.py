r"""QGT modes: which matrix is meant, and how vectors are represented (NetKet's conventions).

With :math:`O_{ik} = \partial f(\theta, \sigma_i) / \partial \tilde\theta_k` for a *real*
parametrisation :math:`\tilde\theta` (complex for 'holomorphic'),
:math:`\Delta O = O - \bar O` and :math:`\bar O = \frac1N \sum_i O_i`:

- ``'real'`` — all parameters real (output real or complex), :math:`\tilde\theta = \theta`:
  :math:`S = \frac1N \mathrm{Re}(\Delta O^\dagger \Delta O)`, a real symmetric P×P matrix. For a
  complex output this is :math:`\frac1N(\Delta O_r^T \Delta O_r + \Delta O_i^T \Delta O_i)` with
  :math:`O = O_r + i O_i`: NetKet's QGTOnTheFly, and QGTJacobianDense with its default mode
  (which NetKet calls 'complex' for complex outputs and 'real' for real ones).
- ``'complex'`` — some parameters complex, function not assumed holomorphic. Each complex leaf is
  split into its real and imaginary parts, :math:`\tilde\theta = (\mathrm{Re}\,\theta,
  \mathrm{Im}\,\theta_{\mathbb C})` (NetKet's ``tree_to_real``), and
  :math:`S = \frac1N \mathrm{Re}(\Delta O^\dagger \Delta O)` is real symmetric of size
  :math:`D = P + P_{\mathbb C}`. A complex vector :math:`v` acts through
  :math:`\tilde v = (\mathrm{Re}\,v, \mathrm{Im}\,v)` and the result :math:`\tilde r` is returned as
  :math:`\tilde r_{re} + i\,\tilde r_{im}` (NetKet's QGTJacobian 'complex' mode, and QGTOnTheFly).
  With only real parameters it is the 'real' matrix.
- ``'holomorphic'`` — all parameters complex and the function holomorphic: :math:`\tilde\theta =
  \theta`, :math:`S = \frac1N \Delta O^\dagger \Delta O`, complex Hermitian P×P.

The *representation* of a vector is the pytree :math:`\tilde v` (a tuple ``(re, im)`` in 'complex'
mode, where ``im`` has None at real leaves); its flat form is ``ravel_pytree`` of it, the order of
NetKet's dense Jacobian columns (all real parts, then the imaginary parts of the complex leaves).

NetKet's explicit ``mode='real'`` on a complex-output model drops :math:`\mathrm{Im}\log\psi`
(a different matrix); pass ``lambda p, x: logpsi(p, x).real`` to reproduce it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

#: The names of the modes (a QGT's, above; the NTK's sample-space SR takes the same names).
MODES = ("real", "complex", "holomorphic")


def is_complex(x: Any) -> bool:
    """Whether ``x`` (an array, a ``ShapeDtypeStruct``, a dtype or a Python number) is complex."""
    return jnp.issubdtype(jnp.result_type(x), jnp.complexfloating)


def choose_mode(where: str, params: Any, out: jax.ShapeDtypeStruct, mode: Any, holomorphic: Any) -> str:
    """NetKet's rule: real parameters -> 'real'; any complex one -> 'complex', or 'holomorphic'."""
    leaves = jax.tree.leaves(params)
    any_complex = any(is_complex(p) for p in leaves)
    all_complex = all(is_complex(p) for p in leaves)
    if mode is not None and holomorphic is not None:
        raise ValueError(
            f"{where}: pass `mode` or `holomorphic`, not both; got mode={mode!r}, "
            f"holomorphic={holomorphic!r}. Fix: drop `holomorphic` (mode='holomorphic' says it)."
        )
    if holomorphic is not None and not isinstance(holomorphic, bool):
        raise TypeError(f"{where}: `holomorphic` must be True, False or None; got {holomorphic!r}.")
    if mode is None:
        if holomorphic:
            mode = "holomorphic"
        else:
            mode = "complex" if any_complex else "real"
    if mode not in MODES:
        raise ValueError(
            f"{where}: `mode` must be one of {MODES} or None; got {mode!r}. "
            "Fix: leave it None to choose from the parameter dtypes as NetKet does."
        )
    if mode == "real" and any_complex:
        raise ValueError(
            f"{where}: mode='real' needs real parameters, but some leaves of `params` are complex. "
            "Fix: use mode='complex' (real and imaginary parts as separate real parameters) or "
            "mode='holomorphic' (holomorphic functions of complex parameters)."
        )
    if mode == "holomorphic" and not all_complex:
        raise ValueError(
            f"{where}: mode='holomorphic' (or holomorphic=True) needs every leaf of `params` to be "
            "complex; some are real, so the function cannot be holomorphic in them. Fix: use "
            "mode='complex' (or mode=None)."
        )
    if mode == "holomorphic" and not is_complex(out):
        raise ValueError(
            f"{where}: mode='holomorphic' needs a complex output, but `logpsi` returns {out.dtype}: a "
            "real-valued function of complex parameters is not holomorphic. Fix: use mode='complex'."
        )
    return mode


def to_rep(mode: str, tree: Any) -> Any:
    """The representation :math:`\\tilde v` of a parameter-shaped pytree ``tree``."""
    if mode != "complex":
        return tree
    re = jax.tree.map(lambda x: jnp.real(x) if is_complex(x) else x, tree)
    im = jax.tree.map(lambda x: jnp.imag(x) if is_complex(x) else None, tree)
    return (re, im)


def from_rep(mode: str, rep: Any) -> Any:
    """Inverse of :func:`to_rep`: the parameter-shaped pytree of a representation."""
    if mode != "complex":
        return rep
    re, im = rep
    re_leaves, treedef = jax.tree.flatten(re)
    im_leaves = jax.tree.leaves(im, is_leaf=lambda x: x is None)
    return treedef.unflatten(
        [r if i is None else jax.lax.complex(r, i) for r, i in zip(re_leaves, im_leaves)]
    )
