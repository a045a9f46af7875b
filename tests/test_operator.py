"""The operators' shared base, :class:`vmcgrad._sr.base.AbstractOperator`: both
:class:`vmcgrad.QGTOperator` and :class:`vmcgrad.NTKOperator` are immutable pytrees with the same
accessors, the same ``replace`` of their shifts (checked, refused for anything else) and the same
``chunk_size="auto"`` resolution.

The products themselves are tested against dense Jacobians in test_qgt.py and test_ntk.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vmcgrad
from vmcgrad._sr.base import AbstractOperator

N = 10


def logpsi(w, x):
    return jnp.tanh(x @ w)


def _inputs():
    return jnp.ones(3) / 4, jnp.arange(3.0 * N).reshape(N, 3) / (3 * N)


@pytest.mark.parametrize("build", [vmcgrad.QGT, vmcgrad.NTK], ids=["QGT", "NTK"])
def test_the_operators_share_the_base(build):
    w, x = _inputs()
    A = build(logpsi, w, x, chunk_size=4, diag_shift=0.1)
    assert isinstance(A, AbstractOperator)
    np.testing.assert_array_equal(A.params, w)
    np.testing.assert_array_equal(A.samples, x)
    assert A.n_samples == N and A.chunk_size == 4

    # a pytree: the leaves round-trip, the problem and the mode are static (in the treedef)
    leaves, treedef = jax.tree.flatten(A)
    B = jax.tree.unflatten(treedef, leaves)
    assert type(B) is type(A) and B.problem == A.problem and B.mode == A.mode == "real"
    assert not any(leaf is A.problem for leaf in leaves)

    name = type(A).__name__
    # the QGT's static product design; the NTK's Jacobian batch (None: the whole chunk)
    design = ", design='fused'" if build is vmcgrad.QGT else ", jacobian_batch=None"
    assert re.fullmatch(
        rf"{name}\(mode='real', dim={A.dim}, n_samples={N}, chunk_size=4{design}, diag_shift=0\.1.*\)",
        repr(A),
    )

    # replace: a new operator with the new shift, the old one unchanged
    v = jnp.linspace(0.5, 1.5, A.dim)
    A2 = A.replace(diag_shift=0.5)
    assert float(A.diag_shift) == 0.1 and float(A2.diag_shift) == 0.5
    np.testing.assert_allclose(A2 @ v - A @ v, 0.4 * v, rtol=1e-12, atol=1e-14)
    with pytest.raises(
        TypeError, match=rf"vmcgrad\.{name[:-8]}\.replace: only `diag_shift`.* got \['mode'\]"
    ):
        A.replace(mode="complex")
    with pytest.raises(ValueError, match=rf"vmcgrad\.{name[:-8]}\.replace: `diag_shift`"):
        A.replace(diag_shift=-1.0)


@pytest.mark.parametrize("build", [vmcgrad.QGT, vmcgrad.NTK], ids=["QGT", "NTK"])
def test_auto_chunk_size_resolves_to_a_chunk(build):
    """``chunk_size="auto"`` resolves to the largest power of two, at most the samples per device,
    whose sizing program (compiled, not run) needs at most ``memory_budget`` bytes per device
    (temporaries, arguments and outputs: :func:`vmcgrad._chunks.budget.program_bytes`): that chunk
    fits, twice it does not. The budget is the program's own bytes at chunk 8 of 64 rows (samples
    on one device), so the answer is neither 1 nor all rows."""
    from vmcgrad._chunks.budget import program_bytes

    def wide(w, x):  # per-chunk temporaries of 32 values a row: the bytes grow with the chunk
        return jnp.tanh(x @ w).sum(-1)

    w, x = jnp.linspace(0.1, 0.4, 96).reshape(3, 32), jnp.arange(3.0 * 64).reshape(64, 3) / (3 * 64)

    def sized_bytes(A, chunk):
        program, prob, *args = A._sizing_call()
        return program_bytes(program.lower(prob.at_chunk(chunk), *args).compile())

    budget = sized_bytes(build(wide, w, x, chunk_size=8), 8)
    A = build(wide, w, x, chunk_size="auto", memory_budget=budget)
    assert A.problem.chunk_size == "auto" and A.problem.n_local == 64
    c = A.chunk_size
    if build is vmcgrad.QGT:
        assert isinstance(c, int) and c & (c - 1) == 0 and 8 <= c < 64, (build.__name__, c)
        assert sized_bytes(A, c) <= budget < sized_bytes(A, 2 * c)
        return
    # the dense kernel's choice (ntk_dense.choose_dense, tests/test_ntk.py): the powers of two fix the
    # Jacobian batch, then the fewer, larger chunks ceil(64/m) are searched at that batch
    from vmcgrad._sr.ntk.dense import choose_dense

    chunk, (op,) = choose_dense(*A._sizing_call())
    fewer = sorted({-(-64 // m) for m in range(1, 65)})
    assert chunk == c and c in fewer and 8 <= c < 64 and op.jacobian_batch is not None, (c, op)
    assert sized_bytes(op, c) <= budget < sized_bytes(op, fewer[fewer.index(c) + 1])
