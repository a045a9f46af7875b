"""One chunk's computation as a jaxpr, with its operands and outputs grouped by placement.

The chunked primitive (:mod:`vmcgrad._runner.primitive`) binds flat arrays; everything else in
:mod:`vmcgrad._runner` sees them grouped: :class:`Operands` (replicated, per-sample, per-chunk) and
:class:`Outputs` (summed, per-sample, per-chunk). A :class:`Body` is the chunk function traced once
on one chunk's abstract values, and flattens and unflattens at its edge, so no rule counts
positions in a flat list (the pattern of equinox's ``filter_primitive_*``, written here for the
three placements).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from vmcgrad._jax_private import ClosedJaxpr, jaxpr_as_fun


class Operands(NamedTuple):
    """The primitive's operands (or anything laid out like them: tangents, avals, flags).

    Attributes:
        rep: replicated operands (parameters, tangents, parameter-shaped cotangents).
        samples: per-sample operands (N rows on axis 0; the body sees one chunk of rows).
        chunks: per-chunk operands (every device's chunks on axis 0; the body sees its slot).
    """

    rep: tuple = ()
    samples: tuple = ()
    chunks: tuple = ()

    def flat(self) -> list:
        return [*self.rep, *self.samples, *self.chunks]

    def map(self, f: Callable) -> Operands:
        return Operands(*(tuple(map(f, group)) for group in self))


class Outputs(NamedTuple):
    """The primitive's outputs (or anything laid out like them).

    Attributes:
        sums: summed over the chunks (and reduced once over the devices).
        maps: per-sample outputs (one chunk of rows from the body; N rows from the primitive).
        slots: per-chunk outputs (the chunk's own value; every device's chunks from the primitive).
    """

    sums: tuple = ()
    maps: tuple = ()
    slots: tuple = ()

    def flat(self) -> list:
        return [*self.sums, *self.maps, *self.slots]

    def map(self, f: Callable) -> Outputs:
        return Outputs(*(tuple(map(f, group)) for group in self))


def _group(cls: type, flat: Sequence, sizes: tuple[int, int]) -> Any:
    a, b = sizes
    return cls(tuple(flat[:a]), tuple(flat[a : a + b]), tuple(flat[a + b :]))


@dataclasses.dataclass(frozen=True)
class Body:
    """One chunk's computation: ``jaxpr(*rep, *samples, *chunks, w) -> (*sums, *maps, *slots)``.

    ``w`` is the ``(size,)`` bool row mask. Hashable (the jaxpr by identity), so that it can be a
    primitive parameter.

    Attributes:
        jaxpr: the closed jaxpr, on one chunk's values.
        n_in: how many operands are replicated and per sample (the rest, before ``w``, per chunk).
        n_out: how many outputs are summed and per sample (the rest per chunk).
    """

    jaxpr: ClosedJaxpr
    n_in: tuple[int, int]
    n_out: tuple[int, int]

    def operands(self, flat: Sequence) -> Operands:
        """The primitive's flat operands (without ``w``), grouped."""
        return _group(Operands, flat, self.n_in)

    def outputs(self, flat: Sequence) -> Outputs:
        """The primitive's (or the jaxpr's) flat outputs, grouped."""
        return _group(Outputs, flat, self.n_out)

    @property
    def in_avals(self) -> Operands:
        return self.operands(self.jaxpr.in_avals[:-1])

    @property
    def w_aval(self) -> Any:
        return self.jaxpr.in_avals[-1]

    @property
    def out_avals(self) -> Outputs:
        return self.outputs(self.jaxpr.out_avals)

    def __call__(self, ops: Operands, w: Any) -> Outputs:
        return self.outputs(jaxpr_as_fun(self.jaxpr)(*ops.flat(), w))


_NO_MESH = jax.sharding.AbstractMesh((), ())


def trace_flat(fn: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """``fn``'s closed jaxpr on abstract values, traced with no context mesh (a body runs on one
    device's chunk inside the runner's ``shard_map``)."""
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


def trace(fn: Callable[[Operands, Any], Outputs], avals: Operands, w: Any) -> Body:
    """``fn(ops, w) -> Outputs`` traced once on abstract chunk values (``avals``, ``w``'s aval)."""
    n_in = (len(avals.rep), len(avals.samples))
    n_out = []

    def flat(*args):
        out = fn(_group(Operands, args[:-1], n_in), args[-1])
        n_out.append((len(out.sums), len(out.maps)))
        return out.flat()

    return Body(trace_flat(flat, [*avals.flat(), w]), n_in, n_out[0])


def hoist(fn: Callable[[Operands, Any], Outputs], avals: Operands, w: Any) -> tuple[Body, list[Any]]:
    """:func:`trace`, with the tracers ``fn`` closes over (an outer ``jit`` argument, a ``vmap``
    batch) turned into explicit leading replicated operands, so that their tangents and batch axes
    are not silently dropped. Returns the body and those values."""
    body = trace(fn, avals, w)
    consts = body.jaxpr.consts
    is_tracer = [isinstance(c, jax.core.Tracer) for c in consts]
    hoisted = [c for c, t in zip(consts, is_tracer) if t]
    if not hoisted:
        return body, []

    def explicit(ops, w):
        it = iter(ops.rep[: len(hoisted)])
        values = [next(it) if t else c for c, t in zip(consts, is_tracer)]
        rest = ops._replace(rep=ops.rep[len(hoisted) :])
        return body.outputs(jax.core.eval_jaxpr(body.jaxpr.jaxpr, values, *rest.flat(), w))

    avals = avals._replace(rep=(*(jax.typeof(h) for h in hoisted), *avals.rep))
    return trace(explicit, avals, w), hoisted
