r"""``QGT``: the quantum geometric tensor as an immutable, jit-friendly linear operator.

.. math::

    S = \frac1N \Delta O^\dagger \Delta O,\qquad \Delta O_i = O_i - \bar O,\qquad
    \bar O = \frac1N \sum_{i=1}^N O_i,\qquad O_{ik} = \frac{\partial \log\psi_\theta(\sigma_i)}
    {\partial\theta_k},

applied as :math:`S_\text{eff}\,v = S v + \epsilon_1 \operatorname{diag}(S)\, v + \epsilon_2 v`
with :math:`\epsilon_1` = ``diag_scale`` and :math:`\epsilon_2` = ``diag_shift`` (NetKet's
QGTJacobian regularisation, Becca & Sorella 2017). The matrix taken in each mode (real part, real
and imaginary parts split, holomorphic) is described in :mod:`vmcgrad._qgt_modes`.

Every product is one pass over the samples (see :mod:`vmcgrad._qgt_passes`): per chunk one
linearisation, its jvp and its transpose; :math:`\bar O` is computed once, when the operator is
built, so the centring is a cheap dot product; one ``psum`` per product, after the loop.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from . import _validation as check
from ._auto_chunk import choose_chunk, default_memory_budget, signature
from ._chunking import plan_chunks
from ._function import join_fun, split_fun
from ._qgt_modes import choose_mode, from_rep, to_rep
from ._qgt_passes import (
    Rows,
    cached_product_pass,
    jacobian_pass,
    linearize_pass,
    mean_pass,
    product_pass,
)
from ._sharding import (
    SampleAxis,
    find_sample_axis,
    local_count,
    pad_to_devices,
    per_device,
    repeat_last,
    replicate,
    sum_over_devices,
    to_varying,
)
from ._solve import CGInfo, cg

_NAME = "vmcgrad.QGT"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QGTOperator:
    r"""The regularised QGT :math:`S + \epsilon_1\operatorname{diag}(S) + \epsilon_2` of one set of samples.

    Build it with :func:`vmcgrad.QGT`. It is a pytree: the parameters, samples, :math:`\bar O`,
    the model state of a ``Partial`` ``logpsi`` and the shifts are leaves, so it can be passed
    into ``jax.jit`` and rebuilt every step without recompiling; ``logpsi``'s code, the chunk
    size, the mode and the sample mesh axis are static.

    Vectors are pytrees like ``params``, flat vectors in ``ravel_pytree(params)`` order, or flat
    vectors in the mode's real representation (length :attr:`dim`, the order of :meth:`to_dense`);
    every method returns the kind it was given.
    """

    params: Any
    samples: Any
    obar: Any  # the mean O, shaped like the representation of params (complex where O is)
    diag_shift: jax.Array
    diag_scale: jax.Array | None
    diag_s: Any  # diag of S (no shifts), shaped like the representation of params, or None
    fun_data: tuple
    fun_static: Any = dataclasses.field(metadata={"static": True})
    chunk_size: int | None = dataclasses.field(metadata={"static": True})
    mode: str = dataclasses.field(metadata={"static": True})
    where: SampleAxis | None = dataclasses.field(metadata={"static": True})
    out_dtype: Any = dataclasses.field(metadata={"static": True})

    # --- shapes --------------------------------------------------------------------------------

    @property
    def n_samples(self) -> int:
        """N, the number of samples."""
        return jax.tree.leaves(self.samples)[0].shape[0]

    @property
    def dim(self) -> int:
        """D, the size of the matrix: P, plus the number of complex entries in 'complex' mode."""
        leaves = jax.tree.leaves(self.params)
        d = sum(math.prod(p.shape) for p in leaves)
        if self.mode == "complex":
            d += sum(math.prod(p.shape) for p in leaves if _is_complex(p))
        return d

    def _rep_dtype(self) -> Any:
        leaves = jax.tree.leaves(self.params)
        if self.mode == "complex":
            return jnp.result_type(*(jnp.finfo(p.dtype).dtype for p in leaves))
        return jnp.result_type(*(p.dtype for p in leaves))

    def _real_dtype(self) -> Any:
        return jnp.finfo(jnp.result_type(*jax.tree.leaves(self.params))).dtype

    # --- public API ----------------------------------------------------------------------------

    def __matmul__(self, v: Any) -> Any:
        r""":math:`S v + \epsilon_1 \operatorname{diag}(S) v + \epsilon_2 v`, one pass over the samples.

        Args:
            v: a pytree like ``params`` (same shapes and dtypes), a flat vector
                ``ravel_pytree(v)[0]``, or a flat real representation of length :attr:`dim`.

        Returns:
            The product, of the same kind as ``v``.
        """
        v, kind = self._vector(v, "v")
        return _matmul(self, v, kind=kind)

    def to_dense(self) -> jax.Array:
        """The ``(dim, dim)`` matrix, in the mode's representation (equal to NetKet's
        ``QGTJacobianDense(...).to_dense()``); one pass over the samples, holding a chunk's Jacobian."""
        return _to_dense(self)

    def diagonal(self) -> jax.Array:
        r"""The diagonal of :meth:`to_dense`, :math:`(1 + \epsilon_1) S_{kk} + \epsilon_2`, a flat
        ``(dim,)`` vector (without building the matrix)."""
        diag_s = self.diag_s if self.diag_s is not None else _diag_s(self)
        return _diagonal(self, diag_s)

    def solve(
        self,
        b: Any,
        *,
        x0: Any = None,
        tol: float = 1e-5,
        atol: float = 0.0,
        maxiter: int | None = None,
        cache_bytes: int = 0,
    ) -> tuple[Any, CGInfo]:
        r"""Solves :math:`S_\text{eff}\, x = b` by conjugate gradient (one pass per iteration).

        With ``diag_scale`` set, as NetKet does, CG runs on the Jacobi-rescaled system
        :math:`D^{-1/2} S_\text{eff} D^{-1/2} y = D^{-1/2} b`, :math:`x = D^{-1/2} y`,
        :math:`D = \operatorname{diag}(S) + \epsilon_2/\epsilon_1`.

        Args:
            b: right-hand side, a vector of any kind :meth:`__matmul__` takes.
            x0: initial guess of the same kind, or None for zeros.
            tol, atol: stop when :math:`\lVert r\rVert \le \max(\mathrm{tol}\lVert b\rVert,
                \mathrm{atol})` (``jax.scipy.sparse.linalg.cg``'s rule and defaults).
            maxiter: iteration cap; None means ``10 * dim``.
            cache_bytes: memory budget (bytes per device) for keeping every chunk's linearisation
                (the forward activations ``jax.linearize`` saves) for the whole solve. When they fit,
                they are computed once and each iteration only runs the jvp and its transpose (no
                forward pass); otherwise (and by default, 0) each iteration recomputes them chunk by
                chunk, holding one chunk's at a time.

        Returns:
            ``(x, info)``: ``x`` of the kind of ``b``, ``info`` a :class:`~vmcgrad.CGInfo` (with
            ``diag_scale`` set, its residual norm and the tolerances refer to the rescaled system).
        """
        b, kind = self._vector(b, "b")
        if x0 is not None:
            x0, kind0 = self._vector(x0, "x0")
            if kind0 != kind:
                raise TypeError(
                    f"{_NAME}.solve: `x0` must be the same kind of vector as `b` ({kind}); got {kind0}. "
                    "Fix: pass both as pytrees, or both flat."
                )
        maxiter = 10 * self.dim if maxiter is None else maxiter
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, (int, np.integer)) or cache_bytes < 0:
            raise TypeError(
                f"{_NAME}.solve: `cache_bytes` must be a non-negative int (bytes per device); got "
                f"{cache_bytes!r}. Fix: pass e.g. cache_bytes=2**30, or 0 to recompute every iteration."
            )
        return _solve(self, b, x0, tol, atol, maxiter, kind=kind, cache_bytes=int(cache_bytes))

    def replace(self, **changes: Any) -> QGTOperator:
        """A copy with new ``diag_shift`` and/or ``diag_scale`` (computing diag(S) if needed)."""
        bad = set(changes) - {"diag_shift", "diag_scale"}
        if bad:
            raise TypeError(
                f"{_NAME}.replace: only `diag_shift` and `diag_scale` can be replaced; got {sorted(bad)}. "
                "Fix: build a new operator with vmcgrad.QGT for new parameters or samples."
            )
        real = self._real_dtype()
        if "diag_shift" in changes:
            changes["diag_shift"] = _scalar(f"{_NAME}.replace", "diag_shift", changes["diag_shift"], real)
        if "diag_scale" in changes and changes["diag_scale"] is not None:
            changes["diag_scale"] = _scalar(f"{_NAME}.replace", "diag_scale", changes["diag_scale"], real)
        new = dataclasses.replace(self, **changes)
        if new.diag_scale is not None and new.diag_s is None:
            new = dataclasses.replace(new, diag_s=_diag_s(new))
        return new

    def __repr__(self) -> str:
        return (
            f"QGTOperator(mode={self.mode!r}, dim={self.dim}, n_samples={self.n_samples}, "
            f"chunk_size={self.chunk_size}, diag_shift={self.diag_shift}, diag_scale={self.diag_scale})"
        )

    # --- input checks --------------------------------------------------------------------------

    def _vector(self, v: Any, name: str) -> tuple[Any, str]:
        """Returns ``(v, kind)``: kind 'tree', 'flat' (ravel of params) or 'rep' (representation)."""
        where = f"{_NAME} ({name})"
        v = check.as_arrays(where, name, v)
        p_def = jax.tree.structure(self.params)
        if jax.tree.structure(v) == p_def:
            pairs = zip(jax.tree_util.tree_leaves_with_path(self.params), jax.tree.leaves(v))
            bad = [(path, p, t) for (path, p), t in pairs if p.shape != t.shape or p.dtype != t.dtype]
            if not bad:
                return v, "tree"
            single_flat = isinstance(v, jax.Array) and v.ndim == 1  # params is one array: maybe flat
            if not single_flat:
                path, p, t = bad[0]
                raise TypeError(
                    f"{where}: the leaf of `{name}` at {jax.tree_util.keystr(path)} must have the "
                    f"shape {tuple(p.shape)} and dtype {p.dtype} of the parameter; got shape "
                    f"{tuple(t.shape)} and dtype {t.dtype}. Fix: build `{name}` with jax.tree.map "
                    "over `params`, or pass a flat vector."
                )
        if isinstance(v, jax.Array) and v.ndim == 1:
            if v.shape == (self.dim,) and v.dtype == self._rep_dtype():
                return v, "rep"
            n_par = sum(math.prod(p.shape) for p in jax.tree.leaves(self.params))
            flat_dtype = jnp.result_type(*jax.tree.leaves(self.params))
            if v.shape == (n_par,) and v.dtype == flat_dtype:
                return v, "flat"
        raise TypeError(
            f"{where}: `{name}` must be a pytree like `params` (structure {p_def}), a flat vector "
            f"ravel_pytree(params)[0]-like, or a real representation of shape ({self.dim},) and "
            f"dtype {self._rep_dtype()} ({self.mode!r} mode); got "
            f"{_describe(v)}. Fix: pass e.g. jax.tree.map(jnp.ones_like, params)."
        )


