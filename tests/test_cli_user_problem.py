"""``vmcgrad vmc --system MODULE:FACTORY --model MODULE:FACTORY``: the user's own problem.

Every mistake in the user's module, factory or its result ends the run before anything is sampled,
with one line naming the option (status 2) and no log; the example in docs/examples trains through the
command line; the infinite-temperature energy behind the V-score is checked against NetKet's sparse
matrix and against a closed form.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_vmcgrad

from vmcgrad.cli import _systems, main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_problem.py"

HEADER = """
import flax.linen as nn
import jax.numpy as jnp
import netket as nk

def good_model():
    return nk.models.RBM(alpha=1, param_dtype=float)

def good_system():
    graph = nk.graph.Chain(6)
    hilbert = nk.hilbert.Spin(0.5, N=6)
    return {"hilbert": hilbert, "hamiltonian": nk.operator.Ising(hilbert, graph, h=1.0), "graph": graph}

class TwoOutputs(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, param_dtype=jnp.float64)(x)  # shape (n, 1), not (n,)

class WrongInput(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.sum(x.reshape(-1, 5), axis=-1)  # breaks on 8 sites
"""

#: (file body after HEADER, options, the message's start after "vmcgrad vmc: error: ")
BAD_FILES = {
    "import-raises": (
        "1 / 0\n",
        ["--model", "{file}:good_model"],
        "argument --model: importing '{file}' raised ZeroDivisionError: division by zero "
        "({file}, line {line})",
    ),
    "import-missing-module": (
        "import no_such_module_for_vmcgrad\n",
        ["--system", "{file}:good_system"],
        "argument --system: importing '{file}' raised ModuleNotFoundError: No module named "
        "'no_such_module_for_vmcgrad'",
    ),
    "no-such-factory": (
        "",
        ["--model", "{file}:make_model"],
        "argument --model: '{file}' has no 'make_model'; its functions and classes: TwoOutputs, "
        "WrongInput, good_model, good_system",
    ),
    "not-callable": ("VALUE = 3\n", ["--model", "{file}:VALUE"], "argument --model: {file}:VALUE is a int,"),
    "factory-raises": (
        "def model(size):\n    return None\n",
        ["--model", "{file}:model"],
        "argument --model: calling {file}:model() raised TypeError: model() missing 1 required",
    ),
    "model-not-a-module": (
        "def model():\n    return 'rbm'\n",
        ["--model", "{file}:model"],
        "argument --model: {file}:model() returned a str; expected a flax.linen.Module",
    ),
    "model-output-shape": (
        "def model():\n    return TwoOutputs()\n",
        ["--model", "{file}:model"],
        "argument --model: {file}:model() maps a batch of shape (3, 8) to shape (3, 1) (float64); "
        "expected shape (3,), one real or complex log-amplitude per sample",
    ),
    "model-fails-on-input": (
        "def model():\n    return WrongInput()\n",
        ["--model", "{file}:model"],
        "argument --model: {file}:model() fails on a batch of configurations of shape (3, 8) (int8): "
        "TypeError: cannot reshape",
    ),
    "system-not-a-dict": (
        "def system():\n    s = good_system()\n    return s['hilbert'], s['hamiltonian']\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system() returned a tuple; expected a dict with the keys 'hilbert' and "
        "'hamiltonian'",
    ),
    "system-missing-key": (
        "def system():\n    return {'hilbert': good_system()['hilbert']}\n",
        ["--system", "{file}:system"],
        "argument --system: the dict of {file}:system() lacks 'hamiltonian'; expected the keys",
    ),
    "system-unknown-key": (
        "def system():\n    return {**good_system(), 'exact': -1.0}\n",
        ["--system", "{file}:system"],
        "argument --system: the dict of {file}:system() has unknown keys ['exact']",
    ),
    "system-other-hilbert": (
        "def system():\n    s = good_system()\n    return {**s, 'hilbert': nk.hilbert.Spin(0.5, N=7)}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['hamiltonian'] acts on Spin(s=1/2, N=6",
    ),
    "system-hilbert-not-a-space": (
        "def system():\n    return {**good_system(), 'hilbert': 6}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['hilbert'] is a int; expected a NetKet discrete Hilbert space",
    ),
    "system-not-an-operator": (
        "def system():\n    return {**good_system(), 'hamiltonian': 'H'}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['hamiltonian'] is a str; expected a NetKet operator",
    ),
    "system-bad-graph": (
        "def system():\n    return {**good_system(), 'graph': nk.graph.Chain(5)}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['graph'] is a graph of 5 nodes; expected a NetKet graph of 6",
    ),
    "system-bad-exact": (
        "def system():\n    return {**good_system(), 'exact_energy': 'low'}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['exact_energy'] is 'low'; expected a finite real number",
    ),
    "constrained-without-graph": (
        "def system():\n    h = nk.hilbert.Spin(0.5, N=6, total_sz=0)\n"
        "    return {'hilbert': h, 'hamiltonian': nk.operator.Heisenberg(h, nk.graph.Chain(6))}\n",
        ["--system", "{file}:system"],
        "argument --system: {file}:system()['hilbert'] = Spin(s=1/2, N=6, ordering=new, total_sz=0) has a "
        "constraint",
    ),
    "symmetric-model-without-graph": (
        "def system():\n    return {k: v for k, v in good_system().items() if k != 'graph'}\n",
        ["--system", "{file}:system", "--model", "rbm-symm"],
        "argument --model: rbm-symm needs the lattice's symmetries: add 'graph' to {file}:system()'s dict",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_module_or_factory_is_one_line_before_sampling(case, tmp_path, capsys):
    """Each mistake: status 2, one line naming the option and what was wrong, nothing written."""
    body, options, message = BAD_FILES[case]
    file = tmp_path / f"bad_{case.replace('-', '_')}.py"
    file.write_text(HEADER + body)
    out = tmp_path / "out"
    options = [o.format(file=file) for o in options]
    if "--system" not in options:
        options += ["--system", "heisenberg1d", "--L", "8"]
    with pytest.raises(SystemExit) as exc:
        main(["vmc", *options, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    expected = "vmcgrad vmc: error: " + message.format(file=file, line=HEADER.count("\n") + 1)
    assert err.count("\n") == 1 and err.startswith(expected), err
    assert not (out / "log.json").exists() and not list(out.glob("*"))  # nothing written, lock released


BAD_OPTIONS = [
    (["--model", "missing_file.py:model"], "argument --model: no file 'missing_file.py'"),
    (["--system", "docs/nowhere/x.py:system"], "argument --system: no file 'docs/nowhere/x.py'"),
    (["--model", "no_such_package_for_vmcgrad.models:model"], "argument --model: no module named "),
    (["--model", f"{EXAMPLE}:"], "argument --model: expected one of rbm, rbm-phase"),
    (["--model", f"{EXAMPLE}:3d"], "argument --model: expected one of rbm, rbm-phase"),
    (
        ["--model", "docs/examples/my_problem.txt:model"],
        "argument --model: 'docs/examples/my_problem.txt' is not a .py",
    ),
    (["--system", "not a module:system"], "argument --system: 'not a module' is neither a dotted module"),
    (["--system", f"{EXAMPLE}:system", "--L", "8"], "argument --L: applies to the built-in systems only"),
]


@pytest.mark.parametrize("bad, message", BAD_OPTIONS, ids=[" ".join(b) for b, _ in BAD_OPTIONS])
def test_a_bad_spec_is_refused_before_anything_is_imported(bad, message, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["vmc", *bad, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vmcgrad vmc: error: " + message), err
    assert not out.exists()


@pytest.mark.parametrize("total_sz", [0, None], ids=["total-sz-0", "no-constraint"])
def test_infinite_temperature_energy_exact_against_netket_sparse_matrix(total_sz):
    """The exact path (all diagonal elements) against the diagonal of NetKet's sparse matrix, on a
    constrained and an unconstrained space."""
    import netket as nk

    hilbert = nk.hilbert.Spin(0.5, N=8, total_sz=total_sz)
    H = nk.operator.Heisenberg(hilbert, nk.graph.Chain(8)) + 0.3 * nk.operator.spin.sigmaz(hilbert, 0)
    value, error, source = _systems.infinite_temperature_energy(hilbert, H)
    reference = H.to_sparse().diagonal().real.mean()
    assert source.startswith("exact") and error == 0.0
    assert value == pytest.approx(reference, rel=1e-12, abs=1e-12)
    if total_sz == 0:  # the sector's trace is not the full space's (0 for this H)
        assert value == pytest.approx(-8 / 7, rel=1e-12)


def test_infinite_temperature_energy_estimate_against_the_closed_form():
    """Past TRACE_MAX_STATES: the uniform estimate. In the total-Sz = 0 sector of N spins-½ each σzσz bond
    has mean -1/(N-1) (the flip terms have no diagonal), so Tr H / dim = -bonds/(N-1) exactly."""
    import netket as nk

    n = 20  # C(20, 10) = 184756 states > 2^16
    hilbert = nk.hilbert.Spin(0.5, N=n, total_sz=0)
    H = nk.operator.Heisenberg(hilbert, nk.graph.Chain(n))
    value, error, source = _systems.infinite_temperature_energy(hilbert, H)
    assert source.startswith("estimated") and error > 0
    assert abs(value - (-n / (n - 1))) < 5 * error  # a 5-sigma bound: fails by chance with p < 1e-6
    assert error < 0.2  # sqrt(Var)/sqrt(4096) with Var <= (2 n)^2


@pytest.mark.slow
def test_the_docs_example_trains_through_the_command_line(tmp_path):
    """docs/examples/my_problem.py, as the docs run it: the energy goes down towards NetKet's exact
    ground-state energy, and the V-score in log.json is N Var E / (E - Tr H/dim)^2 of its own lists."""
    import netket as nk

    out = tmp_path / "run"
    args = ["--system", f"{EXAMPLE}:system", "--model", f"{EXAMPLE}:model", "--steps", "20"]
    args += ["--samples", "256", "--devices", str(int(os.environ.get("VMCGRAD_TEST_DEVICES", "4")))]
    code, stdout, stderr = run_vmcgrad(["vmc", *args, "--out", str(out)], tmp_path, timeout=180)
    assert code == 0, stderr[-4000:]
    log = json.loads((out / "log.json").read_text())
    energies = log["energy_mean"]
    assert len(energies) == 20 and all(np.isfinite(energies))

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import my_problem
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    made = my_problem.system()
    exact = nk.exact.lanczos_ed(made["hamiltonian"])[0]
    e_inf = made["hamiltonian"].to_sparse().diagonal().real.mean()
    final, error = log["final_energy"], log["final_energy_error"]
    assert log["exact_energy"] is None and log["relative_error"] is None
    assert log["info"]["infinite_temperature_energy"]["value"] == pytest.approx(e_inf, rel=1e-12)
    # Trained: down from the first step, to within a tenth of the way from the ground state to E_inf.
    assert final < energies[0] - 5 * (log["energy_error"][0] + error), (energies, exact, e_inf)
    assert final < exact + 0.1 * (e_inf - exact), (energies, exact, e_inf)
    assert final > exact - 5 * error - 1e-9  # variational: not below the ground state
    n = log["info"]["n_sites"]
    last = max(1, len(energies) // 10)
    variance = np.mean(log["energy_variance"][-last:])
    assert log["final_variance"] == pytest.approx(variance, rel=1e-12)
    assert log["v_score"] == pytest.approx(n * variance / (final - e_inf) ** 2, rel=1e-9)
    assert f"V-score {log['v_score']:.3e}" in stdout and "Traceback" not in stderr
    assert "exact energy: unknown (not given by the system factory)" in stdout
