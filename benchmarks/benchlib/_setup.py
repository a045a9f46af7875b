r"""What the benchmarks share: a NetKet model with its samples placed as NetKet places them, the
``logpsi`` vmcgrad differentiates, and NetKet's own force computation, each written once.

NetKet's force is computed as its ``expect_and_grad`` computes it (``netket/vqs/mc/mc_state/
expect_forces_chunked.py`` and ``expect_forces.py``, then ``force_to_grad`` of ``netket/vqs/mc/
common.py``):

.. math::

    F = \sum_i \overline{O_i}\, c_i, \qquad
    c_i = \frac{\overline{L_i - \bar L}}{N}\ \text{(the VMC gradient)}, \qquad
    g = 2F \text{ (complex leaves)},\ 2\,\mathrm{Re}\,F \text{ (real leaves)}.

NetKet is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def netket_mesh() -> Any:
    """NetKet's global mesh (axis ``"S"``), or None when there is none (one device, no mesh set)."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def sample_sharding() -> Any:
    """``NamedSharding(mesh, P("S"))`` on NetKet's mesh (samples along chains), or None."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = netket_mesh()
    return None if mesh is None else NamedSharding(mesh, P("S"))


def place(per_sample: Any, replicated: Any) -> tuple[Any, Any]:
    """``per_sample`` sharded ``P("S")`` and ``replicated`` replicated on NetKet's mesh (as is
    without one)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = netket_mesh()
    if mesh is None:
        return per_sample, replicated
    return (
        jax.device_put(per_sample, NamedSharding(mesh, P("S"))),
        jax.device_put(replicated, NamedSharding(mesh, P())),
    )


def init_model(model: Any, L: int, n_samples: int, seed: int = 0) -> dict[str, Any]:
    """Random spin-½ samples of L sites and the model's parameters, unplaced.

    Returns:
        ``{"samples", "params", "model_state", "key"}``: ``key`` is left for the caller's other
        random inputs.
    """
    import netket as nk

    hi = nk.hilbert.Spin(0.5, L)
    k_s, k_p, key = jax.random.split(jax.random.key(seed), 3)
    samples = hi.random_state(k_s, n_samples)
    variables = model.init(k_p, samples[:2])
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return {"samples": samples, "params": params, "model_state": model_state, "key": key}


def log_psi(apply: Any, model_state: Any) -> Any:
    """``logpsi(params, x) = apply({"params": params, **model_state}, x)``, the model state traced
    data (a ``Partial``): :mod:`vmcgrad.netket`'s own, as it passes it to the core."""
    from vmcgrad.netket._expect_grad import log_psi  # NetKet is imported where it is needed

    return log_psi(apply, model_state)


def centred(local_values: jax.Array) -> jax.Array:
    r"""The cotangent of the VMC gradient, :math:`\overline{L_i - \bar L} / N`."""
    return jnp.conj(local_values - jnp.mean(local_values)) / local_values.shape[0]


def netket_force(
    apply: Any, params: Any, model_state: Any, samples: Any, cotangent: Any, chunk_size: int | None
) -> Any:
    r""":math:`\sum_i \overline{O_i} c_i` as NetKet computes it: ``nk.jax.vjp_chunked(...,
    conjugate=True, chunk_size=c, chunk_argnums=2, nondiff_argnums=(1, 2))`` (its chunked force,
    ``MCState(chunk_size=c)``), or ``nk.jax.vjp(..., conjugate=True)`` over all samples when
    ``chunk_size`` is None (``MCState(chunk_size=None)``)."""
    import netket.jax as nkjax

    if chunk_size is None:  # forces_expect_hermitian
        _, vjp_fun = nkjax.vjp(lambda w: apply({"params": w, **model_state}, samples), params, conjugate=True)
    else:  # forces_expect_hermitian_chunked
        vjp_fun = nkjax.vjp_chunked(
            lambda w, ms, x: apply({"params": w, **ms}, x),
            params,
            model_state,
            samples,
            conjugate=True,
            chunk_size=chunk_size,
            chunk_argnums=2,
            nondiff_argnums=(1, 2),
        )
    (force,) = vjp_fun(cotangent)
    return force


def netket_grad(
    apply: Any, params: Any, model_state: Any, samples: Any, local_values: Any, chunk_size: int | None
) -> Any:
    """NetKet's VMC gradient from the local values: centre, :func:`netket_force`, ``force_to_grad``."""
    from netket.vqs.mc.common import force_to_grad

    force = netket_force(apply, params, model_state, samples, centred(local_values), chunk_size)
    return force_to_grad(force, params)
