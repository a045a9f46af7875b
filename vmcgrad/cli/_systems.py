"""The lattice models and networks ``vmcgrad vmc`` knows, their exact ground-state energies, and the
V-score of a run whose exact energy is unknown.

Energies are in NetKet's units: ``nk.operator.Heisenberg`` uses Pauli matrices, so its energies are 4× the
spin-½ :math:`\\vec S_i\\cdot\\vec S_j` values. NetKet is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SYSTEMS = ("heisenberg1d", "heisenberg2d", "ising1d", "j1j2")
MODELS = ("rbm", "rbm-phase", "mlp", "rbm-symm", "gcnn")

#: One line per model for ``--help`` and the README.
MODEL_HELP = {
    "rbm": "real RBM, alpha 1",
    "rbm-phase": "RBM with modulus and phase (real parameters, complex log ψ), alpha 1",
    "mlp": "real MLP, hidden layers 2N and N, log-cosh",
    "rbm-symm": "real RBM symmetric under the lattice's translations (nk.models.RBMSymm), 4 filters",
    "gcnn": "group-convolutional network over the space group (nk.models.GCNN), 2 layers of 4 features",
}

#: Each model's class and options, as :func:`make_model` builds it (recorded in ``run.json``).
MODEL_OPTIONS = {
    "rbm": {"type": "netket.models.RBM", "alpha": 1, "param_dtype": "float64"},
    "rbm-phase": {"type": "netket.models.RBMModPhase", "alpha": 1, "param_dtype": "float64"},
    "mlp": {
        "type": "netket.models.MLP",
        "hidden_dims_alpha": [2, 1],
        "hidden_activations": "netket.nn.activation.log_cosh",
        "param_dtype": "float64",
    },
    "rbm-symm": {
        "type": "netket.models.RBMSymm",
        "symmetries": "graph.translation_group()",
        "alpha": 4,
        "param_dtype": "float64",
        "kernel_init": "jax.nn.initializers.normal(0.01)",
    },
    "gcnn": {
        "type": "netket.models.GCNN",
        "symmetries": "graph.space_group()",
        "layers": 2,
        "features": 4,
        "param_dtype": "float64",
    },
}

#: Per-system defaults of the ``vmcgrad vmc`` options left at :data:`PER_SYSTEM`. The square lattices use
#: the translation-symmetric RBM, whose first SR steps kick it off the lattice's near-uniform start unless
#: the learning rate is small: with these values the energy goes down from the first step
#: (tests/test_cli_systems.py).
_CHAIN = {"L": 16, "model": "rbm", "samples": 1024, "chunk_size": 256, "lr": 0.03, "diag_shift": 0.01}
_SQUARE = {"L": 4, "model": "rbm-symm", "samples": 1024, "chunk_size": 256, "lr": 0.005, "diag_shift": 0.01}
DEFAULTS = {"heisenberg1d": _CHAIN, "ising1d": _CHAIN, "heisenberg2d": _SQUARE, "j1j2": _SQUARE}
#: The defaults with a user's ``--system MODULE:FACTORY`` (its size is the factory's).
USER_DEFAULTS = {k: v for k, v in _CHAIN.items() if k != "L"}


class _PerSystem:
    """The argparse default of the options in :data:`DEFAULTS`; ``--help`` prints its repr."""

    def __repr__(self) -> str:
        return "per system, see below"


#: Default of the ``vmcgrad vmc`` options that :func:`fill_defaults` sets from :data:`DEFAULTS`.
PER_SYSTEM = _PerSystem()


def fill_defaults(args) -> None:
    """Sets every option in :data:`DEFAULTS` (:data:`USER_DEFAULTS` for a user's system, whose ``L`` is
    then None unless given) that ``args`` leaves at :data:`PER_SYSTEM` (or None)."""
    user = is_user_system(args.system)
    for name, value in (USER_DEFAULTS if user else DEFAULTS[args.system]).items():
        if getattr(args, name) is PER_SYSTEM or getattr(args, name) is None:
            setattr(args, name, value)
    if user and args.L is PER_SYSTEM:
        args.L = None


def is_user_system(system: str) -> bool:
    """Whether ``--system`` names a user's factory (``MODULE:FACTORY``) rather than a built-in system."""
    return ":" in system


def defaults_help() -> str:
    """The ``--help`` epilog: the models, then the defaults of each system (one sentence each)."""
    models = "; ".join(f"{name}: {text}" for name, text in MODEL_HELP.items())
    systems = "; ".join(
        f"{system}: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for system, values in DEFAULTS.items()
    )
    return f"Models: {models}. Defaults per system: {systems}."


