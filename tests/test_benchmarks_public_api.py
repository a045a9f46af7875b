"""``benchmarks/`` uses vmcgrad's public functions only, through one harness; the package holds no benchmark.

Static checks on the source: no private vmcgrad module imported from the benchmarks, no private
attribute (NetKet's ``vs._samples``, ``vs._apply_fun``, ...) read or written, no ``sys.path`` edits in the
scripts, and one definition each of the harness pieces (cross-check, interleaved timing, table).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = sorted((ROOT / "benchmarks" / "benchlib").glob("*.py"))
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
SYS_PATH = ("sys", "path")
SOURCES = [*BENCH, *SCRIPTS]


#: The allowed exceptions, by file and module: NetKet 3.23 exposes the jitted kernels that
#: ``nk.driver.VMC_SR`` runs only from its private ``netket._src.ngd``, and the large-model benchmark,
#: the sample-space SR benchmark and the time-to-energy race lower them (compile only) to measure
#: VMC_SR's memory. Any other private name still fails.
ALLOWED = {
    name: {"netket._src.ngd.sr_srt_common", "netket._src.ngd.srt_onthefly"}
    for name in ("large.py", "bench_minsr.py", "time_to_energy.py")
} | {"bench_switch.py": {"vmcgrad._problem"}}
#: MinSR's routes benchmark reads vmcgrad's rule and sizes (``_sr.minsr``, ``_sr.nystrom``), the chunk the
#: budget picks (``_problem.problem``), toggles the Jacobian batches (``_sr.ntk.modes``) and runs the CG
#: with a preconditioner (``_sr.solve``): the internals it measures, not public API.
ALLOWED["bench_minsr_routes.py"] = {
    "vmcgrad._sr",
    "vmcgrad._sr.ntk",
    "vmcgrad._sr.jacobian",
    "vmcgrad._problem",
    "vmcgrad._chunks.default_budget",
    "vmcgrad._sr.solve",
}
#: The step-regime probe sets how many parts a chunk's Jacobians are derived in (``_sr.ntk.modes``, as
#: the routes benchmark toggles them) and so empties vmcgrad's chunk memos (``_cache.registry``).
ALLOWED["step_regime.py"] = {"vmcgrad._sr", "vmcgrad._sr.ntk", "vmcgrad._cache"}
#: The route probe prints the rule's record of MinSR's route (``_sr.ntk.minsr.update_choice``: each
#: route's modelled time), which the package does not export.
ALLOWED["minsr_route_probe.py"] = {"vmcgrad._sr.ntk"}
#: The per-sample Jacobian's bytes derive the rows as MinSR's kept Jacobian does
#: (``_sr.jacobian.flat_jacobian``, ``_sr.ntk.modes``' parametrisation): the internals it measures.
ALLOWED["jacobian_bytes.py"] = {
    "vmcgrad._sr",
    "vmcgrad._sr.jacobian",
    "vmcgrad._sr.ntk",
    "vmcgrad._sr.ntk.modes",
}
#: The QGT phase's bytes compile the programs SR runs and the CLI logs (the product's and O-bar's
#: programs, the CLI's phase measure), which the package does not export: the internals it measures.
ALLOWED["qgt_phase_bytes.py"] = {
    "vmcgrad._problem.problem",
    "vmcgrad._sr.qgt.apply",
    "vmcgrad._sr.qgt.qgt",
    "vmcgrad.cli",
    "vmcgrad.netket._qgt",
}
#: The local values' benchmark prices and runs NetKet's local-value program at each chunk as
#: ``vmcgrad.netket.MCState`` does (``_local_values``: its kernel and choice, ``_nk_private``: NetKet's
#: jitted program), and reads the chunk a state runs its NetKet paths at (``MCState._chunk``); with
#: ``--estimator expect_and_grad`` it prices that method's one program (``_expect_grad``).
ALLOWED["local_values.py"] = {"vmcgrad.netket", "vmcgrad.netket._local_values", "vmcgrad.netket._expect_grad"}
#: The calibration prints the cost model's constants beside the ones it measured (``PLATFORMS``).
ALLOWED["calibrate_op_cost.py"] = {"vmcgrad._hlo.cost"}
#: The harness's log-amplitude of a model is vmcgrad.netket's own (one definition: its apply functions
#: de-duplicated so that each model compiles once), which the package does not export.
ALLOWED["_setup.py"] = {"vmcgrad.netket._expect_grad"}
#: Private names a script may use: ``bench_switch.py --before`` turns vmcgrad's per-signature
#: validation cache off (``vmcgrad._problem.problem``, the module allowed above) to time the per-step
#: work that cache removed.
#: ``accelerator_cost.py`` prices NetKet's chunked jvp as ``QGTOnTheFly`` runs it, which NetKet 3.23
#: defines only as the private ``qgt_onthefly_logic._O_jvp`` (compile only).
ALLOWED_NAMES = {
    "bench_switch.py": {"_problem", "_CHECKED", "_CHECKED_MAX"},
    "accelerator_cost.py": {"_O_jvp"},
    "local_values.py": {"_local_values", "_nk_private", "_chunk", "_expect_grad", "_expect_and_grad_step"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            # a package's own private modules (benchlib._harness, ...)
            own = node.level == 1 or node.module in ALLOWED.get(path.name, ())
            allowed = ALLOWED_NAMES.get(path.name, set())
            names = [a.name for a in node.names if a.name not in allowed]
            if not own and (any(_private(p) for p in parts) or any(map(_private, names))):
                found.append(f"{where}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            found += [f"{where}: import {n}" for n in names if any(map(_private, n.split(".")))]
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr not in ALLOWED_NAMES.get(path.name, ())
        ):
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and (getattr(node.value, "id", ""), node.attr) == SYS_PATH:
            found.append(f"{where}: sys.path")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_benchmarks_use_public_names_only(path):
    found = _problems(path)
    assert found == [], "\n".join(found)


def test_the_checker_sees_private_use(tmp_path):
    """The checks above can fail: each forbidden form is found in a sample."""
    sample = tmp_path / "sample.py"  # its own package's ._x modules are allowed
    sample.write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom vmcgrad._chunks.budget import choose_for\n"
        "from ..netket import _qgt\nvs._samples = 1\nimport vmcgrad._hlo.collectives\n"
        "from ._harness import measure\n"
    )
    assert len(_problems(sample)) == 5, _problems(sample)


@pytest.mark.parametrize(
    "name",
    ["check_agree", "measure", "table", "netket_force", "place", "write_json", "json_safe", "largest_n"],
)
def test_one_definition_of_each_harness_piece(name):
    defs = [
        f"{p.relative_to(ROOT)}"
        for p in SOURCES
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    assert len(defs) == 1, defs


#: What vmcgrad.netket and the command line (whose checkpoints are NetKet's state, serialized as
#: NetKet serializes it) may import from flax.
FLAX_IN_ADAPTER = {"flax.struct", "flax.serialization"}
FLAX_WHERE = {"netket", "cli"}


def test_the_package_holds_no_benchmark_code():
    """The installed package holds the library and its command line only: no benchmark module, no
    import of NetKet's private ``netket._src``, and flax only where NetKet's own mechanisms are flax's
    (``vmcgrad.netket``: ``flax.struct`` pytrees as NetKet's operators, ``flax.serialization`` of the
    state; ``vmcgrad.cli``: ``flax.serialization`` of its checkpoints); no flax model anywhere."""
    assert not (ROOT / "vmcgrad" / "bench").exists()
    found = []
    for path in sorted((ROOT / "vmcgrad").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.startswith("netket._src")
                or "bench" in n.split(".")
                or (
                    n.split(".")[0] == "flax"
                    and not (path.parent.name in FLAX_WHERE and n in FLAX_IN_ADAPTER)
                )
            ]
    assert found == [], found
