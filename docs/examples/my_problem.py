"""A problem of one's own for ``vmcgrad vmc``: an XXZ chain and a small flax network.

Run it from the repository's root::

    vmcgrad vmc --system docs/examples/my_problem.py:system --model docs/examples/my_problem.py:model

Each factory is called with no arguments. ``system()`` returns a dict with the Hilbert space and the
Hamiltonian, and here the graph as well (the Hilbert space has a constraint, total Sz = 0, so the
sampler exchanges spins along the graph's edges). It gives no exact energy, so the run reports the
V-score. ``model()`` returns a flax module that maps a batch of configurations, shape
``(n, n_sites)``, to ``n`` log-amplitudes.
"""

import flax.linen as nn
import jax.numpy as jnp
import netket as nk
import numpy as np

N_SITES = 10
DELTA = 2.0  # the Ising anisotropy: H = sum over bonds of DELTA σzσz + σxσx + σyσy


def system():
    """The XXZ chain of ``N_SITES`` spins, periodic, total Sz = 0, after Marshall's sign rule.

    On a bipartite lattice, rotating every second spin by π about z changes the sign of the σxσx + σyσy
    terms and leaves the spectrum unchanged; the ground state then has positive amplitudes, which the
    real network below can represent.
    """
    graph = nk.graph.Chain(N_SITES, pbc=True)
    hilbert = nk.hilbert.Spin(0.5, N=N_SITES, total_sz=0)
    zz = np.diag([1.0, -1.0, -1.0, 1.0])
    flip = np.zeros((4, 4))
    flip[1, 2] = flip[2, 1] = 2.0  # σxσx + σyσy on the basis |↑↑>, |↑↓>, |↓↑>, |↓↓>
    bond = DELTA * zz - flip  # Marshall's sign rule: the exchange term with a minus sign
    hamiltonian = nk.operator.GraphOperator(hilbert, graph, bond_ops=[bond])
    return {"hilbert": hilbert, "hamiltonian": hamiltonian, "graph": graph}


class LogCoshNet(nn.Module):
    """log ψ(σ) = Σ_j log cosh(W σ + b)_j: one real log-amplitude per configuration."""

    features: int = 20

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.features, param_dtype=jnp.float64, kernel_init=nn.initializers.normal(0.01))(x)
        return jnp.sum(jnp.log(jnp.cosh(h)), axis=-1)


def model():
    """The network, with 2 hidden units per site."""
    return LogCoshNet(features=2 * N_SITES)