#: ``str.format`` templates with the field ``L``.
DESCRIPTIONS = {
    "heisenberg1d": "Heisenberg chain of {L} sites, periodic, total Sz = 0",
    "heisenberg2d": "Heisenberg model on a {L}×{L} square lattice, periodic, total Sz = 0",
    "ising1d": "transverse-field Ising chain of {L} sites, periodic, h = 1",
    "j1j2": "J1-J2 Heisenberg model on a {L}×{L} square lattice, J2 = 0.5, periodic, total Sz = 0",
}

#: Exact diagonalisation, periodic boundaries, NetKet units (Pauli matrices: 4x the S·S units); the
#: entries up to 16 spins are recomputed by this module's Lanczos in
#: tests/test_cli.py::test_lanczos_reproduces_the_table.
EXACT_ENERGIES = {
    ("heisenberg1d", 12): -21.5495636696,
    ("heisenberg1d", 16): -28.5691854424,
    ("heisenberg1d", 20): -35.6175461196,
    ("heisenberg2d", 4): -44.9139328336,
    ("ising1d", 12): -15.3225951511,
    ("ising1d", 16): -20.4045944748,
    ("ising1d", 20): -25.4909896864,
    ("j1j2", 4): 4 * -8.4579233514,
    # Exact diagonalisation in the literature, E0/N = -0.678872 in S·S units (six digits).
    ("heisenberg2d", 6): 4 * 36 * -0.678872,
}

#: Lanczos runs for up to this many spins (2^16 basis states) when the table has no entry.
LANCZOS_MAX_SITES = 16

J2 = 0.5


def n_sites(system: str, L: int) -> int:
    """Number of lattice sites: L for chains, L² for square lattices."""
    return L if system in ("heisenberg1d", "ising1d") else L * L


def size_problem(system: str, L: int | None) -> str | None:
    """Why ``L`` does not fit ``system`` (a message for ``--L``), or None when it does."""
    if is_user_system(system):
        if L is None:
            return None
        return (
            f"applies to the built-in systems only; {system} sets its own size (got --L {L}). Fix: drop --L"
        )
    if L < 2:
        return f"must be at least 2 for {system}; got {L}"
    if system != "ising1d" and L % 2:
        return f"must be even for {system} (the total Sz = 0 sector needs an even number of sites); got {L}"
    if system != "ising1d" and system != "heisenberg1d" and L < 4:
        return (
            f"must be at least 4 for {system} (smaller periodic square lattices double their bonds); got {L}"
        )
    return None


@dataclass(frozen=True)
class System:
    """A built lattice model: NetKet objects plus the bond list the exact diagonalisation uses.

    Attributes:
        hilbert, hamiltonian: NetKet's Hilbert space and operator.
        make_sampler: ``make_sampler(n_chains)`` → spin exchanges along the bonds in the total-Sz = 0
            sector for the Heisenberg models, single spin flips for Ising.
        n_sites: number of spins.
        bonds: ``(i, j, J)`` for every coupled pair, from the graph's edges; None for a user's system.
        field: transverse field ``h`` (Ising) or 0.
        graph: the NetKet lattice (its symmetries feed the symmetric models).
        description: one line for the header and ``log.json``.
        exact: the exact ground-state energy a user's system factory gave, or None.
    """

    hilbert: Any
    hamiltonian: Any
    make_sampler: Callable[[int], Any]
    n_sites: int
    bonds: tuple[tuple[int, int, float], ...] | None
    field: float
    graph: Any = None
    description: str = ""
    exact: float | None = None


def build(system: str, L: int) -> System:
    """NetKet's Hilbert space, Hamiltonian and Metropolis sampler for ``system`` of linear size ``L``."""
    import netket as nk

    if system in ("heisenberg1d", "ising1d"):
        graph = nk.graph.Chain(L, pbc=True)
    elif system == "heisenberg2d":
        graph = nk.graph.Square(L, pbc=True)
    elif system == "j1j2":
        graph = nk.graph.Square(L, pbc=True, max_neighbor_order=2)
    else:  # validated before
        raise AssertionError(system)
    couplings = [1.0, J2] if system == "j1j2" else [1.0]
    bonds = tuple((int(i), int(j), couplings[c]) for i, j, c in graph.edges(return_color=True))

    if system == "ising1d":
        hilbert = nk.hilbert.Spin(0.5, N=graph.n_nodes)
        hamiltonian = nk.operator.Ising(hilbert, graph, h=1.0, J=1.0)
        return System(
            hilbert,
            hamiltonian,
            lambda n_chains: nk.sampler.MetropolisLocal(hilbert, n_chains=n_chains),
            graph.n_nodes,
            bonds,
            1.0,
            graph,
            DESCRIPTIONS[system].format(L=L),
        )
    hilbert = nk.hilbert.Spin(0.5, N=graph.n_nodes, total_sz=0)
    if system == "j1j2":
        # Marshall's sign rule on the nearest-neighbour bonds only: the J2 bonds join equal sublattices.
        hamiltonian = nk.operator.Heisenberg(hilbert, graph, J=couplings, sign_rule=[True, False])
    else:
        hamiltonian = nk.operator.Heisenberg(hilbert, graph)
    return System(
        hilbert,
        hamiltonian,
        lambda n_chains: nk.sampler.MetropolisExchange(hilbert, graph=graph, n_chains=n_chains, d_max=1),
        graph.n_nodes,
        bonds,
        0.0,
        graph,
        DESCRIPTIONS[system].format(L=L),
    )


