"""Shared test helpers: a tree comparison that really compares, models, sharding set-ups."""

from __future__ import annotations

import contextlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def assert_tree_allclose(actual, desired, *, rtol, atol=0.0):
    """Same pytree structure, same shapes and dtypes leaf by leaf, and close values."""
    a_def, d_def = jax.tree.structure(actual), jax.tree.structure(desired)
    assert a_def == d_def, f"tree structures differ: {a_def} vs {d_def}"
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        a, d = jnp.asarray(a), jnp.asarray(d)
        assert a.shape == d.shape, (a.shape, d.shape)
        assert a.dtype == d.dtype, (a.dtype, d.dtype)
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=rtol, atol=atol)


def tols(dtype):
    """(rtol, atol) for float64 and float32 comparisons of sums over ~10^2 samples."""
    return (1e-11, 1e-12) if jnp.finfo(dtype).bits == 64 else (2e-4, 2e-5)


# --- models: fun(params, batch) -> (batch,) -----------------------------------------------------


def r2r(p, x):
    return jnp.sum(jnp.tanh(x @ p["W"] + p["b"]), axis=-1)


def r2c(p, x):
    """Real parameters, complex output (modulus and phase, like NetKet's RBMModPhase)."""
    h = x @ p["W"]
    return jnp.sum(jnp.log(jnp.cosh(h)), -1) + 1j * jnp.sum(jnp.tanh(h @ p["phase"]), -1)


def c2c_holo(p, x):
    return jnp.sum(jnp.log(jnp.cosh(x @ p["W"] + p["b"])), axis=-1)


def c2c_nonholo(p, x):
    h = x @ p["W"]
    return jnp.sum(jnp.log(jnp.cosh(h)) + 0.3 * jnp.conj(h) * jnp.abs(h), axis=-1)


def mixed(p, x):
    """A real and a complex parameter leaf, complex output."""
    return jnp.sum(jnp.tanh(x @ p["real"]) * p["cplx"], axis=-1)


def layered(p, x):
    """The seed discussion's model: an inner lax.scan over layers."""
    act, _ = jax.lax.scan(lambda h, W: (jnp.tanh(h @ W), None), x, p)
    return jnp.sum(act, axis=-1)


def pytree_samples(p, s):
    return jnp.tanh(s["x"] @ p["W"]).sum(-1) * s["y"]


L, H = 6, 5


def _c(key, shape, dtype):
    k1, k2 = jax.random.split(key)
    re = jax.random.normal(k1, shape, dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        re = jax.random.normal(k1, shape, jnp.finfo(dtype).dtype)
        return (re + 1j * jax.random.normal(k2, shape, re.dtype)).astype(dtype) / 2
    return re / 2


def make_case(name, n, dtype=jnp.float64, seed=0):
    """Returns (fun, params, samples) for a named dtype case with n samples."""
    real = jnp.dtype(dtype)
    cplx = jnp.result_type(real, jnp.complex64)
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, L), real)
    if name == "r2r":
        return r2r, {"W": _c(ks[1], (L, H), real), "b": _c(ks[2], (H,), real)}, x
    if name == "r2c":
        return r2c, {"W": _c(ks[1], (L, H), real), "phase": _c(ks[2], (H, 3), real)}, x
    if name == "c2c_holo":
        return c2c_holo, {"W": _c(ks[1], (L, H), cplx), "b": _c(ks[2], (H,), cplx)}, x.astype(cplx)
    if name == "c2c_nonholo":
        return c2c_nonholo, {"W": _c(ks[1], (L, H), cplx)}, x.astype(cplx)
    if name == "mixed":
        return mixed, {"real": _c(ks[1], (L, H), real), "cplx": _c(ks[2], (H,), cplx)}, x
    if name == "layered":
        return layered, _c(ks[1], (3, L, L), real), x
    if name == "pytree_samples":
        s = {"x": x, "y": jax.random.normal(ks[3], (n,), real)}
        return pytree_samples, {"W": _c(ks[1], (L, H), real)}, s
    raise ValueError(name)


