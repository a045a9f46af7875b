"""The package's layers: every import points down.

``LAYERS`` is the package's order, top to bottom, written once here and drawn in docs/concepts.md. A
module may import from its own room (a folder, or a top-level module) and from the rooms of lower
layers; never up, and never sideways into another room of its own layer. Imports inside functions
count, and so do ``if TYPE_CHECKING:`` ones (an annotation-only import still ties the two modules
together). ``python tests/test_layers.py`` prints the order the imports draw.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from helpers import module_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vmcgrad"

#: The layers, top to bottom; each a tuple of rooms (a module, or a folder and everything in it).
#: ``vmcgrad`` alone is the package's ``__init__`` (the public surface).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("vmcgrad.__main__",),
    ("vmcgrad.cli",),
    ("vmcgrad.netket",),
    ("vmcgrad",),
    ("vmcgrad._auto_chunk_size",),
    ("vmcgrad._sr.qgt", "vmcgrad._sr.ntk"),  # the two wings: neither imports the other
    ("vmcgrad._sr",),  # their shared base: base, modes, solve
    ("vmcgrad._estimators",),
    ("vmcgrad._runner",),
    ("vmcgrad._problem",),
    ("vmcgrad._checks", "vmcgrad._chunks"),
    ("vmcgrad._cache", "vmcgrad._distributed"),
    ("vmcgrad._function", "vmcgrad._hlo", "vmcgrad._jax_private", "vmcgrad._warnings"),
)


def _imports(tree: ast.AST, package: list[str], files: set[str]):
    """``(imported module, node)`` for each import of a package module in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield (full if full in files else target), node
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: at module level, inside functions, and under
    ``if TYPE_CHECKING:``. ``from . import x`` is an import of module ``x`` when ``x`` is a module,
    else of the package."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = {t for t, _ in _imports(ast.parse(path.read_text()), package, set(paths))}
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def unresolved_imports(root: Path) -> list[str]:
    """Imports of a module of the package that does not exist (a stale name after a move): the
    graph cannot see them, so they are checked apart."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    found = []
    for name, path in sorted(paths.items()):
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for target, node in _imports(ast.parse(path.read_text()), package, set(paths)):
            if target.split(".")[0] == root.name and target not in paths:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {target}")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def room_of(module: str, layers=LAYERS) -> tuple[int, str]:
    """``(layer index, room)`` of ``module``: the longest room name that is the module or a package
    holding it (``vmcgrad`` holds only itself: the package's ``__init__``)."""
    best = None
    for i, rooms in enumerate(layers):
        for room in rooms:
            inside = module == room or (room != layers[3][0] and module.startswith(room + "."))
            if inside and (best is None or len(room) > len(best[1])):
                best = (i, room)
    if best is None:
        raise AssertionError(f"{module} is in no room of LAYERS: add it to tests/test_layers.py")
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import that points up a layer, or sideways into another room of the same layer."""
    bad = []
    for a, targets in sorted(graph.items()):
        la, ra = room_of(a, layers)
        for b in sorted(targets):
            lb, rb = room_of(b, layers)
            if ra != rb and lb <= la:
                bad.append(f"{a} ({ra}, layer {la}) imports {b} ({rb}, layer {lb})")
    return bad


def local_imports_without_reason(root: Path) -> list[str]:
    """Imports of the package's own modules inside functions with no comment saying why (on the
    import's line or the line above it): a local import must break a real cycle or defer a heavy
    import, and say which."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    found = []
    for name, path in sorted(paths.items()):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        local = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
        for target, node in _imports(tree, package, set(paths)):
            if id(node) not in local or target.split(".")[0] != root.name:
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if "#" not in here and not above.startswith("#"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {here.strip()}")
    return sorted(set(found))


def test_no_module_imports_up_or_sideways():
    graph = import_graph(PACKAGE)
    # the reading sees function-level and TYPE_CHECKING imports
    assert "vmcgrad.netket" in graph["vmcgrad.cli.vmc"]
    assert "vmcgrad._sr.qgt.qgt" in graph["vmcgrad"]
    assert upward_imports(graph) == []


def test_every_import_of_the_package_resolves():
    assert unresolved_imports(PACKAGE) == []


def test_the_resolution_check_sees_a_stale_module_name(tmp_path):
    pkg = _planted(tmp_path, {"__init__.py": "", "_a.py": "from vmcgrad._gone import f\n"})
    assert unresolved_imports(pkg) == ["vmcgrad/_a.py:1: vmcgrad._gone"]


def test_the_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_each_local_import_of_the_package_says_why():
    assert local_imports_without_reason(PACKAGE) == []


def test_every_layer_room_exists():
    """A room of LAYERS that names nothing is a stale line of the order."""
    graph = import_graph(PACKAGE)
    for rooms in LAYERS:
        for room in rooms:
            assert any(m == room or m.startswith(room + ".") for m in graph), room


# --- the detectors fire ---------------------------------------------------------------------------


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "vmcgrad"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


@pytest.mark.parametrize(
    "where, text, expected",
    [
        ("_cache.py", "from vmcgrad._problem import problem\n", "vmcgrad._cache (vmcgrad._cache, layer 11)"),
        ("_cache.py", "def f():\n    from vmcgrad._sr import solve\n", "imports vmcgrad._sr.solve"),
        (
            "_cache.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vmcgrad._runner import body\n",
            "imports vmcgrad._runner.body",
        ),
        ("_sr/qgt/views.py", "from vmcgrad._sr.ntk import minsr\n", "sideways" and "vmcgrad._sr.ntk.minsr"),
        ("_chunks/plan.py", "from vmcgrad._checks import tangent\n", "imports vmcgrad._checks.tangent"),
        ("_hlo/cost.py", "from vmcgrad._chunks import plan\n", "imports vmcgrad._chunks.plan"),
    ],
)
def test_the_layer_check_sees_a_planted_upward_import(tmp_path, where, text, expected):
    files = {
        "__init__.py": "",
        "_cache.py": "",
        "_problem/__init__.py": "",
        "_problem/problem.py": "from vmcgrad._cache import x\n",
        "_runner/__init__.py": "",
        "_runner/body.py": "",
        "_sr/__init__.py": "",
        "_sr/solve.py": "",
        "_sr/qgt/__init__.py": "",
        "_sr/qgt/views.py": "from vmcgrad._sr import solve\n",
        "_sr/ntk/__init__.py": "",
        "_sr/ntk/minsr.py": "from vmcgrad._sr.solve import cg\n",
        "_checks/__init__.py": "",
        "_checks/tangent.py": "",
        "_hlo/__init__.py": "",
        "_hlo/cost.py": "",
        "_chunks/__init__.py": "",
        "_chunks/plan.py": "",
    }
    pkg = _planted(tmp_path, files)
    assert upward_imports(import_graph(pkg)) == []  # the clean plant passes
    (pkg / where).write_text(text)
    bad = upward_imports(import_graph(pkg))
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_cycle_finder_sees_an_annotation_only_cycle(tmp_path):
    pkg = _planted(
        tmp_path,
        {
            "__init__.py": "from ._a import f\n",
            "_a.py": "def f():\n    from ._b import g  # planted\n    return g\n",
            "_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _a\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["vmcgrad._b"] == {"vmcgrad._a"}  # the TYPE_CHECKING import is an edge
    assert find_cycle(graph) == ["vmcgrad._a", "vmcgrad._b", "vmcgrad._a"]


def test_the_reason_check_sees_a_bare_local_import(tmp_path):
    pkg = _planted(
        tmp_path,
        {
            "__init__.py": "",
            "_a.py": (
                "def f():\n    # defers JAX\n    from vmcgrad import _b\n\n\n"
                "def g():\n    from vmcgrad import _b\n"
            ),
            "_b.py": "",
        },
    )
    assert local_imports_without_reason(pkg) == ["vmcgrad/_a.py:7: from vmcgrad import _b"]


# --- the test suite: shared code in tests/helpers.py, no test module importing another ------------

TESTS = ROOT / "tests"
#: The modules of tests/ that may import conftest, each with its reason (shared code is in helpers.py).
CONFTEST_IMPORTERS = {"test_tiers": "it tests conftest's own tier selection and XLA flags"}


def imports_of_test_modules(tests: Path = TESTS) -> list[str]:
    """Where a module of ``tests`` imports a test module (``test_*``), or conftest outside
    :data:`CONFTEST_IMPORTERS`: a newcomer reads a test module alone, and shared code lives in
    tests/helpers.py (fixtures in tests/conftest.py), where pytest's own import of conftest does not
    run it twice. Function-level imports count."""
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top.startswith("test_") or (top == "conftest" and path.stem not in CONFTEST_IMPORTERS):
                    found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_no_test_module_imports_another():
    assert imports_of_test_modules() == []


def test_the_test_import_check_sees_a_test_module_imported(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "test_a.py").write_text("from helpers import X\n\n\ndef _y():\n    return X\n")
    (tmp_path / "test_b.py").write_text("import os\n\n\ndef test_b():\n    from test_a import _y\n")
    (tmp_path / "test_c.py").write_text("from conftest import child_env\n")
    assert imports_of_test_modules(tmp_path) == ["test_b.py:5: test_a", "test_c.py:1: conftest"]


def drawn_order(root: Path = PACKAGE) -> str:
    """The rooms in the order the imports draw them (each below every room that imports it), with
    the number of arrows that point up; ``python tests/test_layers.py`` prints it."""
    graph = import_graph(root)
    rooms = {m: room_of(m)[1] for m in graph}
    arrows = {(rooms[a], rooms[b]) for a, bs in graph.items() for b in bs if rooms[a] != rooms[b]}

    @functools.cache
    def height(room):  # the longest chain of arrows below this room
        return 1 + max((height(b) for a, b in arrows if a == room), default=0)

    order = sorted(set(rooms.values()), key=lambda r: (-height(r), r))
    return (
        " -> ".join(order)
        + f"\nrooms: {len(order)}, floors: {len({height(r) for r in order})}, "
        + f"arrows up or sideways: {len(upward_imports(graph))}"
    )


if __name__ == "__main__":
    print(drawn_order())
