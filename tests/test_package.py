"""The package as a maintainer inherits it (its import layers: tests/test_layers.py): ``import vmcgrad``
loading only the library, NetKet's private names behind one module with a tested version bound, and
every file or test a document or comment cites present in the repository.

Static checks on the source (``ast``, regular expressions), plus two fresh interpreters.
"""

import ast
import configparser
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import module_name

with jax.set_mesh(None):  # NetKet's import sets a global mesh that must not leak into other test files
    import netket as nk

    import vmcgrad.netket as vnk
    from vmcgrad.netket import _nk_private as nkp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vmcgrad"


#: No module of the package is longer than this (issue 35: one concept per file).
MAX_MODULE_LINES = 500


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """The modules under ``root`` longer than ``limit`` lines, with their lengths."""
    sizes = ((str(p.relative_to(root)), len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py")))
    return [(name, n) for name, n in sizes if n > limit]


def test_no_module_is_over_500_lines():
    assert long_modules(PACKAGE) == []


def test_the_length_check_sees_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n")
    (tmp_path / "long.py").write_text("x = 1\n" * 501)
    assert long_modules(tmp_path) == [("long.py", 501)]


#: No function's code (its docstring left out) is longer than this: a longer one is split where that
#: reads better. A public function's docstring is its reference (the formula, Args, Returns, Raises,
#: Examples) and does not count: ``vmcgrad.QGT`` and ``vmcgrad.netket.QGTOnTheFly`` are over 100
#: lines for it, with 40 and 25 of code.
MAX_FUNCTION_CODE_LINES = 80
#: Functions allowed to be longer, with why.
LONG_FUNCTIONS = {
    "vmcgrad.cli.vmc:_run": "the command line's main job, being split (issue 46, the CLI's own work)",
    "vmcgrad.cli._vmc_options:add_parser": "one argparse block of the command's options",
}


def long_functions(root: Path, limit: int = MAX_FUNCTION_CODE_LINES) -> dict[str, int]:
    """``module:qualified name`` -> lines of code, docstring left out, of the functions over ``limit``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for qualname, node in _functions(ast.parse(path.read_text())):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
            if lines > limit:
                found[f"{module_name(path, root)}:{qualname}"] = lines
    return found


def test_no_function_is_over_80_lines_of_code():
    found = long_functions(PACKAGE)
    assert {name: n for name, n in found.items() if name not in LONG_FUNCTIONS} == {}
    assert sorted(LONG_FUNCTIONS.keys() - found.keys()) == []  # a listed one now short: drop it


def test_the_function_length_check_counts_code_not_docstrings(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    doc = '    """' + "\n".join(["A line."] * 90) + '"""\n'
    (package / "a.py").write_text(
        "def documented():\n" + doc + "    return 1\n\n\ndef long():\n" + "    x = 1\n" * 81
    )
    assert long_functions(package) == {"pkg.a:long": 81}


# --- what `import vmcgrad` loads ------------------------------------------------------------------


def test_import_vmcgrad_loads_the_library_only():
    """``import vmcgrad`` loads neither the command line (``vmcgrad.cli``, its ``vmc`` command) nor the
    NetKet adapter, NetKet or flax."""
    code = (
        "import sys, vmcgrad; print(sorted(m for m in sys.modules if m.startswith(('vmcgrad.cli', "
        "'vmcgrad.netket', 'netket', 'flax', 'matplotlib'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_vmc_help_imports_no_jax():
    """``vmcgrad vmc --help`` answers without importing JAX (or NetKet): ``import vmcgrad`` is lazy and
    the command imports its heavy modules inside ``run``. Read from ``python -X importtime``."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "vmcgrad", "vmc", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0 and "--chunk-size" in out.stdout, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "vmcgrad.cli.vmc" in imported  # the reading works
    assert not imported & {"jax", "netket", "flax", "matplotlib"}, sorted(imported & {"jax", "netket"})


# --- NetKet's private names -------------------------------------------------------------------------


def test_netket_private_names_are_all_present():
    assert nkp.missing(nk.vqs.MCState) == []
    assert nkp.NetKetMCState is nk.vqs.MCState or issubclass(nk.vqs.MCState, nkp.NetKetMCState)


def test_a_moved_netket_name_fails_with_vmcgrads_name_and_the_fix():
    class Moved:  # no _apply_fun, _chunk_size, _replace_model; chunk_size not a settable property
        chunk_size = property(lambda self: None)

    with pytest.raises(nkp.NetKetVersionError) as info:
        nkp.check(Moved, "9.9", functions=(("netket.vqs.mc.common", "gone"), ("netket.nowhere", "f")))
    message = str(info.value)
    assert message.startswith("vmcgrad.netket: NetKet 9.9 lacks netket.vqs.MCState._apply_fun")
    for what in ("_chunk_size", "_replace_model", "settable property", "common.gone", "netket.nowhere.f"):
        assert what in message
    assert f"pip install 'netket{nkp.TESTED_NETKET}'" in message


def test_setup_cfg_bounds_netket_to_the_tested_releases():
    """Every ``netket`` requirement in setup.cfg is the tested range, and the installed NetKet is in it."""
    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [
        Requirement(line)
        for extra in cfg["options.extras_require"].values()
        for line in extra.split("\n")
        if line.strip().startswith("netket")
    ]
    assert len(reqs) >= 3
    assert {str(r.specifier) for r in reqs} == {str(Requirement(f"netket{nkp.TESTED_NETKET}").specifier)}
    assert reqs[0].specifier.contains(nk.__version__)
    assert not reqs[0].specifier.contains("3.24.0") and not reqs[0].specifier.contains("4.0")


def test_rebinding_netkets_mcstate_to_vmcgrads_switches_a_script():
    """``nk.vqs.MCState = vmcgrad.netket.MCState`` (switch every state of a script at once): states
    are built and their chunk size set without NetKet's class being looked up as vmcgrad's."""
    hi = nk.hilbert.Spin(0.5, 4)
    own = nk.vqs.MCState
    nk.vqs.MCState = vnk.MCState
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("S",), axis_types=(jax.sharding.AxisType.Auto,))
    try:
        with jax.set_mesh(mesh):
            sampler = nk.sampler.MetropolisLocal(hi, n_chains=4 * jax.device_count())
            vs = nk.vqs.MCState(
                sampler, nk.models.RBM(alpha=1), n_samples=16 * jax.device_count(), chunk_size=4
            )
            vs.chunk_size = 8  # NetKet's own setter (a RecursionError when it was looked up at run time)
            assert isinstance(vs, vnk.MCState) and vs.chunk_size == 8 and vs.vmcgrad_chunk_size == 4
    finally:
        nk.vqs.MCState = own


# --- every cited file and test exists ---------------------------------------------------------------

#: A repository path: one of the repository's folders, then a file name with its extension; optionally a
#: test (``::test_name``, ``::Class::test_name``, a parametrize id in brackets).
CITED = re.compile(
    r"(?<![\w/.-])((?:vmcgrad|tests|benchmarks|docs|notebooks|\.ci)/[\w/.-]*\w\.(?:py|md|ipynb|sh|cfg|toml|json))"
    r"(?!\w)((?:::\w+)*)"  # the whole extension: rows.jsonl is not a citation of rows.json
)


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every document, notebook cell, benchmark and package source file."""
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks").rglob("*")),
    ]
    files += sorted(PACKAGE.rglob("*.py"))
    out = []
    for path in files:
        if path.suffix not in (".md", ".py", ".sh") or not path.is_file():
            continue
        out.append((str(path.relative_to(ROOT)), path.read_text()))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            out.append((f"{path.relative_to(ROOT)} cell {i}", "".join(cell["source"])))
    return out


def _defines(path: Path, names: list[str]) -> bool:
    """``path`` defines the test ``names`` (a function, or classes then a method)."""
    body = ast.parse(path.read_text()).body
    for name in names:
        found = next(
            (n for n in body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name), None
        )
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def dangling_citations(texts: list[tuple[str, str]], root: Path) -> list[str]:
    """Each cited path that is not a file of ``root``, or test that its file does not define."""
    bad = []
    for where, text in texts:
        for match in CITED.finditer(text):
            path, tests = root / match.group(1), [t for t in match.group(2).split("::") if t]
            if not path.is_file():
                bad.append(f"{where}: {match.group(1)} (no such file)")
            elif tests and not _defines(path, tests):
                bad.append(f"{where}: {match.group(0)} (no such test)")
    return sorted(set(bad))


def test_every_cited_file_and_test_exists():
    texts = _texts()
    assert len(texts) > 50
    assert dangling_citations(texts, ROOT) == []


def test_the_citation_check_sees_a_missing_file_and_a_missing_test():
    texts = [
        ("a.md", "see `tests/test_package.py::test_every_cited_file_and_test_exists` and tests/nope.py"),
        (
            "b.py",
            "# tests/test_package.py::test_gone, vmcgrad/_runner/primitive.py, netket/vqs/mc/common.py, "
            "a/tests/x.py",
        ),
    ]
    assert dangling_citations(texts, ROOT) == [
        "a.md: tests/nope.py (no such file)",
        "b.py: tests/test_package.py::test_gone (no such test)",
    ]


# --- warnings ------------------------------------------------------------------------------------


def _warn_calls(root: Path, relative_to: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """``(file, line, message, category)`` source text of every ``warnings.warn(...)`` under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and ast.unparse(func) == "warnings.warn":
                category = node.args[1] if len(node.args) > 1 else None
                category = next((k.value for k in node.keywords if k.arg == "category"), category)
                rel = str(path.relative_to(relative_to))
                found.append((rel, node.lineno, ast.unparse(node.args[0]), ast.unparse(category or "")))
    return found


def test_every_vmcgrad_warning_is_a_vmcgrad_warning():
    """Every warning vmcgrad issues has a :class:`vmcgrad.VmcgradWarning` category, so that
    ``pyproject.toml``'s ``error::vmcgrad.VmcgradWarning`` fails each test where one appears unasserted
    and users can filter them as one category. The one exception re-issues NetKet's own warning
    instance, as NetKet's ``QGTOnTheFly`` does (its category is NetKet's class)."""
    import vmcgrad._warnings as ours

    ours_names = {n for n, v in vars(ours).items() if isinstance(v, type) and issubclass(v, Warning)}
    calls = _warn_calls(PACKAGE)
    assert len(calls) >= 5, calls  # the walk finds the calls (five today)
    wrong = [c for c in calls if c[3] not in ours_names and c[2] != "HolomorphicUndeclaredWarning()"]
    assert not wrong, f"warnings.warn with a category that is not a vmcgrad.VmcgradWarning: {wrong}"


def test_the_warning_walk_sees_a_foreign_category(tmp_path):
    """The companion: the walk reports a plain ``UserWarning`` and a keyword category."""
    (tmp_path / "m.py").write_text(
        "import warnings\nwarnings.warn('a', UserWarning)\nwarnings.warn('b', category=RuntimeWarning)\n"
    )
    found = [(line, cat) for _, line, _, cat in _warn_calls(tmp_path, relative_to=tmp_path)]
    assert found == [(2, "UserWarning"), (3, "RuntimeWarning")]


def test_pytest_turns_an_unasserted_vmcgrad_warning_into_an_error():
    """The suite's configuration escalates vmcgrad's category (so the test above matters), and an
    asserted one passes."""
    import vmcgrad

    with pytest.raises(vmcgrad.VmcgradWarning):
        warnings.warn("an unasserted notice", vmcgrad.VmcgradWarning, stacklevel=1)
    with pytest.warns(vmcgrad.VmcgradWarning):
        warnings.warn("an asserted notice", vmcgrad.VmcgradWarning, stacklevel=1)


@pytest.mark.skipif(jax.device_count() == 1, reason="the notice exists only with several devices")
def test_a_notice_from_deep_in_the_package_points_at_the_users_line():
    """A vmcgrad warning names the user's file and line, however deep in the package's folders it is
    issued (here in ``_problem/sharding.py``, called from ``_estimators``): its ``stacklevel`` walks
    out of the whole package, not out of the issuing module's folder."""
    import inspect

    import jax.numpy as jnp

    import vmcgrad

    w, x, ct = jnp.ones(3), jnp.ones((8, 3)), jnp.ones(8)
    line = inspect.currentframe().f_lineno + 1  # the line that calls vmcgrad (traced inside jit)
    f = jax.jit(lambda w, x, ct: vmcgrad.batched_vjp(lambda w, x: jnp.sin(x @ w), w, x, ct, chunk_size=4))
    with pytest.warns(vmcgrad.VmcgradWarning, match="no sharding visible in their type") as record:
        f(w, x, ct)
    assert [(Path(r.filename).name, r.lineno) for r in record] == [(Path(__file__).name, line)]


# --- the README's test command --------------------------------------------------------------------


def _readme_test_command() -> str:
    """The ``python -m pytest ...`` part of the README's test command (the line after ``pip install``)."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r'^pip install -e "\.\[test\]" && (python -m pytest.*)$', text, flags=re.M)
    assert len(found) == 1, found  # one test command in the README
    return found[0]


def test_ci_runs_the_readme_test_command():
    """``.ci/run`` runs the README's test command verbatim, so a green CI means a newcomer's run of
    that command is green too; and docs/getting_started.md gives the same command."""
    command = _readme_test_command()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in ci if line.startswith(f"{command} || exit 1")]  # a failure stops CI
    assert len(runs) == 1, (command, [line for line in ci if "pytest" in line])
    assert f'pip install -e ".[test]" && {command}' in (ROOT / "docs" / "getting_started.md").read_text()


# --- the README's API list ------------------------------------------------------------------------


def _readme_api_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## API\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_readme_api_list_names_every_public_name():
    """Each name of ``vmcgrad.__all__`` and ``vmcgrad.netket.__all__`` appears in the README's API list
    as code (`vmcgrad.NAME` for the core; `NAME` or `NAME(` under the `vmcgrad.netket` item)."""
    import vmcgrad

    section = _readme_api_section()
    core, _, adapter = section.partition("- `vmcgrad.netket`")
    missing = [n for n in vmcgrad.__all__ if f"`vmcgrad.{n}" not in core]
    assert not missing, f"README's API list lacks {missing}"
    pytest.importorskip("netket")
    import vmcgrad.netket

    missing = [n for n in vmcgrad.netket.__all__ if f"`{n}" not in adapter]
    assert not missing, f"README's API list lacks vmcgrad.netket's {missing}"


def test_readme_api_check_fires_on_a_missing_name(monkeypatch):
    import vmcgrad

    monkeypatch.setattr(vmcgrad, "__all__", [*vmcgrad.__all__, "not_in_the_readme"])
    with pytest.raises(AssertionError, match="not_in_the_readme"):
        test_readme_api_list_names_every_public_name()


# --- each concept once ----------------------------------------------------------------------------


def export_list_disagreements(source: str) -> list[str]:
    """Where the two export lists of ``vmcgrad/__init__.py`` (its source is ``source``) differ: the
    ``_EXPORTS`` dict (name -> module, what ``import vmcgrad`` serves lazily) and the ``from M import
    N as N`` lines under ``if TYPE_CHECKING:`` (what type checkers and IDEs read)."""
    tree = ast.parse(source)
    (exports,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and "_EXPORTS" in [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])]
    ]
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                for alias in stmt.names:
                    typed[alias.asname or alias.name] = (
                        stmt.module if alias.asname == alias.name else f"{stmt.module} (not re-exported)"
                    )
    return [
        f"{name}: _EXPORTS {exports.get(name)}, TYPE_CHECKING {typed.get(name)}"
        for name in sorted(exports.keys() | typed.keys())
        if exports.get(name) != typed.get(name)
    ]


def test_the_two_export_lists_agree():
    assert export_list_disagreements((PACKAGE / "__init__.py").read_text()) == []


def test_the_export_list_check_fires_on_a_missing_or_moved_name():
    source = (PACKAGE / "__init__.py").read_text()
    line = "    from vmcgrad._sr.qgt.qgt import QGT as QGT\n"
    assert line in source
    assert export_list_disagreements(source.replace(line, "")) == [
        "QGT: _EXPORTS vmcgrad._sr.qgt.qgt, TYPE_CHECKING None"
    ]
    moved = source.replace(line, line.replace("_sr.qgt.qgt ", "_sr.qgt.abstract "))
    assert export_list_disagreements(moved) == [
        "QGT: _EXPORTS vmcgrad._sr.qgt.qgt, TYPE_CHECKING vmcgrad._sr.qgt.abstract"
    ]


# A concept written twice is found two ways, neither from a list of concepts: two functions with the
# same body shape (a copy renamed, its names and numbers changed), and one public name defined at
# module level in two modules (a second definition under the same name). The repository's
# `duplicates` command compares lines instead (runs of six lines of one shape); over vmcgrad/ its
# pairs are docstring examples and keyword lists, so a test on lines would be mostly allow-list. An
# expression repeated (``plan_chunks(x.n_local, x.chunk_size)`` ten times) is found by neither: the
# package's repeated expressions are mostly idiom (``jax.ShapeDtypeStruct(x.shape, x.dtype)``).

#: Functions whose body (less its docstring) has fewer AST nodes than this are not compared: below
#: it, ``return call(program, self.problem, self)`` and its like share a shape without sharing a concept.
MIN_SHAPE_NODES = 12

#: Functions that share a body shape on purpose (each place ``module:qualified name``), with why.
_ABSTRACT, _HOLO = "vmcgrad._sr.qgt.abstract:AbstractQGT", "vmcgrad._checks.holomorphy"
SAME_SHAPE_ALLOWED = {
    frozenset({"vmcgrad._runner.body:Operands.map", "vmcgrad._runner.body:Outputs.map"}): (
        "the same map on two NamedTuples, which cannot share it through a base class"
    ),
    frozenset(
        {"vmcgrad._sr.qgt.abstract:AbstractQGT.to_dense", "vmcgrad._sr.qgt.abstract:AbstractQGT.diagonal"}
    ): ("each runs its own compiled program: the shape is the calling convention"),
    frozenset(
        {"vmcgrad._checks.holomorphy:_linear_jaxpr.read", "vmcgrad._checks.row_coupling:_batch_jaxpr.read"}
    ): ("a two-line reader of each jaxpr walker's own environment"),
    frozenset({f"{_HOLO}:_cauchy_riemann_error.jvp", "vmcgrad._checks.tangent:tangent_jaxpr.tangent"}): (
        "a one-line jax.jvp closure over each caller's function and rows"
    ),
    frozenset({"vmcgrad.cli._args:positive_int", "vmcgrad.cli._distributed:non_negative_int"}): (
        "two bounds (>= 1, >= 0) of the command line's integer options; cli/ is being reworked (issue 46)"
    ),
}

#: Public names defined at module level in more than one module, with why (homonyms, adapters).
SAME_NAME_ALLOWED = {
    "NAME": "each vmcgrad.netket module's public name, for its messages",
    "auto_chunk_size": "vmcgrad.netket's adapter of vmcgrad.auto_chunk_size to a NetKet state",
    "log_psi": (
        "the command line's defers to vmcgrad.netket's (imported late: `vmcgrad vmc --help` imports no JAX)"
    ),
    "remember": "homonyms: a memo of the tangent checks, and the chunk kept after an out-of-memory retry",
    "describe": "homonyms: an input described for an error message, and an exception in one line",
    "build": "homonyms: the Nystrom preconditioner, and the command line's physical system",
    "check": "homonyms: the command line's option checks (two commands), and the NetKet version check",
    "ENV": "homonyms: the cost platform's environment variable, and the supervised child's marker",
    "ROUTES": "MinSR's route names, and the command line's words for each (its header)",
    "FORMAT": "homonyms: the layouts of two files, the checkpoint and run.json, each versioned apart",
}


class _Shape(ast.NodeTransformer):
    """A function body with its names, argument names and constants replaced (attributes, keyword
    names and the structure stay): a copy renamed has the same dump."""

    def visit_Name(self, node):
        return ast.Name(id="_", ctx=node.ctx)

    def visit_arg(self, node):
        return ast.arg(arg="_")

    def visit_Constant(self, node):
        return ast.Constant(value=0)

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.name, node.returns, node.decorator_list = "_", None, []
        return node


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function in ``tree``, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def body_shape(node: ast.FunctionDef) -> tuple[str, int]:
    """The dump of ``node``'s body less its docstring, names and constants abstracted, and its size."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    shaped = ast.Module(body=[_Shape().visit(ast.parse(ast.unparse(stmt))) for stmt in body], type_ignores=[])
    return ast.dump(shaped, annotate_fields=False), sum(1 for _ in ast.walk(shaped))


def same_shape_functions(root: Path, min_nodes: int = MIN_SHAPE_NODES) -> list[tuple[str, ...]]:
    """The groups of functions under ``root`` with one body shape (``module:qualified name`` each;
    a name defined twice in one module stands twice)."""
    places: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        for qualname, node in _functions(ast.parse(path.read_text())):
            shape, size = body_shape(node)
            if size >= min_nodes:
                places.setdefault(shape, []).append(f"{module}:{qualname}")
    return sorted(tuple(sorted(group)) for group in places.values() if len(group) > 1)


def same_name_definitions(root: Path) -> dict[str, list[str]]:
    """Each public name (no leading underscore) defined at module level (def, class or assignment)
    in more than one module under ``root``, with those modules."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in defined:
                if not name.startswith("_"):
                    found.setdefault(name, set()).add(module_name(path, root))
    return {name: sorted(mods) for name, mods in sorted(found.items()) if len(mods) > 1}


def test_each_concept_is_defined_once():
    """No two functions of one body shape and no public name in two modules, but those listed with
    their reason; and every listed pair or name still exists (a stale entry is removed)."""
    shapes = [group for group in same_shape_functions(PACKAGE) if len(set(group)) == len(group)]
    assert [
        group for group in same_shape_functions(PACKAGE) if frozenset(group) not in SAME_SHAPE_ALLOWED
    ] == []
    assert [sorted(group) for group in SAME_SHAPE_ALLOWED if group not in map(frozenset, shapes)] == []
    names = same_name_definitions(PACKAGE)
    assert {name: mods for name, mods in names.items() if name not in SAME_NAME_ALLOWED} == {}
    assert sorted(SAME_NAME_ALLOWED.keys() - names.keys()) == []


def test_the_one_definition_check_sees_a_renamed_copy_and_a_second_name(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "def budget(prob):\n"
        '    """The budget or the default."""\n'
        "    return prob.memory_budget if prob.memory_budget is not None else default(2 ** 30)\n\n\n"
        "def log_psi(vstate):\n    return vstate.apply\n"
    )
    (package / "b.py").write_text(
        "class Route:\n"
        "    def _budget_of(self, p):\n"
        "        return p.memory_budget if p.memory_budget is not None else default(2**20)\n\n\n"
        "log_psi = None\n"
    )
    assert same_shape_functions(package) == [("pkg.a:budget", "pkg.b:Route._budget_of")]
    assert same_name_definitions(package) == {"log_psi": ["pkg.a", "pkg.b"]}
    # below the size compared, or with another attribute: no pair
    assert same_shape_functions(package, min_nodes=100) == []
    (package / "b.py").write_text(
        "def budget_of(p):\n    return p.chunk_size if p.chunk_size is not None else default(1)\n"
    )
    assert same_shape_functions(package) == []
