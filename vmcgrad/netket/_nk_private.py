"""Every NetKet name vmcgrad uses that is not NetKet's documented API, in one place, checked on import.

``vmcgrad.netket`` subclasses NetKet's ``MCState`` and calls NetKet's own kernels, so it reads a few
of NetKet's private attributes and functions that NetKet does not re-export:

- ``MCState._apply_fun`` (the model's apply function, as NetKet's kernels take it),
  ``MCState._chunk_size`` (NetKet's own chunk size, under its ``chunk_size`` property),
  ``MCState._samples`` (the samples if drawn: reading ``samples`` draws them),
  ``MCState._replace_model`` (what NetKet calls to copy a state with another model);
- ``netket.vqs.mc.mc_state.state.serialize_MCState`` / ``deserialize_MCState`` (flax
  serialization of an ``MCState``), ``netket.vqs.mc.common.local_estimators``, and the jitted
  program of its ``MCState`` implementation
  (``netket.vqs.mc.mc_state.local_estimators._local_estimators_impl``: compiled at candidate chunks).

Each is looked up here once, when ``vmcgrad.netket`` is imported, so that a NetKet release that
moves one fails at once with vmcgrad's name, what moved, and the fix — not with an
``AttributeError`` deep in a driver step. The range of NetKet releases vmcgrad is tested with is
:data:`TESTED_NETKET` (the same bound as ``setup.cfg``; ``tests/test_package.py`` checks both).

NetKet's ``MCState`` class itself is kept here as :data:`NetKetMCState`, taken when this module is
imported: a script that rebinds ``nk.vqs.MCState = vmcgrad.netket.MCState`` to switch every state
at once still reaches NetKet's own class (its ``chunk_size`` setter, its ``isinstance`` checks).
"""

from __future__ import annotations

import importlib
from typing import Any

import netket as nk

#: The NetKet releases vmcgrad.netket is tested with (``setup.cfg``'s pin of the ``netket`` extras).
TESTED_NETKET = ">=3.23,<3.24"

#: Private attributes of NetKet's ``MCState`` class used here: name -> what vmcgrad needs it for.
MCSTATE_PRIVATE = {
    "_apply_fun": "the model's apply function NetKet's kernels take",
    "_chunk_size": "NetKet's own chunk size under its chunk_size property",
    "_samples": "the samples if drawn, without drawing them",
    "_replace_model": "copying a state with another model",
}

#: Functions from NetKet modules it does not re-export: (module, name).
FUNCTIONS = (
    ("netket.vqs.mc.mc_state.state", "serialize_MCState"),
    ("netket.vqs.mc.mc_state.state", "deserialize_MCState"),
    ("netket.vqs.mc.common", "local_estimators"),
    ("netket.vqs.mc.mc_state.local_estimators", "_local_estimators_impl"),
)


class NetKetVersionError(ImportError):
    """The installed NetKet lacks a private name vmcgrad.netket relies on (it moved or was renamed)."""


def _has_class_attribute(cls: type, name: str) -> bool:
    """``name`` is defined on ``cls`` or a base: as an attribute, or as an annotation only."""
    return any(name in vars(c) or name in vars(c).get("__annotations__", {}) for c in cls.__mro__)


def missing(mcstate: type, functions: tuple[tuple[str, str], ...] = FUNCTIONS) -> list[str]:
    """What of :data:`MCSTATE_PRIVATE` and ``functions`` the given NetKet lacks, in words (empty: none)."""
    gone = [
        f"netket.vqs.MCState.{name} ({why})"
        for name, why in MCSTATE_PRIVATE.items()
        if not _has_class_attribute(mcstate, name)
    ]
    prop = getattr(mcstate, "chunk_size", None)
    if not (isinstance(prop, property) and prop.fset is not None):
        gone.append("netket.vqs.MCState.chunk_size as a settable property")
    for module, name in functions:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            gone.append(f"{module}.{name}")
    return gone


def check(mcstate: type, version: str, functions: tuple[tuple[str, str], ...] = FUNCTIONS) -> None:
    """Raises :class:`NetKetVersionError` naming what is missing from this NetKet, and the fix.

    Raises:
        NetKetVersionError: if :func:`missing` finds anything.
    """
    gone = missing(mcstate, functions)
    if gone:
        raise NetKetVersionError(
            f"vmcgrad.netket: NetKet {version} lacks {', '.join(gone)}, which vmcgrad.netket uses (it is "
            f"tested with netket{TESTED_NETKET}). Fix: pip install 'netket{TESTED_NETKET}', or a vmcgrad "
            "release that supports this NetKet."
        )


check(nk.vqs.MCState, nk.__version__)

#: NetKet's own ``MCState`` class, as it was when vmcgrad.netket was imported.
NetKetMCState: type = nk.vqs.MCState

from netket.vqs.mc.common import local_estimators as local_estimators  # noqa: E402
from netket.vqs.mc.mc_state.local_estimators import _local_estimators_impl  # noqa: E402
from netket.vqs.mc.mc_state.state import deserialize_MCState as deserialize_MCState  # noqa: E402
from netket.vqs.mc.mc_state.state import serialize_MCState as serialize_MCState  # noqa: E402

#: NetKet's jitted program of ``MCState.local_estimators``: ``(kernel, apply_fun, shape, variables, σ,
#: args) -> values`` (its first three arguments static).
local_estimators_impl = _local_estimators_impl


def apply_fun(vstate: Any) -> Any:
    """The state's model apply function, ``apply(variables, x)`` (NetKet's ``vstate._apply_fun``)."""
    return vstate._apply_fun


def own_chunk_size(vstate: Any) -> int | None:
    """NetKet's own chunk size of the state (``vstate._chunk_size``), not the one its property reads."""
    return vstate._chunk_size


def drawn_samples(vstate: Any) -> Any:
    """The state's samples if they are drawn, else None (``vstate._samples``; ``vstate.samples`` would
    draw them)."""
    return vstate._samples


def set_own_chunk_size(vstate: Any, chunk_size: int | None) -> None:
    """NetKet's own ``chunk_size`` setter (its checks included) on ``vstate``."""
    NetKetMCState.chunk_size.fset(vstate, chunk_size)


def replace_model(vstate: Any, model: Any, apply_fun: Any, variables: Any) -> Any:
    """NetKet's ``MCState._replace_model`` on ``vstate``: a copy with another model."""
    return NetKetMCState._replace_model(vstate, model, apply_fun=apply_fun, variables=variables)
