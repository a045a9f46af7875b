"""The JAX internals vmcgrad relies on, in one table, checked against the installed JAX at import.

vmcgrad defines a primitive with its own differentiation, batching, partial-evaluation and lowering
rules, reads jaxprs, and accumulates into refs: it needs JAX's extension points (``jax.extend``,
``jax.interpreters``), a few private names (``jax._src``) and attributes that are not yet stable
API. :data:`INTERNALS` lists every one with where vmcgrad uses it. Importing this module resolves
each (attribute lookups on modules ``import jax`` has already loaded) and raises
:class:`PrivateJaxAPIError`, an ``ImportError`` whose message starts with ``vmcgrad:`` and names
the missing internals and the supported JAX version, instead of an ``AttributeError`` deep inside a
user's step. The modules that use these names import them from here, so the check runs before any
of them is used. Entries marked ``lazy`` serve one optional feature and are checked when it is used.

:func:`missing_primitives` checks names of JAX primitives vmcgrad matches by string (the jaxpr
analyses' tables) against the primitives the installed JAX defines.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from typing import Any

import jax

#: The JAX release vmcgrad is written and tested against.
SUPPORTED_JAX = "0.10.2"


class PrivateJaxAPIError(ImportError, RuntimeError):
    """A JAX internal vmcgrad relies on is missing in the installed JAX version."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """A JAX name vmcgrad relies on: ``attr`` (dotted) of the module ``module``."""

    module: str
    attr: str
    used_by: str
    lazy: bool = False  # checked where it is used (one optional feature), not at import

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


_CHUNKED = "vmcgrad._runner.primitive (the chunked map-reduce primitive)"
_RULES = "vmcgrad._runner.rules (the chunked primitive's transformation rules)"
_BODY = "vmcgrad._runner.body (one chunk's jaxpr)"
_REFS = "vmcgrad._runner.refs (sums written as pullbacks into refs)"
_RUNNER = "vmcgrad._runner.runner (the per-device loop)"
_CHECKS = "vmcgrad._checks (the row-coupling and holomorphy analyses of fun's jaxpr)"

#: Every JAX internal vmcgrad relies on.
INTERNALS: tuple[Internal, ...] = (
    Internal("jax.extend.core", "Primitive", _CHUNKED),
    Internal("jax.extend.core", "Primitive.def_effectful_abstract_eval", _CHUNKED),
    Internal("jax.extend.core", "ClosedJaxpr", f"{_BODY}; {_REFS}; {_CHECKS}"),
    Internal("jax.extend.core", "Jaxpr", _CHECKS),
    Internal("jax.extend.core", "JaxprEqn.replace", f"{_RULES}: the jax.checkpoint partial-eval rule"),
    Internal("jax.extend.core", "Literal", _CHECKS),
    Internal("jax.extend.core", "Var", _RULES),
    Internal("jax.extend.core", "jaxpr_as_fun", f"{_BODY}; {_REFS}"),
    Internal(
        "jax.extend.core",
        "get_opaque_trace_state",
        "vmcgrad._sr.qgt.qgt (whether a QGT product runs in the trace that built the operator)",
    ),
    Internal("jax.interpreters.ad", "primitive_jvps", _RULES),
    Internal("jax.interpreters.ad", "primitive_transposes", _RULES),
    Internal("jax.interpreters.ad", "Zero", _RULES),
    Internal("jax.interpreters.ad", "is_undefined_primal", _RULES),
    Internal("jax.interpreters.batching", "primitive_batchers", _RULES),
    Internal("jax.interpreters.mlir", "register_lowering", _CHUNKED),
    Internal("jax.interpreters.mlir", "lower_fun", _CHUNKED),
    Internal("jax.interpreters.partial_eval", "custom_partial_eval_rules", _RULES),
    Internal("jax.interpreters.partial_eval", "partial_eval_jaxpr_custom_rules", _RULES),
    Internal("jax.interpreters.partial_eval", "JaxprTracer.pval", f"{_RULES}: the partial-eval rule"),
    Internal("jax.interpreters.partial_eval", "PartialVal.is_known", f"{_RULES}: the partial-eval rule"),
    Internal("jax.interpreters.partial_eval", "PartialVal.get_known", f"{_RULES}: the partial-eval rule"),
    Internal(
        "jax._src.interpreters.partial_eval",
        "JaxprTrace.default_process_primitive",
        f"{_RULES}: the partial-eval rule",
    ),
    Internal(
        "jax._src.interpreters.partial_eval", "JaxprTrace.new_const", f"{_RULES}: the partial-eval rule"
    ),
    Internal(
        "jax._src.interpreters.partial_eval",
        "SaveableType",
        f"{_RULES}: a jax.checkpoint policy's answer, read by its type name",
    ),
    Internal(
        "jax._src.interpreters.partial_eval",
        "Offloadable",
        f"{_RULES}: a jax.checkpoint policy's answer, read by its type name",
    ),
    Internal("jax.core", "Tracer", "vmcgrad's input checks (is a value traced?)"),
    Internal("jax.core", "ShapedArray", f"{_CHUNKED}; {_RULES}"),
    Internal("jax.core", "eval_jaxpr", f"{_BODY}; {_REFS}"),
    Internal("jax", "new_ref", f"{_RUNNER}; {_REFS}: accumulators written by the loop and by pullbacks"),
    Internal("jax.ref", "freeze", f"{_RUNNER}; {_REFS}: accumulators read back"),
    Internal("jax._src.api", "VJP.with_refs", f"{_REFS}: a chunk's pullback adds into refs"),
    Internal("jax.custom_derivatives", "linear_call", "vmcgrad.netket._qgt (the QGT's iterative solves)"),
    Internal(
        "jax._src.xla_bridge",
        "_jax.make_gloo_tcp_collectives",
        "vmcgrad.initialize_distributed (CPU collectives bound to 127.0.0.1)",
        lazy=True,
    ),
    Internal(
        "jax._src.clusters",
        "ClusterEnv._cluster_types",
        "vmcgrad vmc --distributed auto (the launchers JAX detects, in its order)",
        lazy=True,
    ),
    Internal(
        "jax._src.clusters",
        "ClusterEnv.auto_detect_unset_distributed_params",
        "vmcgrad vmc --distributed auto (the coordinator, process count and id from the launcher)",
        lazy=True,
    ),
)

#: Where the installed JAX defines its primitives (for :func:`missing_primitives`).
PRIMITIVE_MODULES: tuple[str, ...] = (
    "jax.extend.core.primitives",
    "jax._src.lax.lax",
    "jax._src.lax.slicing",
    "jax._src.lax.linalg",
    "jax._src.lax.fft",
    "jax._src.lax.special",
    "jax._src.lax.convolution",
    "jax._src.lax.control_flow.loops",
    "jax._src.lax.control_flow.conditionals",
    "jax._src.lax.parallel",
    "jax._src.ad_util",
    "jax._src.core",
    "jax._src.pjit",
    "jax._src.prng",
)


def _resolve(item: Internal) -> Any:
    """The object ``item`` names; raises ImportError or AttributeError if it is missing."""
    obj = importlib.import_module(item.module)
    for part in item.attr.split("."):
        obj = getattr(obj, part)
    return obj


def missing_internals(table: Iterable[Internal] = INTERNALS, *, lazy: bool = False) -> list[Internal]:
    """The entries of ``table`` the installed JAX lacks (those marked ``lazy`` only if ``lazy``)."""
    missing = []
    for item in table:
        if item.lazy and not lazy:
            continue
        try:
            _resolve(item)
        except (ImportError, AttributeError):
            missing.append(item)
    return missing


def _error(missing: list[Internal]) -> PrivateJaxAPIError:
    lines = "; ".join(f"{m.name} (used by {m.used_by})" for m in missing)
    return PrivateJaxAPIError(
        f"vmcgrad: the installed jax {jax.__version__} lacks {len(missing)} JAX internal"
        f"{'s' if len(missing) > 1 else ''} vmcgrad relies on: {lines}. vmcgrad supports jax "
        f"{SUPPORTED_JAX}. Fix: pip install jax=={SUPPORTED_JAX}, or report this to vmcgrad "
        "with the jax version."
    )


def check_internals(table: Iterable[Internal] = INTERNALS) -> None:
    """Raises :class:`PrivateJaxAPIError` if the installed JAX lacks an entry of ``table``
    (not counting ``lazy`` ones)."""
    missing = missing_internals(table)
    if missing:
        raise _error(missing)


def require(name: str) -> Any:
    """The object of the :data:`INTERNALS` entry ``name`` (module and attribute, dotted), checked
    now: for ``lazy`` entries, at the point of use."""
    (item,) = (i for i in INTERNALS if i.name == name)
    try:
        return _resolve(item)
    except (ImportError, AttributeError):
        raise _error([item]) from None


def jax_primitive_names() -> frozenset[str]:
    """The names of the primitives the installed JAX defines in :data:`PRIMITIVE_MODULES`."""
    from jax.extend.core import Primitive

    names = set()
    for module in PRIMITIVE_MODULES:
        try:
            values = vars(importlib.import_module(module)).values()
        except ImportError:
            continue
        names.update(v.name for v in values if isinstance(v, Primitive))
    return frozenset(names)


def missing_primitives(names: Iterable[str]) -> list[str]:
    """The ``names`` (of primitives vmcgrad matches by string) no primitive of the installed JAX
    has: a rule keyed by one of them is dead, and the primitive it meant, if renamed, is then
    unknown to vmcgrad's analysis (which answers conservatively for unknown primitives)."""
    known = jax_primitive_names()
    return sorted(n for n in names if n not in known)