def _is_complex(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _describe(v: Any) -> str:
    if isinstance(v, jax.Array):
        return f"an array of shape {tuple(v.shape)} and dtype {v.dtype}"
    return f"a pytree {jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), v)}"


def _scalar(where: str, name: str, x: Any, real_dtype: Any) -> jax.Array:
    try:
        arr = jnp.asarray(x)
    except TypeError:
        arr = None
    if (
        arr is None
        or arr.ndim != 0
        or not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer))
    ):
        raise TypeError(
            f"{where}: `{name}` must be a real scalar; got {x!r}. Fix: pass a float, e.g. {name}=1e-3."
        )
    return arr.astype(real_dtype)


def QGT(
    logpsi: Any,
    params: Any,
    samples: Any,
    *,
    chunk_size: int | None = None,
    diag_shift: float | jax.Array = 0.0,
    diag_scale: float | jax.Array | None = None,
    mode: str | None = None,
    holomorphic: bool | None = None,
) -> QGTOperator:
    r"""Builds the quantum geometric tensor of ``logpsi`` at ``params`` over ``samples``.

    .. math::

        S_\text{eff} = \frac1N \Delta O^\dagger \Delta O + \epsilon_1 \operatorname{diag}
        \Big(\frac1N \Delta O^\dagger \Delta O\Big) + \epsilon_2\, \mathbb 1,\qquad
        \Delta O_i = O_i - \bar O,\quad O_{ik} = \frac{\partial \log\psi(\sigma_i)}{\partial\theta_k}

    in the mode's representation (``Re`` of it for 'real' and 'complex'; see
    :mod:`vmcgrad._qgt_modes`). Building it costs one pass over the samples (for :math:`\bar O`;
    a second one, holding one chunk's Jacobian, when ``diag_scale`` is set, for
    :math:`\operatorname{diag} S`); each product :math:`S v` then costs one more.

    Args:
        logpsi: ``logpsi(params, batch) -> (batch_size,)`` log-amplitudes, real or complex; a plain
            callable (static) or a ``jax.tree_util.Partial`` whose arrays (model state) are traced.
        params: the parameter pytree (real and/or complex floating leaves).
        samples: an array (or pytree of arrays) with the N samples along axis 0, sharded over
            devices or not; any N.
        chunk_size: samples per chunk on each device (any positive int, or None for one chunk),
            or ``"auto"``: the largest power of two whose ``S @ v`` program fits the memory budget
            (:func:`vmcgrad.auto_chunk_size`'s rule, applied to the product).
        diag_shift: :math:`\epsilon_2`, added to the diagonal.
        diag_scale: :math:`\epsilon_1`, or None: the diagonal is also scaled by
            :math:`1 + \epsilon_1` and :meth:`~QGTOperator.solve` is Jacobi-rescaled (NetKet's
            QGTJacobian ``diag_scale``).
        mode: 'real', 'complex', 'holomorphic', or None to choose as NetKet does: 'real' for real
            parameters, 'complex' if any is complex, 'holomorphic' if ``holomorphic=True``. The
            matrices equal NetKet's QGTOnTheFly, and QGTJacobianDense with NetKet's default mode
            (for real parameters and a complex output NetKet names that mode 'complex'; its
            explicit mode='real' there drops Im log ψ: pass ``logpsi(...).real`` to get it).
        holomorphic: whether ``logpsi`` is holomorphic in complex parameters (exclusive with ``mode``).

    Returns:
        A :class:`QGTOperator` (a pytree).

    Raises:
        TypeError, ValueError: for bad input, before anything is traced.

    Examples:
        >>> import jax, jax.numpy as jnp, vmcgrad
        >>> logpsi = lambda w, x: jnp.tanh(x @ w)
        >>> w, x = jnp.ones(3) / 4, jnp.arange(30.0).reshape(10, 3) / 30
        >>> S = vmcgrad.QGT(logpsi, w, x, chunk_size=4, diag_shift=1e-3)
        >>> O = jax.jacrev(lambda w: logpsi(w, x))(w)
        >>> dO = O - O.mean(0)
        >>> S_ref = dO.T @ dO / 10 + 1e-3 * jnp.eye(3)
        >>> bool(jnp.allclose(S.to_dense(), S_ref)), bool(jnp.allclose(S @ w, S_ref @ w))
        (True, True)
        >>> x_sol, info = S.solve(S_ref @ w)
        >>> bool(jnp.allclose(x_sol, w, rtol=1e-4)), int(info.iterations) <= 3
        (True, True)
    """
    chunk_size = check.check_chunk_size(_NAME, chunk_size)
    params, samples, _, out = check.check_problem(_NAME, logpsi, params, samples, arg="logpsi")
    mode = choose_mode(_NAME, params, out, mode, holomorphic)
    real = jnp.finfo(jnp.result_type(*jax.tree.leaves(params))).dtype
    diag_shift = _scalar(_NAME, "diag_shift", 0.0 if diag_shift is None else diag_shift, real)
    if diag_scale is not None:
        diag_scale = _scalar(_NAME, "diag_scale", diag_scale, real)
    where = find_sample_axis(samples)
    static, data = split_fun(logpsi)
    params, data, diag_shift, diag_scale = replicate((params, data, diag_shift, diag_scale), where)
    op = QGTOperator(
        params=params,
        samples=samples,
        obar=None,
        diag_shift=diag_shift,
        diag_scale=diag_scale,
        diag_s=None,
        fun_data=data,
        fun_static=static,
        chunk_size=None if chunk_size == "auto" else chunk_size,
        mode=mode,
        where=where,
        out_dtype=np.dtype(out.dtype),
    )
    if chunk_size == "auto":
        op = dataclasses.replace(op, chunk_size=_auto_chunk_size(op))
    op = dataclasses.replace(op, obar=_mean(op))
    if diag_scale is not None:
        op = dataclasses.replace(op, diag_s=_diag_s(op))
    return op


