"""vmcgrad: chunked, sharded, once-reduced per-sample derivatives for variational Monte Carlo.

The public names are imported on first use (PEP 562 ``__getattr__``): ``import vmcgrad`` itself
imports no JAX, so that the ``vmcgrad`` command line answers ``--help`` without starting JAX;
``vmcgrad.batched_vjp`` (or ``from vmcgrad import batched_vjp``) imports what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the private module that defines it.
_EXPORTS = {
    "QGT": "._qgt",
    "CGInfo": "._solve",
    "CollectiveReport": "._hlo",
    "LinearizedQGT": "._qgt_linearized",
    "NTK": "._ntk",
    "NTKOperator": "._ntk",
    "QGTOperator": "._qgt",
    "VmcgradWarning": "._warnings",
    "auto_chunk_size": "._auto",
    "batched_jvp": "._jvp",
    "batched_vjp": "._vjp",
    "collective_report": "._hlo",
    "expect_grad": "._grad",
    "initialize_distributed": "._distributed",
    "lower": "._lower",
    "minsr_update": "._ntk",
    "program_bytes": "._auto_chunk",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vmcgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ._auto import auto_chunk_size as auto_chunk_size
    from ._auto_chunk import program_bytes as program_bytes
    from ._distributed import initialize_distributed as initialize_distributed
    from ._grad import expect_grad as expect_grad
    from ._hlo import CollectiveReport as CollectiveReport
    from ._hlo import collective_report as collective_report
    from ._jvp import batched_jvp as batched_jvp
    from ._lower import lower as lower
    from ._ntk import NTK as NTK
    from ._ntk import NTKOperator as NTKOperator
    from ._ntk import minsr_update as minsr_update
    from ._qgt import QGT as QGT
    from ._qgt import QGTOperator as QGTOperator
    from ._qgt_linearized import LinearizedQGT as LinearizedQGT
    from ._solve import CGInfo as CGInfo
    from ._vjp import batched_vjp as batched_vjp
    from ._warnings import VmcgradWarning as VmcgradWarning
