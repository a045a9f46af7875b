r"""``AbstractOperator``: what the operators built over N samples share (:class:`vmcgrad.QGTOperator`
and :class:`vmcgrad.LinearizedQGT`, through :class:`vmcgrad._sr.qgt.abstract.AbstractQGT`, and
:class:`vmcgrad.NTKOperator`).

As lineax's ``AbstractLinearOperator``: an immutable pytree that is a linear map, applied with
``A @ v``, materialised with ``A.to_dense()``, solved with ``A.solve(b)``, its diagonal shift written
out (:math:`A + \epsilon\,\mathbb 1` with :math:`\epsilon` = ``diag_shift``, a leaf). Every operator here is
taken at one parameter point over one set of samples: the parameters, the samples, the model state of a
``Partial`` function and the shifts are leaves (rebuilding it every step does not recompile); the
function's code, the chunk size, the mode and the sample mesh axis are static (its
:class:`~vmcgrad._problem.problem.Problem` and ``mode``). A subclass says what its matrix is (:attr:`dim`,
``@``, :meth:`to_dense`, :meth:`solve`) and which program sizes ``chunk_size="auto"``. As in
equinox, a class here is abstract or final: concrete operators do not derive from each other
(``tests/test_qgt.py::test_kept_linearisations_share_the_operators_methods``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax

from vmcgrad._problem import validation as check
from vmcgrad._problem.problem import Inputs, Problem, auto_chunk


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class AbstractOperator(abc.ABC):
    r"""A linear operator over N samples, shifted by :math:`\epsilon_2` = ``diag_shift`` on its diagonal.

    Subclasses are frozen keyword-only dataclasses (``repr=False``, this class writes the repr)
    registered with ``jax.tree_util.register_dataclass``.

    Attributes:
        inputs: the function's data, the parameters and the samples (leaves).
        diag_shift: the shift :math:`\epsilon_2 \ge 0` added to the diagonal (a 0-d leaf).
        problem: the static problem: function, N, chunk size, sample mesh axis.
        mode: the static representation of the matrix (its values depend on the operator).
    """

    #: The leaves :meth:`replace` takes: the shifts (anything else needs a new operator).
    _shifts: ClassVar[tuple[str, ...]] = ("diag_shift",)
    #: The public builder, named in messages.
    _builder: ClassVar[str]
    #: static fields the repr shows after the chunk size (e.g. the QGT's product design)
    _described: ClassVar[tuple[str, ...]] = ()

    inputs: Inputs
    diag_shift: jax.Array
    problem: Problem = dataclasses.field(metadata={"static": True})
    mode: str = dataclasses.field(metadata={"static": True})

    @property
    def params(self) -> Any:
        """The parameters the operator is taken at."""
        return self.inputs.params

    @property
    def samples(self) -> Any:
        """The samples :math:`\\sigma_1..\\sigma_N`."""
        return self.inputs.samples

    @property
    def n_samples(self) -> int:
        """N, the number of samples."""
        return self.problem.n

    @property
    def chunk_size(self) -> int | None:
        """Samples per chunk on each device (for ``chunk_size="auto"``, chosen here: the largest power
        of two whose sizing program fits the memory budget, unless the operator chooses otherwise,
        :meth:`_auto_chunk`)."""
        if self.problem.chunk_size != "auto":
            return self.problem.chunk_size
        return self._auto_chunk()

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """The side of the (square) matrix."""

    @abc.abstractmethod
    def __matmul__(self, v: Any) -> Any:
        """The product with a vector, one pass over the samples."""

    @abc.abstractmethod
    def to_dense(self) -> jax.Array:
        """The ``(dim, dim)`` matrix."""

    @abc.abstractmethod
    def solve(self, b: Any, **options: Any) -> tuple[Any, Any]:
        """``(x, info)`` with ``x`` the solution of ``A x = b``."""

    def replace(self, **changes: Any) -> AbstractOperator:
        """A copy with new shifts (``_shifts``), each checked as the builder checks it."""
        where = f"{self._builder}.replace"
        bad = set(changes) - set(self._shifts)
        if bad:
            names = " and ".join(f"`{name}`" for name in self._shifts)
            raise TypeError(
                f"{where}: only {names} can be replaced; got {sorted(bad)}. "
                f"Fix: build a new operator with {self._builder} for new parameters or samples."
            )
        return dataclasses.replace(self, **{k: self._check_shift(where, k, v) for k, v in changes.items()})

    def __repr__(self) -> str:
        described = "".join(f", {name}={getattr(self, name)!r}" for name in self._described)
        shifts = "".join(f", {name}={getattr(self, name)}" for name in self._shifts)
        return (
            f"{type(self).__name__}(mode={self.mode!r}, dim={self.dim}, n_samples={self.n_samples}, "
            f"chunk_size={self.problem.chunk_size}{described}{shifts})"
        )

    # --- for subclasses and their compiled programs ------------------------------------------------

    @property
    @abc.abstractmethod
    def _real_dtype(self) -> Any:
        """The real dtype of the shifts."""

    @abc.abstractmethod
    def _sizing_call(self) -> tuple:
        """``(program, problem, *args)``: the compiled program whose memory ``chunk_size="auto"`` sizes."""

    def _auto_chunk(self) -> int:
        """What ``chunk_size="auto"`` chooses for the sizing program (compile only)."""
        return auto_chunk(*self._sizing_call())

    def _check_shift(self, where: str, name: str, value: Any) -> Any:
        """A shift: a finite real number >= 0 (checked when concrete), a 0-d array of ``_real_dtype``."""
        return check.check_nonnegative_scalar(where, name, value, self._real_dtype)

    def _at(self, prob: Problem) -> AbstractOperator:
        """Itself with the static problem ``prob`` (a compiled program's, its chunk size resolved)."""
        return dataclasses.replace(self, problem=prob)
