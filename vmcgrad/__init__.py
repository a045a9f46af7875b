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
    "QGT": "vmcgrad._sr.qgt.qgt",
    "CGInfo": "vmcgrad._sr.solve",
    "CollectiveReport": "vmcgrad._hlo.collectives",
    "LinearizedQGT": "vmcgrad._sr.qgt.linearized",
    "NTK": "vmcgrad._sr.ntk.ntk",
    "NTKOperator": "vmcgrad._sr.ntk.ntk",
    "ProgramCost": "vmcgrad._hlo.cost",
    "QGTOperator": "vmcgrad._sr.qgt.qgt",
    "VmcgradWarning": "vmcgrad._warnings",
    "auto_chunk_size": "vmcgrad._auto_chunk_size",
    "batched_jvp": "vmcgrad._estimators.jvp",
    "batched_vjp": "vmcgrad._estimators.vjp",
    "collective_report": "vmcgrad._hlo.collectives",
    "cost_platform": "vmcgrad._hlo.platform",
    "expect_grad": "vmcgrad._estimators.grad",
    "initialize_distributed": "vmcgrad._distributed",
    "lower": "vmcgrad._estimators.lower",
    "minsr_update": "vmcgrad._sr.ntk.minsr",
    "program_cost": "vmcgrad._hlo.cost",
    "program_bytes": "vmcgrad._chunks.budget",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vmcgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from vmcgrad._auto_chunk_size import auto_chunk_size as auto_chunk_size
    from vmcgrad._chunks.budget import program_bytes as program_bytes
    from vmcgrad._distributed import initialize_distributed as initialize_distributed
    from vmcgrad._estimators.grad import expect_grad as expect_grad
    from vmcgrad._estimators.jvp import batched_jvp as batched_jvp
    from vmcgrad._estimators.lower import lower as lower
    from vmcgrad._estimators.vjp import batched_vjp as batched_vjp
    from vmcgrad._hlo.collectives import CollectiveReport as CollectiveReport
    from vmcgrad._hlo.collectives import collective_report as collective_report
    from vmcgrad._hlo.cost import ProgramCost as ProgramCost
    from vmcgrad._hlo.cost import program_cost as program_cost
    from vmcgrad._hlo.platform import cost_platform as cost_platform
    from vmcgrad._sr.ntk.minsr import minsr_update as minsr_update
    from vmcgrad._sr.ntk.ntk import NTK as NTK
    from vmcgrad._sr.ntk.ntk import NTKOperator as NTKOperator
    from vmcgrad._sr.qgt.linearized import LinearizedQGT as LinearizedQGT
    from vmcgrad._sr.qgt.qgt import QGT as QGT
    from vmcgrad._sr.qgt.qgt import QGTOperator as QGTOperator
    from vmcgrad._sr.solve import CGInfo as CGInfo
    from vmcgrad._warnings import VmcgradWarning as VmcgradWarning
