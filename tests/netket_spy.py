"""A spy model: a flax module wrapping a NetKet model that records the batch sizes it is *run* on.

The record is made when the compiled program executes (``jax.eval_shape`` traces at full size
without running, so a trace-time record would lie). ``jax.pure_callback`` with
``vmap_method="expand_dims"`` sees the whole batch also under ``vmap`` (NetKet's numba kernels and
Jacobians vmap the model over samples; ``jax.debug.callback`` would be unrolled per element
there). Its result, a zero, multiplies the output, ``out * (1 + r)``, so that the callback is also
needed by the derivative: a pullback that drops the primal output still runs it.

Host callbacks inside collectives deadlock on several fake CPU devices in jax 0.10.2: use on one
device only.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import numpy as np

_SEEN: list[int] = []


def _record(ndim: int, x: np.ndarray) -> np.ndarray:
    _SEEN.append(int(np.prod(x.shape[:-1])))
    return np.zeros(x.shape[: x.ndim - ndim], x.dtype)


class Spy(nn.Module):
    """``inner(x)``, recording ``prod(x.shape[:-1])`` (the configurations evaluated at once)."""

    inner: Any

    @nn.compact
    def __call__(self, x):
        shape = jax.ShapeDtypeStruct(x.shape[:0], x.dtype)
        r = jax.pure_callback(
            partial(_record, x.ndim), shape, jax.lax.stop_gradient(x), vmap_method="expand_dims"
        )
        out = self.inner(x)
        return out * (1 + r.astype(out.dtype))


@contextlib.contextmanager
def batches():
    """Yields the list of batch sizes the spy records inside the block (results blocked on)."""
    seen: list[int] = []
    start = len(_SEEN)
    try:
        yield seen
    finally:
        seen.extend(_SEEN[start:])
        del _SEEN[start:]


def run_and_record(fun, *args, **kwargs) -> tuple[Any, list[int]]:
    """``fun(*args, **kwargs)``, blocked until ready, and the batch sizes the spy saw."""
    with batches() as seen:
        out = jax.block_until_ready(fun(*args, **kwargs))
    return out, seen
