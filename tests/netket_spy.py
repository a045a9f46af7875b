"""A spy model: a flax module wrapping a NetKet model that records the batch sizes it is *run* on.

The record is made when the compiled program executes (``jax.eval_shape`` traces at full size
without running, so a trace-time record would lie). ``jax.pure_callback`` with
``vmap_method="expand_dims"`` sees the whole batch also under ``vmap`` (NetKet's numba kernels and
Jacobians vmap the model over samples; ``jax.debug.callback`` would be unrolled per element
there). Its result, a zero, multiplies the output, ``out * (1 + r)``, so that the callback is also
needed by the derivative: a pullback that drops the primal output still runs it.

Host callbacks inside collectives deadlock on several fake CPU devices in jax 0.10.2: use on one
device only.

Batch sizes tell a chunked path from an unchunked one, not vmcgrad's route from NetKet's own
chunked one (NetKet's code on the switch runs chunked too). :func:`vmcgrad_passes` tells those
apart: it records every vmcgrad chunked pass (a bind of vmcgrad's one primitive, which every
vmcgrad estimator goes through) traced inside the block, with JAX's caches cleared on entry so
that every program the block runs is traced there.
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


@contextlib.contextmanager
def vmcgrad_passes():
    """Yields the list of vmcgrad chunked passes (the primitive's ``space``) bound inside the block."""
    from vmcgrad._runner import primitive as _chunked

    prim, passes = _chunked.chunked_p, []

    def bind(*args, **params):
        passes.append(params["params"].space)
        return type(prim).bind(prim, *args, **params)

    jax.clear_caches()  # every program the block runs is traced (and binds) inside it
    prim.bind = bind
    try:
        yield passes
    finally:
        del prim.bind


def run_and_record(fun, *args, **kwargs) -> tuple[Any, list[int]]:
    """``fun(*args, **kwargs)``, blocked until ready, and the batch sizes the spy saw."""
    with batches() as seen:
        out = jax.block_until_ready(fun(*args, **kwargs))
    return out, seen