CASES = ["r2r", "r2c", "c2c_holo", "c2c_nonholo", "mixed", "layered", "pytree_samples"]


def random_like(key, shape, dtype):
    return _c(key, shape, dtype) * 2


# --- sharding set-ups ---------------------------------------------------------------------------


def auto_mesh():
    return Mesh(np.array(jax.devices()), ("S",), axis_types=(AxisType.Auto,))


def explicit_mesh():
    return jax.make_mesh((jax.device_count(),), ("S",), axis_types=(AxisType.Explicit,))


@contextlib.contextmanager
def setup(kind):
    """Yields a function placing sample-shaped arrays as the set-up ``kind`` does.

    'netket': Auto-axis mesh "S" set as context mesh, samples NamedSharding(mesh, P("S"));
    'explicit': Explicit-axis mesh "S", samples resharded to P("S") (the seed discussion);
    'none': no mesh, arrays on the default device.
    """
    if kind == "none":
        yield lambda a: a
        return
    mesh = auto_mesh() if kind == "netket" else explicit_mesh()
    with jax.set_mesh(mesh):
        if kind == "netket":
            yield lambda tree: jax.device_put(tree, NamedSharding(mesh, P("S")))
        else:
            yield lambda tree: jax.tree.map(lambda a: jax.sharding.reshard(a, P("S")), tree)


# --- compilation counter ------------------------------------------------------------------------

_compiles = 0
_lock = threading.Lock()


def _on_event(event, duration, **kwargs):
    global _compiles
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """Backend compilations so far in this process."""
    return _compiles


def traced_without_mesh():
    """The notice vmcgrad gives when samples are traced under ``jax.jit`` with no mesh and several
    devices (``vmcgrad._problem.sharding``'s ``warn_if_sharding_unseen``), asserted where it is due: a
    test that jits an estimator without a mesh on purpose wraps the call in this (nothing is expected
    on 1 device)."""
    import pytest

    import vmcgrad

    if jax.device_count() == 1:
        return contextlib.nullcontext()
    return pytest.warns(vmcgrad.VmcgradWarning, match="no sharding visible in their type")


def module_name(path, root) -> str:
    """The dotted name of the module at ``path`` in the package folder ``root`` (``a/b/__init__.py``
    is ``a.b``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Ops a program runs without a cost of their own (issue 47's counting rule).
_FREE_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(.*?\)|\S+)\s+([a-z][\w\-]*)\(")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def sequential_ops(text: str) -> tuple[int, list[int]]:
    """``(ops, trips)`` of an optimized HLO module (``compiled.as_text()``): the ops it runs one after
    another, each op of a computation 1 (a fusion is one op; parameter, constant, tuple,
    get-tuple-element and bitcast free), a while loop its ``known_trip_count`` times its body's and
    condition's ops, recursively, a conditional its largest branch (an upper bound); and the trip
    counts of every loop. A small counter of its own, so that the structural tests read no more than
    the rule (``vmcgrad._checks.hlo`` parses the computations)."""
    from vmcgrad._checks.hlo import _parse

    comps, entry = _parse(text)
    trips: list[int] = []

    def count(name: str) -> int:
        ops = 0
        for line in comps.get(name, ()):
            m = _OP.match(line)
            if not m or m.group(1) in _FREE_OPS:
                continue
            op = m.group(1)
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                n = int(_TRIP_COUNT.search(line).group(1))
                trips.append(n)
                ops += n * (count(body) + count(cond))
            elif op == "conditional":
                names = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                if branches:
                    names += [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
                ops += max(count(b) for b in names)
            elif op == "call":
                ops += sum(count(c) for c in re.findall(r"to_apply=%?([\w.\-]+)", line))
            else:
                ops += 1
        return ops

    return count(entry), trips