# --- traced internals ----------------------------------------------------------------------------


def _prepare(op: QGTOperator) -> tuple[Any, int]:
    """Samples padded to a multiple of the device count; returns ``(samples, n_local)``."""
    fill = jax.tree.map(lambda _: repeat_last, op.samples)
    samples, n_pad = pad_to_devices(op.samples, op.where, fill)
    return samples, n_pad if op.where is None else n_pad // op.where.size


def _local(op: QGTOperator, data: tuple, params: Any, n_local: int) -> tuple[Any, Any, jax.Array]:
    """Inside the per-device body: ``(g, theta, rows)``."""
    where = op.where
    params = to_varying(params, where)
    fun = join_fun(op.fun_static, data)
    first = 0 if where is None else jax.lax.axis_index(where.axis) * n_local
    rows = Rows(first, op.n_samples, op._real_dtype())

    def g(theta, x):
        return fun(from_rep(op.mode, theta), x)

    return g, to_rep(op.mode, params), rows


def _run(op: QGTOperator, prepared: tuple[Any, int], local: Any, *extra: Any) -> Any:
    """Runs ``local(g, theta, samples, rows, plan, *extra)`` on each device and sums once."""
    samples, n_local = prepared
    plan = plan_chunks(n_local, op.chunk_size)

    def body(data, params, samples, *extra):
        g, theta, rows = _local(op, data, params, n_local)
        acc = local(g, theta, samples, rows, plan, *to_varying(extra, op.where))
        return sum_over_devices(acc, op.where)

    specs = ("params", "params", "samples", *("params",) * len(extra))
    return per_device(body, op.where, specs, "params")(op.fun_data, op.params, samples, *extra)


