"""The JAX internals vmcgrad relies on: one table (``vmcgrad._jax_private``), complete, checked at
import with vmcgrad's name, and the primitive names the jaxpr analyses match by string exist in JAX.
"""

import ast
import pathlib
import subprocess
import sys

import jax
import pytest

from vmcgrad import _jax_private
from vmcgrad._checks import holomorphy, row_rules

PACKAGE = pathlib.Path(_jax_private.__file__).parent
PRIVATE = PACKAGE / "_jax_private.py"
# module prefixes that are JAX internals: imported only through vmcgrad._jax_private
INTERNAL_MODULES = ("jax._src", "jax.extend", "jax.interpreters", "jax.custom_derivatives")
# attribute chains on `jax` that are internals or not yet stable API (each must be in the table)
INTERNAL_ATTRS = ("jax.core.", "jax.ref.", "jax.new_ref", "jax._src.")


def test_every_internal_resolves_in_the_installed_jax():
    assert _jax_private.missing_internals(lazy=True) == []


def test_a_missing_internal_is_reported_with_vmcgrads_name(monkeypatch):
    planted = _jax_private.Internal("jax.extend.core", "NoSuchInternal", "a test")
    monkeypatch.setattr(_jax_private, "INTERNALS", (*_jax_private.INTERNALS, planted))
    with pytest.raises(ImportError) as err:
        _jax_private.check_internals(_jax_private.INTERNALS)
    message = str(err.value)
    assert message.startswith("vmcgrad: ") and "jax.extend.core.NoSuchInternal (used by a test)" in message
    assert f"jax {jax.__version__}" in message and f"jax=={_jax_private.SUPPORTED_JAX}" in message
    assert isinstance(err.value, RuntimeError)  # also what the lazy checks raised before


def test_import_fails_with_vmcgrads_name_when_jax_lacks_one():
    """In a fresh process whose JAX lacks ``jax.new_ref``, the first vmcgrad module that needs the
    internals fails to import, with vmcgrad's message."""
    code = "import jax; del jax.new_ref; import vmcgrad; vmcgrad.batched_vjp"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("vmcgrad._jax_private.PrivateJaxAPIError: vmcgrad: the installed jax"), last
    assert "jax.new_ref (used by vmcgrad._runner.runner" in last and _jax_private.SUPPORTED_JAX in last


def test_lazy_internal_checked_where_used(monkeypatch):
    module = _jax_private.gloo_tcp_collectives_module()
    assert callable(module.make_gloo_tcp_collectives)
    monkeypatch.delattr(module, "make_gloo_tcp_collectives")
    with pytest.raises(ImportError, match=r"^vmcgrad: .*make_gloo_tcp_collectives"):
        _jax_private.gloo_tcp_collectives_module()


def _imports_and_attrs(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    imports, attrs = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Attribute):
            attrs.append((ast.unparse(node), node.lineno))
    return imports, attrs


def test_internals_are_imported_only_through_the_table():
    """No module but ``_jax_private`` imports a JAX internal module, and every internal attribute
    chain the package uses (``jax.core.Tracer``, ``jax.new_ref``, ...) is an entry of the table."""
    table = {item.name for item in _jax_private.INTERNALS}
    stray, unlisted = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        imports, attrs = _imports_and_attrs(path)
        where = path.relative_to(PACKAGE.parent)
        if path != PRIVATE:
            stray += [f"{where}:{line} {n}" for n, line in imports if n.startswith(INTERNAL_MODULES)]
        for chain, line in attrs:
            if chain.startswith(INTERNAL_ATTRS) and chain not in table:
                # a prefix of a listed name (jax.core in jax.core.Tracer) is fine
                if not any(name.startswith(chain + ".") for name in table):
                    unlisted.append(f"{where}:{line} {chain}")
    assert not stray, f"import these through vmcgrad._jax_private: {stray}"
    assert not unlisted, f"add these to vmcgrad._jax_private.INTERNALS: {unlisted}"


def test_the_table_walk_sees_a_stray_import(tmp_path):
    """The companion: the walk finds a private import and an unlisted attribute chain."""
    path = tmp_path / "m.py"
    path.write_text("from jax._src import core\nimport jax\nx = jax.core.get_aval\n")
    imports, attrs = _imports_and_attrs(path)
    assert ("jax._src.core", 1) in imports and ("jax.core.get_aval", 3) in attrs


def test_every_primitive_name_of_the_analyses_exists_in_jax():
    names = holomorphy.primitive_names()
    assert len(names) > 100  # the tables are read (136 names on jax 0.10.2)
    assert _jax_private.missing_primitives(names) == []


def test_a_primitive_name_jax_lacks_is_reported(monkeypatch):
    monkeypatch.setitem(row_rules.RULES, "no_such_primitive_in_jax", lambda e, i: None)
    monkeypatch.setattr(row_rules, "ELEMENTWISE", row_rules.ELEMENTWISE | {"cos_renamed"})
    missing = _jax_private.missing_primitives(holomorphy.primitive_names())
    assert missing == ["cos_renamed", "no_such_primitive_in_jax"]
