r"""A small vision-transformer ansatz for spins on an ``L × L`` lattice (flax.linen), for benchmarks.

The lattice is cut into ``(L/p)²`` square patches of ``p × p`` spins; each patch is a token. With
:math:`x \in \{-1, 1\}^{L^2}` and tokens :math:`t_k \in \mathbb R^{p^2}`:

.. math::

    h^{(0)}_k = W_e t_k + b_e + e_k, \qquad
    h^{(l+1)} = h' + \mathrm{MLP}(\mathrm{LN}(h')),\quad
    h' = h^{(l)} + \mathrm{MHA}(\mathrm{LN}(h^{(l)})),

    \log\psi(x) = a + i b,\qquad (a, b) = W_o \sum_k \mathrm{LN}(h^{(D)})_k + b_o ,

with learned positional embeddings :math:`e_k`, ``depth`` pre-norm blocks :math:`D`, a GELU MLP of
width ``mlp_ratio · embed``, and a complex output from real parameters. For ``L=6, patch=2,
embed=64, depth=2`` (9 tokens) it has :math:`P = 100\,354` parameters.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class ViT(nn.Module):
    """Patch transformer ``log ψ``; ``__call__(x)`` maps ``(batch, L*L)`` spins to ``(batch,)`` complex."""

    L: int = 6
    patch: int = 2
    embed: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    param_dtype: Any = jnp.float64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        L, p = self.L, self.patch
        if L % p:
            raise ValueError(f"ViT: patch={p} must divide L={L}")
        dt = self.param_dtype
        b = x.shape[0]
        n = L // p
        tokens = x.reshape(b, n, p, n, p).transpose(0, 1, 3, 2, 4).reshape(b, n * n, p * p).astype(dt)
        h = nn.Dense(self.embed, param_dtype=dt, dtype=dt, name="embed")(tokens)
        h = h + self.param("pos", nn.initializers.normal(0.02), (n * n, self.embed), dt)
        for i in range(self.depth):
            y = nn.LayerNorm(param_dtype=dt, dtype=dt, name=f"ln_attn_{i}")(h)
            y = nn.MultiHeadDotProductAttention(
                num_heads=self.heads, param_dtype=dt, dtype=dt, name=f"attn_{i}"
            )(y, y)
            h = h + y
            y = nn.LayerNorm(param_dtype=dt, dtype=dt, name=f"ln_mlp_{i}")(h)
            y = nn.Dense(self.mlp_ratio * self.embed, param_dtype=dt, dtype=dt, name=f"mlp_in_{i}")(y)
            y = nn.Dense(self.embed, param_dtype=dt, dtype=dt, name=f"mlp_out_{i}")(nn.gelu(y))
            h = h + y
        h = nn.LayerNorm(param_dtype=dt, dtype=dt, name="ln_out")(h).sum(axis=1)
        out = nn.Dense(2, param_dtype=dt, dtype=dt, kernel_init=nn.initializers.normal(0.01), name="head")(h)
        return jax.lax.complex(out[:, 0], out[:, 1])
