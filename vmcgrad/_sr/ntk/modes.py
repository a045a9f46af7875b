r"""The modes of sample-space SR (NetKet's ``VMC_SR`` conventions) and the per-sample Jacobians they take.

A mode says which real (or, 'holomorphic', complex) rows a sample contributes to :math:`J` and with
respect to which parametrisation :math:`\tilde\theta`:

* 'real': :math:`K = 1` row, :math:`\mathrm{Re}\log\psi`; complex parameter leaves split into
  (re, im);
* 'complex': :math:`K = 2` rows, :math:`(\mathrm{Re}\log\psi, \mathrm{Im}\log\psi)`; complex leaves
  split into (re, im);
* 'holomorphic': :math:`K = 1` complex row, :math:`\log\psi` of the complex parameters themselves.

:func:`vmcgrad._sr.jacobian.components` is that map from a per-sample output to its K components,
written once: the kernel's rows, the product :math:`\Delta J t` and the right-hand side of the update
all use it (and the QGT's dense matrix, in the shared base).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from vmcgrad._chunks.plan import cast_like
from vmcgrad._hlo.cost import Platform
from vmcgrad._hlo.platform import resolve_platform
from vmcgrad._problem.problem import Problem, cost_platform_of
from vmcgrad._sr.jacobian import components
from vmcgrad._sr.modes import MODES, from_rep, is_complex, to_rep

#: Samples in NetKet's mean-Jacobian estimate (``srt_onthefly``'s ``n_subset``).
SHIFT_SAMPLES = 32


def choose_ntk_mode(where: str, params: Any, out_dtype: Any, mode: Any) -> str:
    """NetKet's ``VMC_SR`` rule: 'real' if parameters and output are real, else 'complex'.

    'real' keeps only :math:`\\mathrm{Re}\\log\\psi` (for real wave functions with a sign; NetKet's
    ``VMC_SR(mode='real')``), 'complex' splits output and complex parameters into real and imaginary
    parts, 'holomorphic' takes :math:`O = \\partial\\log\\psi/\\partial\\theta` of complex parameters.
    """
    leaves = jax.tree.leaves(params)
    any_complex = any(is_complex(p) for p in leaves)
    complex_out = jnp.issubdtype(out_dtype, jnp.complexfloating)
    if mode is None:
        return "complex" if (any_complex or complex_out) else "real"
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"{where}: `mode` must be one of {MODES} or None; got {mode!r}. Fix: leave it None to "
            "choose as NetKet's VMC_SR does ('real' for real parameters and output, else 'complex')."
        )
    if mode == "holomorphic" and not (all(is_complex(p) for p in leaves) and complex_out):
        raise ValueError(
            f"{where}: mode='holomorphic' needs complex parameters (every leaf) and a complex output; "
            f"got output dtype {out_dtype} and parameter dtypes "
            f"{sorted({str(jnp.result_type(p)) for p in leaves})}. Fix: use mode='complex'."
        )
    return mode


def k_of(mode: str) -> int:
    """Output components per sample: 2 in 'complex' mode (Re, Im), else 1."""
    return 2 if mode == "complex" else 1


def vector_dtype(mode: str, params: Any) -> Any:
    """The kernel's dtype: complex in 'holomorphic' mode, else the real dtype of the parameters."""
    dtype = jnp.result_type(*jax.tree.leaves(params))
    real = jnp.finfo(dtype).dtype
    return jnp.result_type(real, jnp.complex64) if mode == "holomorphic" else real


def theta_of(mode: str, params: Any) -> Any:
    """The parametrisation differentiated: complex leaves split into (re, im), except 'holomorphic'."""
    return params if mode == "holomorphic" else to_rep("complex", params)


def params_of(mode: str, theta: Any, params: Any) -> Any:
    """The inverse of :func:`theta_of`: a pytree like ``params`` (dtypes included)."""
    return theta if mode == "holomorphic" else cast_like(from_rep("complex", theta), params)


def rows_fun(fun: Callable, mode: str, params: Any) -> Callable:
    """``f(theta, batch) -> (batch, K)``: the mode's output components as functions of ``theta``."""
    return lambda theta, x: components(mode, fun(params_of(mode, theta, params), x))


#: Parts a chunk's per-sample Jacobians are derived in where nothing fixed the batch, or None for the
#: platform's (:func:`jacobian_split`). A setting for benchmarks and for modelling one platform's
#: program on another (``benchmarks/step_regime.py``'s ``@SPLIT``), read when an operator or an update
#: is made (:func:`pinned`): a problem made before it changed keeps its split.
JACOBIAN_SPLIT: int | None = None

#: The parts of :func:`jacobian_split` per platform: on a CPU a chunk's Jacobians a sixteenth at a time
#: are the fastest (the model's intermediates of a few samples stay in its caches); on a GPU or a TPU
#: each batch is a sequence of ops of a fixed cost whatever its size, so the whole chunk at once is.
PLATFORM_SPLIT = {"cpu": 16}


