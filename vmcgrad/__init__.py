"""vmcgrad: chunked, sharded, once-reduced per-sample derivatives for variational Monte Carlo."""

from ._auto import auto_chunk_size as auto_chunk_size
from ._auto_chunk import program_bytes as program_bytes
from ._distributed import initialize_distributed as initialize_distributed
from ._grad import expect_grad as expect_grad
from ._hlo import CollectiveReport as CollectiveReport
from ._hlo import collective_report as collective_report
from ._jvp import batched_jvp as batched_jvp
from ._ntk import NTK as NTK
from ._ntk import NTKOperator as NTKOperator
from ._ntk import minsr_update as minsr_update
from ._problem import lower as lower
from ._qgt import QGT as QGT
from ._qgt import QGTOperator as QGTOperator
from ._qgt_linearized import LinearizedQGT as LinearizedQGT
from ._solve import CGInfo as CGInfo
from ._vjp import batched_vjp as batched_vjp

__version__ = "0.1.0"

__all__ = [
    "NTK",
    "QGT",
    "CGInfo",
    "CollectiveReport",
    "LinearizedQGT",
    "NTKOperator",
    "QGTOperator",
    "auto_chunk_size",
    "batched_jvp",
    "batched_vjp",
    "collective_report",
    "expect_grad",
    "initialize_distributed",
    "lower",
    "minsr_update",
    "program_bytes",
]