def _vary(x: jax.Array, where: SampleAxis | None) -> jax.Array:
    """Casts ``x`` to device-varying over the sample axis unless it already is."""
    if where is None:
        return x
    names = (where.axis,) if isinstance(where.axis, str) else tuple(where.axis)
    missing = tuple(a for a in names if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _linearize_all(op: QGTOperator, prepared: tuple[Any, int]) -> tuple[Any, ...]:
    """Every chunk's linearisation on every device, kept (split over the devices)."""
    samples, n_local = prepared
    plan = plan_chunks(n_local, op.chunk_size)
    box = {}

    def body(data, params, samples):
        g, theta, rows = _local(op, data, params, n_local)
        vary = partial(_vary, where=op.where)
        residuals, wts, box["treedef"] = linearize_pass(g, theta, samples, rows, plan, vary)
        return residuals, wts

    residuals, wts = per_device(body, op.where, ("params", "params", "samples"), "samples")(
        op.fun_data, op.params, samples
    )
    return residuals, wts, box["treedef"], plan.count


def _apply_cached(op: QGTOperator, cache: tuple[Any, ...], v: Any) -> Any:
    """:func:`_apply` from kept linearisations (no forward pass)."""
    residuals, wts, treedef, count = cache

    def body(params, residuals, wts, obar, v):
        params, obar, v = to_varying((params, obar, v), op.where)
        acc = cached_product_pass(treedef, residuals, wts, to_rep(op.mode, params), obar, v, count)
        return sum_over_devices(acc, op.where)

    specs = ("params", "samples", "samples", "params", "params")
    total = per_device(body, op.where, specs, "params")(op.params, residuals, wts, op.obar, v)
    return _finish(op, total, v)


def _auto_chunk_size(op: QGTOperator, budget: int | None = None) -> int:
    """``chunk_size="auto"``: the largest power of two whose ``S @ v`` program fits the default
    memory budget (see :mod:`vmcgrad._auto_chunk`), measured on the compiled product (nothing runs;
    cached per function, shapes, mode and placement)."""
    abstract = dataclasses.replace(op, obar=jax.eval_shape(_mean, op))
    if op.diag_scale is not None:
        abstract = dataclasses.replace(abstract, diag_s=jax.eval_shape(_diag_s, abstract))

    def compile_at(c):
        return _matmul.lower(dataclasses.replace(abstract, chunk_size=c), op.params, kind="tree").compile()

    key = ("QGT @ v", op.fun_static, op.mode, op.where, signature((op.params, op.samples, op.fun_data)))
    n_local = local_count(op.n_samples, op.where)
    return choose_chunk(key, n_local, compile_at, budget or default_memory_budget(), where=_NAME)


@jax.jit
def _mean(op: QGTOperator) -> Any:
    total = _run(op, _prepare(op), partial(mean_pass, out_dtype=op.out_dtype))
    return jax.tree.map(lambda t: t / op.n_samples, total)


def _jacobian_stats(op: QGTOperator, *, dense: bool) -> jax.Array:
    d = op.dim
    complex_s = op.mode == "holomorphic"
    dtype = op._rep_dtype() if complex_s else op._real_dtype()
    shape = (d, d) if dense else (d,)

    def local(g, theta, samples, rows, plan, obar):
        zeros = to_varying(jnp.zeros(shape, dtype), op.where)
        return jacobian_pass(g, theta, samples, rows, plan, obar, op.out_dtype, dense=dense, zeros=zeros)

    return _run(op, _prepare(op), local, op.obar) / op.n_samples


@jax.jit
def _diag_s(op: QGTOperator) -> Any:
    """diag(S) as a real pytree shaped like the representation of the parameters."""
    flat = _jacobian_stats(op, dense=False)
    return _unflatten_like(flat, to_rep(op.mode, op.params))


@jax.jit
def _diagonal(op: QGTOperator, diag_s: Any) -> jax.Array:
    flat = ravel_pytree(diag_s)[0]
    scale = 1.0 if op.diag_scale is None else 1.0 + op.diag_scale
    return (scale * flat + op.diag_shift).astype(op._rep_dtype())


@jax.jit
def _to_dense(op: QGTOperator) -> jax.Array:
    s = _jacobian_stats(op, dense=True)
    diag = jnp.full((op.dim,), op.diag_shift)
    if op.diag_scale is not None:
        diag = diag + op.diag_scale * ravel_pytree(op.diag_s)[0]
    return (s + jnp.diag(diag)).astype(op._rep_dtype())


def _unflatten_like(flat: jax.Array, tree: Any) -> Any:
    """Splits ``flat`` into leaves shaped like ``tree``'s, keeping ``flat``'s dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = np.cumsum([math.prod(x.shape) for x in leaves])[:-1]
    parts = jnp.split(flat, sizes)
    return treedef.unflatten([p.reshape(x.shape) for p, x in zip(parts, leaves)])


def _apply(op: QGTOperator, prepared: tuple[Any, int], v: Any) -> Any:
    """:math:`S_\\text{eff} \\tilde v` for a representation pytree ``v``: one pass, one psum."""
    return _finish(op, _run(op, prepared, product_pass, op.obar, v), v)


def _finish(op: QGTOperator, total: Any, v: Any) -> Any:
    """From the reduced :math:`\\sum_i \\overline{O_i} w_i` to :math:`S_\\text{eff} v`."""
    inv_n = 1.0 / op.n_samples

    def finish(t, x, d=None):
        y = jnp.conj(t) * inv_n + op.diag_shift * x
        if d is not None:
            y = y + op.diag_scale * d * x
        return y.astype(x.dtype)

    if op.diag_scale is None:
        return jax.tree.map(finish, total, v)
    return jax.tree.map(finish, total, v, op.diag_s)


def _to_kind(op: QGTOperator, v: Any, kind: str) -> Any:
    if kind == "tree":
        return to_rep(op.mode, v)
    if kind == "flat":
        return to_rep(op.mode, ravel_pytree(op.params)[1](v))
    return ravel_pytree(to_rep(op.mode, op.params))[1](v)


def _from_kind(op: QGTOperator, rep: Any, kind: str) -> Any:
    if kind == "tree":
        return from_rep(op.mode, rep)
    if kind == "flat":
        return ravel_pytree(from_rep(op.mode, rep))[0]
    return ravel_pytree(rep)[0]


@partial(jax.jit, static_argnames=("kind",))
def _matmul(op: QGTOperator, v: Any, *, kind: str) -> Any:
    samples, n_local = _prepare(op)

    def product(res, y):
        op, samples = res
        return _apply(op, (samples, n_local), y)

    def transposed(res, y):  # S is symmetric (real modes) or Hermitian: S^T y = conj(S conj(y))
        return jax.tree.map(jnp.conj, product(res, jax.tree.map(jnp.conj, y)))

    # linear_call: transposing S @ v (as jax.scipy.sparse.linalg.cg does for complex vectors) uses
    # the rule above instead of transposing the chunk loop and its ref accumulators
    rep = _to_kind(op, v, kind)
    out = jax.custom_derivatives.linear_call(product, transposed, (op, samples), rep)
    return _from_kind(op, out, kind)


@partial(jax.jit, static_argnames=("kind", "cache_bytes"))
def _solve(
    op: QGTOperator, b: Any, x0: Any, tol: Any, atol: Any, maxiter: Any, *, kind: str, cache_bytes: int
):
    prepared = _prepare(op)  # padded once for all iterations
    b = _to_kind(op, b, kind)
    x0 = None if x0 is None else _to_kind(op, x0, kind)

    def matvec(y):
        return _apply(op, prepared, y)

    if cache_bytes > 0:
        cache = _linearize_all(op, prepared)
        n_dev = 1 if op.where is None else op.where.size
        kept = sum(r.size * r.dtype.itemsize for r in cache[0]) // n_dev
        if kept <= cache_bytes:  # else the traced pass is unused and compiled away

            def matvec(y):
                return _apply_cached(op, cache, y)

    if op.diag_scale is None:
        x, info = cg(matvec, b, x0, tol=tol, atol=atol, maxiter=maxiter)
    else:
        s = jax.tree.map(lambda d: jnp.sqrt(d + op.diag_shift / op.diag_scale), op.diag_s)
        div = lambda t: jax.tree.map(lambda a, c: (a / c).astype(a.dtype), t, s)
        mul = lambda t: jax.tree.map(lambda a, c: (a * c).astype(a.dtype), t, s)
        y, info = cg(lambda y: div(matvec(div(y))), div(b), None if x0 is None else mul(x0), tol=tol,
                     atol=atol, maxiter=maxiter)  # fmt: skip
        x = div(y)
    return _from_kind(op, x, kind), info