def make_model(name: str, system: System | None = None):
    """The network for ``name`` (see :data:`MODEL_HELP`); the symmetric ones take ``system.graph``'s group.

    ``rbm-symm`` starts with kernel weights of standard deviation 0.01 (NetKet's default 0.1 gives the
    4×4 lattice log-amplitudes spread over 25 units, and Metropolis chains stuck in a few states).
    ``gcnn`` has real parameters and a complex output (NetKet's default), so it can carry a sign.
    """
    import netket as nk
    import numpy as np

    if name == "rbm":
        return nk.models.RBM(alpha=1, param_dtype=np.float64)
    if name == "rbm-phase":
        return nk.models.RBMModPhase(alpha=1, param_dtype=np.float64)
    if name == "mlp":
        return nk.models.MLP(
            hidden_dims_alpha=(2, 1), hidden_activations=nk.nn.activation.log_cosh, param_dtype=np.float64
        )
    if name in ("rbm-symm", "gcnn") and (system is None or system.graph is None):
        raise ValueError(f"model {name!r} needs the lattice: pass make_model({name!r}, build(system, L))")
    if name == "rbm-symm":
        import jax

        return nk.models.RBMSymm(
            symmetries=system.graph.translation_group(),
            alpha=4,
            param_dtype=np.float64,
            kernel_init=jax.nn.initializers.normal(0.01),
        )
    if name == "gcnn":
        return nk.models.GCNN(
            symmetries=system.graph.space_group(), layers=2, features=4, param_dtype=np.float64
        )
    raise AssertionError(name)


def exact_energy(system: str, L: int | None, built: System) -> tuple[float | None, str | None]:
    """The exact ground-state energy and where it comes from: ``"table"``, ``"lanczos"``,
    ``"system factory"`` or None.

    A user's system has the energy its factory gave, or none. For a built-in one the table is used when
    it has the system; otherwise :func:`lanczos_energy` for up to :data:`LANCZOS_MAX_SITES` spins;
    otherwise the energy is unknown.
    """
    if built.bonds is None:
        return (built.exact, "system factory") if built.exact is not None else (None, None)
    known = EXACT_ENERGIES.get((system, L))
    if known is not None:
        return known, "table"
    if built.n_sites <= LANCZOS_MAX_SITES:
        return lanczos_energy(built.n_sites, built.bonds, built.field), "lanczos"
    return None, None


