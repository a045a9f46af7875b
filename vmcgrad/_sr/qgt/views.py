"""Vector views of a QGT: a parameter pytree, its flat ravel, or the mode's flat real representation.

A QGT acts on vectors in the representation :math:`\\tilde v` of its mode (:mod:`vmcgrad._sr.modes`).
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
import numpy as np
from jax.flatten_util import ravel_pytree

from vmcgrad._problem.validation import as_arrays, describe
from vmcgrad._sr.modes import from_rep, is_complex, to_rep


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
            d += sum(math.prod(p.shape) for p in leaves if is_complex(p))
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

    @property
    def n_params(self) -> int:
        """P: the number of entries of the parameters (real or complex), the length of a flat vector."""
        return sum(math.prod(p.shape) for p in jax.tree.leaves(self.params))

    @property
    def flat_dtype(self) -> Any:
        """The dtype of a flat vector, ``ravel_pytree(params)[0].dtype``."""
        return jnp.result_type(*jax.tree.leaves(self.params))

    def guess(self, v: Any) -> str | None:
        """The kind of the vector ``v`` from its structure, shapes and complexity (not its precision),
        or None when it is of no kind.

        In this order:

        1. ``"tree"``: the structure of ``params`` and its leaf shapes;
        2. ``"rep"``: one axis of length :attr:`dim`, real unless the representation is complex
           ('holomorphic' mode);
        3. ``"flat"``: one axis of length P (:attr:`n_params`).

        Tree before flat: a flat vector of a single 1-D parameter array is that parameter, the same
        numbers either way. Rep before flat decides the one case where the two readings differ: a real
        vector whose length is both D and P in 'complex' mode, where every complex leaf has size zero
        (D = P, the flat dtype complex and the representation real). There it is the representation,
        and the product is real, as in NetKet, whose dense QGTs take a real 1-D vector in the basis of
        ``to_dense()`` and whose solvers, called by ``QGTOnTheFly.solve`` with real representation
        vectors, need products of their own dtype (``jax.scipy``'s ``cg`` refuses a complex product of
        a real vector). Everywhere else the lengths or the complexity tell the kinds apart, or they
        coincide and denote the same numbers (real parameters, 'holomorphic' mode: D = P).

        ``vmcgrad.QGT`` (:meth:`kind`) then requires the kind's exact dtype; ``vmcgrad.netket``
        casts, as NetKet does.
        """
        if self._same_structure(v) and all(
            np.shape(t) == p.shape for t, p in zip(jax.tree.leaves(v), jax.tree.leaves(self.params))
        ):
            return "tree"
        if not (hasattr(v, "shape") and hasattr(v, "dtype") and len(v.shape) == 1):
            return None
        if v.shape[0] == self.dim and (not is_complex(v) or is_complex(self.rep_dtype)):
            return "rep"
        if v.shape[0] == self.n_params:
            return "flat"
        return None

    def kind(self, where: str, name: str, v: Any) -> tuple[Any, str]:
        """Returns ``(v, kind)`` for a vector argument ``name``: the kind :meth:`guess` finds, whose
        dtype must then be exact (a TypeError saying what fits otherwise)."""
        v = as_arrays(where, name, v)
        kind = self.guess(v)
        one_axis = hasattr(v, "shape") and v.ndim == 1
        if kind == "tree" or (kind is None and not one_axis and self._same_structure(v)):
            pairs = zip(jax.tree_util.tree_leaves_with_path(self.params), jax.tree.leaves(v))
            for (path, p), t in pairs:
                if p.shape != np.shape(t) or p.dtype != t.dtype:
                    raise TypeError(
                        f"{where}: the leaf of `{name}` at {jax.tree_util.keystr(path)} must have the "
                        f"shape {tuple(p.shape)} and dtype {p.dtype} of the parameter; got shape "
                        f"{tuple(np.shape(t))} and dtype {t.dtype}. Fix: build `{name}` with "
                        "jax.tree.map over `params`, or pass a flat vector."
                    )
            return v, "tree"
        if kind is not None:
            expected = self.rep_dtype if kind == "rep" else self.flat_dtype
            if v.dtype != expected:
                what = "ravel_pytree(params)[0]" if kind == "flat" else f"the {self.mode!r} representation"
                raise TypeError(
                    f"{where}: `{name}` has the length of {what}, ({v.shape[0]},), but dtype {v.dtype}; "
                    f"expected {expected}. Fix: pass {name}.astype({np.dtype(expected).name!r})."
                )
            return v, kind
        raise TypeError(
            f"{where}: `{name}` must be a pytree like `params` (structure "
            f"{jax.tree.structure(self.params)}), a flat vector ravel_pytree(params)[0]-like, or a real "
            f"representation of shape ({self.dim},) and dtype {self.rep_dtype} ({self.mode!r} mode); "
            f"got {describe(v)}. Fix: pass e.g. jax.tree.map(jnp.ones_like, params)."
        )

    def _same_structure(self, v: Any) -> bool:
        return jax.tree.structure(v) == jax.tree.structure(self.params)

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
        return tuple(layout) + tuple(d for d, p in zip(layout, leaves) if is_complex(p))


def _unravel(tree: Any) -> Any:
    """``ravel_pytree(tree)[1]`` from shapes alone (works on ShapeDtypeStructs too)."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), tree)
    return ravel_pytree(zeros)[1]
