"""The user's function as a jit argument: static code, traced data.

``fun`` is usually a plain callable and is a static argument of the compiled program (cached by
identity, like ``jax.jit``'s own functions). When ``fun`` is a pytree of arrays with static code —
``jax.tree_util.Partial(apply, model_state)`` — its array leaves are passed as traced arguments
instead, so new values (a model state, a Hamiltonian coupling) do not trigger a recompilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_ARRAYS = (jax.Array, np.ndarray, np.generic)


def split_fun(fun: Callable) -> tuple[Any, tuple]:
    """Returns ``(static, leaves)``: a hashable static part and the array leaves to trace."""
    leaves, treedef = jax.tree.flatten(fun)
    if leaves and all(isinstance(x, _ARRAYS) for x in leaves):
        return treedef, tuple(leaves)
    return fun, ()


def join_fun(static: Any, leaves: tuple) -> Callable:
    """Inverse of :func:`split_fun`, inside the traced program."""
    return jax.tree.unflatten(static, leaves) if leaves else static
