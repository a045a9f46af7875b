"""Vector views of a QGT: a parameter pytree, its flat ravel, or the mode's flat real representation.

A QGT acts on vectors in the representation :math:`\\tilde v` of its mode (:mod:`vmcgrad._sr.qgt_modes`).
Users hand vectors in one of three *kinds*, and get the same kind back:

- ``"tree"``: a pytree like the parameters (same structure, shapes and dtypes);
- ``"flat"``: ``ravel_pytree(v)[0]``, the parameters' own flat vector;
- ``"rep"``: the flat representation of length :math:`D` (``ravel_pytree(to_rep(mode, v))[0]``),
  the basis of ``to_dense()`` and of NetKet's dense solvers.

:class:`Views` holds the parameters' shapes and the mode, tells the kind of a vector (or says what
was expected), and converts between kinds. ``vmcgrad.QGT`` and ``vmcgrad.netket.QGTOnTheFly`` both
use it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from vmcgrad._problem.validation import as_arrays, describe
from vmcgrad._sr.qgt_modes import from_rep, to_rep


def _is_complex(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


class Views(NamedTuple):
    """The vector kinds of a QGT over ``params`` (arrays or ShapeDtypeStructs) in ``mode``."""

    params: Any
    mode: str

    @property
    def dim(self) -> int:
        """D: the number of real parameters, plus the complex entries in 'complex' mode."""
        leaves = jax.tree.leaves(self.params)
        d = sum(math.prod(p.shape) for p in leaves)
        if self.mode == "complex":
            d += sum(math.prod(p.shape) for p in leaves if _is_complex(p))
        return d

    @property
    def rep_dtype(self) -> Any:
        """The dtype of the flat representation (real in 'complex' mode)."""
        leaves = jax.tree.leaves(self.params)
        if self.mode == "complex":
            return jnp.result_type(*(jnp.finfo(p.dtype).dtype for p in leaves))
        return jnp.result_type(*(p.dtype for p in leaves))

    @property
    def real_dtype(self) -> Any:
        """The real dtype of the parameters' precision."""
        return jnp.finfo(jnp.result_type(*jax.tree.leaves(self.params))).dtype

    def kind(self, where: str, name: str, v: Any) -> tuple[Any, str]:
        """Returns ``(v, kind)`` for a vector argument ``name``, or raises a TypeError saying what fits."""
        v = as_arrays(where, name, v)
        p_def = jax.tree.structure(self.params)
        if jax.tree.structure(v) == p_def:
            pairs = zip(jax.tree_util.tree_leaves_with_path(self.params), jax.tree.leaves(v))
            bad = [(path, p, t) for (path, p), t in pairs if p.shape != t.shape or p.dtype != t.dtype]
            if not bad:
                return v, "tree"
            if not (isinstance(v, jax.Array) and v.ndim == 1):  # params is one array: maybe flat
                path, p, t = bad[0]
                raise TypeError(
                    f"{where}: the leaf of `{name}` at {jax.tree_util.keystr(path)} must have the "
                    f"shape {tuple(p.shape)} and dtype {p.dtype} of the parameter; got shape "
                    f"{tuple(t.shape)} and dtype {t.dtype}. Fix: build `{name}` with jax.tree.map "
                    "over `params`, or pass a flat vector."
                )
        if isinstance(v, jax.Array) and v.ndim == 1:
            if v.shape == (self.dim,) and v.dtype == self.rep_dtype:
                return v, "rep"
            leaves = jax.tree.leaves(self.params)
            n_par = sum(math.prod(p.shape) for p in leaves)
            if v.shape == (n_par,) and v.dtype == jnp.result_type(*leaves):
                return v, "flat"
        raise TypeError(
            f"{where}: `{name}` must be a pytree like `params` (structure {p_def}), a flat vector "
            f"ravel_pytree(params)[0]-like, or a real representation of shape ({self.dim},) and "
            f"dtype {self.rep_dtype} ({self.mode!r} mode); got {describe(v)}. "
            "Fix: pass e.g. jax.tree.map(jnp.ones_like, params)."
        )

    def to_rep(self, v: Any, kind: str) -> Any:
        """The representation pytree :math:`\\tilde v` of a vector of ``kind``."""
        if kind == "tree":
            return to_rep(self.mode, v)
        if kind == "flat":
            return to_rep(self.mode, _unravel(self.params)(v))
        return _unravel(to_rep(self.mode, self.params))(v)

    def from_rep(self, rep: Any, kind: str) -> Any:
        """A vector of ``kind`` from its representation pytree (inverse of :meth:`to_rep`)."""
        if kind == "tree":
            return from_rep(self.mode, rep)
        if kind == "flat":
            return ravel_pytree(from_rep(self.mode, rep))[0]
        return ravel_pytree(rep)[0]

    def rep_layout(self, layout: tuple) -> tuple:
        """The layout of representation leaves, given the parameters' (split dims carry over)."""
        if self.mode != "complex":
            return layout
        leaves = jax.tree.leaves(self.params)
        return tuple(layout) + tuple(d for d, p in zip(layout, leaves) if _is_complex(p))


def _unravel(tree: Any) -> Any:
    """``ravel_pytree(tree)[1]`` from shapes alone (works on ShapeDtypeStructs too)."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), tree)
    return ravel_pytree(zeros)[1]