def lanczos_energy(n_sites: int, bonds, field: float = 0.0) -> float:
    r"""Lowest eigenvalue of a spin-½ Hamiltonian in Pauli matrices, by Lanczos (``scipy``'s ``eigsh``).

    .. math::

        H_\mathrm{Heisenberg} = \sum_{(i,j,J)} J\,(\sigma^z_i\sigma^z_j + \sigma^x_i\sigma^x_j
            + \sigma^y_i\sigma^y_j) \quad (h = 0), \qquad
        H_\mathrm{Ising} = \sum_{(i,j,J)} J\,\sigma^z_i\sigma^z_j - h \sum_i \sigma^x_i \quad (h \ne 0).

    Marshall's sign rule, which NetKet applies on bipartite bonds, is a unitary change of basis and
    leaves the spectrum unchanged. The sparse matrix is built with bit operations over the
    :math:`2^n` basis states (Heisenberg: the total-Sz = 0 ones), well under a second for 16 spins
    (NetKet's ``lanczos_ed`` first compiles its operator conversion: about ten seconds here).

    Examples:
        >>> round(lanczos_energy(2, [(0, 1, 1.0)]), 10)  # one singlet: -3 in Pauli units
        -3.0
    """
    import numpy as np
    import scipy.sparse
    import scipy.sparse.linalg

    states = np.arange(2**n_sites, dtype=np.int64)
    if field == 0.0 and n_sites % 2 == 0:
        # H conserves total Sz and is SU(2) symmetric: every multiplet has a member with Sz = 0.
        ones = sum((states >> i) & 1 for i in range(n_sites))
        states = states[ones == n_sites // 2]
    dim = states.size
    index = np.arange(dim)
    diag = np.zeros(dim)
    rows, cols, vals = [index], [index], [diag]
    for i, j, coupling in bonds:
        differ = ((states >> i) ^ (states >> j)) & 1
        diag += coupling * (1 - 2 * differ)  # σz σz
        if field == 0.0:  # σx σx + σy σy = 2 (σ+ σ- + σ- σ+): flips an antiparallel pair
            rows.append(index[differ == 1])
            cols.append(np.searchsorted(states, states[differ == 1] ^ ((1 << i) | (1 << j))))
            vals.append(np.full(rows[-1].size, 2.0 * coupling))
    if field != 0.0:
        for i in range(n_sites):
            rows.append(index)
            cols.append(states ^ (1 << i))  # all 2^n states: the index is the state
            vals.append(np.full(dim, -field))
    H = scipy.sparse.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(dim, dim)
    )
    if dim <= 64:
        return float(np.linalg.eigvalsh(H.toarray())[0])
    v0 = np.random.default_rng(0).standard_normal(dim)
    return float(scipy.sparse.linalg.eigsh(H, k=1, which="SA", v0=v0, tol=1e-11)[0][0])


#: :func:`infinite_temperature_energy` sums the diagonal exactly up to this many basis states.
TRACE_MAX_STATES = 1 << 16
#: Otherwise it averages the diagonal over this many uniformly drawn basis states.
TRACE_SAMPLES = 4096


def infinite_temperature_energy(hilbert, hamiltonian) -> tuple[float | None, float, str]:
    r"""The infinite-temperature energy :math:`E_\infty = \mathrm{Tr}\,H / \dim` on ``hilbert`` (its
    constrained sector, if any), its standard error, and how it was obtained.

    Exact (error 0) when the space has at most :data:`TRACE_MAX_STATES` basis states: the mean of all
    diagonal elements :math:`\langle\sigma|H|\sigma\rangle`, read from ``hamiltonian.get_conn_padded``.
    Otherwise the mean over :data:`TRACE_SAMPLES` basis states drawn uniformly, with its standard error
    (NetKet's ``random_state`` is uniform for spaces without a constraint and for spin-½ with a fixed total
    magnetisation); for other constrained spaces it is unknown (None).
    """
    import jax
    import numpy as np

    if hilbert.is_indexable and hilbert.n_states <= TRACE_MAX_STATES:
        states = np.asarray(hilbert.all_states())
        diagonal = np.concatenate(
            [_diagonal(hamiltonian, states[i : i + 4096]) for i in range(0, len(states), 4096)]
        )
        return float(diagonal.mean()), 0.0, f"exact: mean of the {len(states)} diagonal elements"
    constraint = getattr(hilbert, "constraint", None)
    local = getattr(hilbert, "local_size", None)
    uniform = constraint is None or (local == 2 and type(constraint).__name__ == "SumConstraint")
    if not uniform:
        return None, 0.0, f"unknown: no uniform sampler of the constrained space {hilbert}"
    states = np.asarray(hilbert.random_state(jax.random.key(0), TRACE_SAMPLES))
    diagonal = _diagonal(hamiltonian, states)
    error = float(diagonal.std(ddof=1) / np.sqrt(len(diagonal)))
    return float(diagonal.mean()), error, f"estimated from {TRACE_SAMPLES} uniformly drawn basis states"


def _diagonal(hamiltonian, states):
    r""":math:`\langle\sigma|H|\sigma\rangle` for each row σ of ``states`` (real part)."""
    import numpy as np

    connected, elements = hamiltonian.get_conn_padded(states)
    connected, elements = np.asarray(connected), np.asarray(elements)
    same = np.all(connected == states[:, None, :], axis=-1)
    return np.real(np.where(same, elements, 0).sum(axis=-1))


def v_score(n_sites: int, energy: float, variance: float, e_infinity: float) -> float | None:
    r"""The V-score :math:`N\,\mathrm{Var}\,E / (E - E_\infty)^2` (Wu et al. 2024, "Variational
    benchmarks for quantum many-body problems"); None when :math:`E = E_\infty`.

    Examples:
        >>> v_score(4, -2.0, 0.1, 0.0)
        0.1
    """
    gap = energy - e_infinity
    return None if gap == 0 else n_sites * variance / gap**2