def pinned(prob: Problem) -> Problem:
    """``prob`` with the platform its choices are made for and the Jacobian split its programs are
    traced with fixed as its fields (:attr:`vmcgrad._problem.problem.Problem.platform`,
    ``jacobian_split``): the platform in force now (:func:`vmcgrad._problem.problem.cost_platform_of`:
    :func:`vmcgrad.cost_platform`, ``$VMCGRAD_COST_PLATFORM``, else the devices'), and its split.

    The NTK's programs read the split when they are traced; ``jax.jit`` keys a trace by its static
    arguments (the problem among them), not by :func:`vmcgrad.cost_platform`. Fixed in the problem,
    the split keys the trace and the automatic chunk's search: a program priced for a TPU and then for
    a CPU in one process is each platform's own, never the first one's trace again. A problem already
    pinned is returned as it is."""
    if prob.platform is not None and prob.jacobian_split is not None:
        return prob
    platform, split = platform_key(cost_platform_of(prob))
    return dataclasses.replace(prob, platform=platform, jacobian_split=split)


def platform_key(platform: Platform | None = None) -> tuple[Platform, int]:
    """``(platform, split)``: the platform the choices are made for (``platform``, else the one in
    force: :func:`vmcgrad._hlo.platform.resolve_platform`) and the Jacobian split its programs are
    traced with (:data:`JACOBIAN_SPLIT`, else :data:`PLATFORM_SPLIT`'s): what :func:`pinned` fixes,
    and the static key of a caller's own ``jax.jit`` around :func:`vmcgrad.minsr_update` (the NetKet
    driver's), whose trace would otherwise be reused for another platform."""
    platform = resolve_platform() if platform is None else platform
    split = JACOBIAN_SPLIT if JACOBIAN_SPLIT is not None else PLATFORM_SPLIT.get(platform.name, 1)
    return platform, split


def jacobian_split(prob: Problem | None = None) -> int:
    """The parts a chunk's Jacobians are derived in: ``prob``'s, fixed when it was made
    (:func:`pinned`); else :data:`JACOBIAN_SPLIT`, else the platform's the choices are made for
    (:func:`vmcgrad._hlo.platform.resolve_platform`: the devices' own, or
    :func:`vmcgrad.cost_platform`'s; :data:`PLATFORM_SPLIT`, 1 — the whole chunk — on an
    accelerator)."""
    if prob is not None and prob.jacobian_split is not None:
        return prob.jacobian_split
    return platform_key(None if prob is None else cost_platform_of(prob))[1]


def jacobian_batch(rows: int, fixed: int | None = None, split: int | None = None) -> int:
    """Samples whose Jacobians a chunk of ``rows`` derives at once: ``fixed`` (at most ``rows``) where
    the chunk choice set it (:func:`vmcgrad._sr.ntk.dense.choose_dense`, the largest batch whose
    program fits the budget), else ``rows / split`` (the problem's :func:`jacobian_split`; None: the
    one in force now), at least 1: the whole chunk on an accelerator.

    A per-sample Jacobian's intermediates (a reverse pass per output component) can outweigh the
    Jacobian itself many times, so under a budget a smaller batch buys larger chunks; but each batch
    is one trip of the model's derivative, a sequence of ops whose count does not depend on its size,
    so on an accelerator, with the memory to spare, the whole chunk at once runs the fewest.
    """
    if fixed is not None:
        return min(rows, fixed)
    return min(rows, max(1, rows // (jacobian_split() if split is None else split)))


def contract(a: Any, b: Any, k: int) -> jax.Array:
    r""":math:`A B^\dagger` over all parameters: ``(n_a, K, n_b, K)`` from leaves ``(n, K, *leaf)``."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    na, nb = la[0].shape[0], lb[0].shape[0]
    total = None
    for x, y in zip(la, lb):
        blk = x.reshape(na * k, -1) @ jnp.conj(y.reshape(nb * k, -1)).T
        total = blk if total is None else total + blk
    return total.reshape(na, k, nb, k)


def mean_jacobian(f: Callable, theta: Any, samples: Any, n: int, mode: str, most: int) -> Any:
    """NetKet's estimate of the mean Jacobian: over ``min(n, 32, most)`` samples evenly strided (``most``
    the chunk, so that no batch exceeds it), by pullbacks (leaves ``(K, *leaf)``); it only needs to
    remove the bulk of the common part (it cancels exactly in the centred kernel)."""
    k = min(n, SHIFT_SAMPLES, most)
    idx = jnp.arange(k) * (n // k)
    subset = jax.tree.map(lambda a: a[idx], samples)
    out, pull = jax.vjp(lambda t: f(t, subset), theta)
    eye = jnp.eye(out.shape[1], dtype=out.dtype)
    cts = jnp.broadcast_to(eye[:, None, :] / k, (out.shape[1], *out.shape))
    (mean,) = jax.vmap(pull)(cts)
    return jax.lax.stop_gradient(mean)