def gloo_tcp_collectives_module() -> Any:
    """The module holding ``make_gloo_tcp_collectives`` (``jax._src.xla_bridge._jax``)."""
    require("jax._src.xla_bridge._jax.make_gloo_tcp_collectives")
    from jax._src import xla_bridge

    return xla_bridge._jax


def cluster_env() -> Any:
    """JAX's ``ClusterEnv`` (``jax._src.clusters``): the launcher environments that
    ``jax.distributed.initialize()`` detects, in ``ClusterEnv._cluster_types``, and its detection,
    ``ClusterEnv.auto_detect_unset_distributed_params``."""
    require("jax._src.clusters.ClusterEnv._cluster_types")
    require("jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params")
    from jax._src import clusters

    return clusters.ClusterEnv


check_internals()

# what vmcgrad's modules import from here (after the check)
from jax.custom_derivatives import linear_call  # noqa: E402
from jax.extend.core import (  # noqa: E402
    ClosedJaxpr,
    Jaxpr,
    Literal,
    Primitive,
    Var,
    get_opaque_trace_state,
    jaxpr_as_fun,
)
from jax.interpreters import ad, batching, mlir  # noqa: E402
from jax.interpreters import partial_eval as pe  # noqa: E402

__all__ = [
    "INTERNALS",
    "SUPPORTED_JAX",
    "ClosedJaxpr",
    "Internal",
    "Jaxpr",
    "Literal",
    "Primitive",
    "PrivateJaxAPIError",
    "Var",
    "ad",
    "batching",
    "check_internals",
    "cluster_env",
    "get_opaque_trace_state",
    "gloo_tcp_collectives_module",
    "jaxpr_as_fun",
    "linear_call",
    "missing_internals",
    "missing_primitives",
    "mlir",
    "pe",
    "require",
]
