"""Sphinx configuration for the vmcgrad documentation (MyST Markdown, notebooks via myst-nb).

Build (offline; no intersphinx, MathJax is only referenced by the pages and loaded by the browser)::

    rm -rf docs/_notebooks && mkdir docs/_notebooks && cp notebooks/*.ipynb docs/_notebooks/
    python -m pytest --nbmake --overwrite docs/_notebooks    # execute + assert, keep the outputs
    sphinx-build -W -b html docs docs/_build/html

Notebooks are never executed by Sphinx (``nb_execution_mode = "off"``). The notebook test step
executes each notebook once (nbmake; a failing assertion in a cell fails it) on a copy in the
git-ignored ``docs/_notebooks/``, and ``--overwrite`` leaves the outputs there; the site renders
those copies. A notebook whose executed copy is missing or stale (its code differs from
``notebooks/``) is rendered from its stripped source, without outputs, and the build says so; with
``VMCGRAD_DOCS_REQUIRE_EXECUTED=1`` (set in ``.ci/run``) that is an error instead.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout, installed or not

import vmcgrad  # noqa: E402

project = "vmcgrad"
author = "the vmcgrad authors"
copyright = "2026, the vmcgrad authors"
release = version = vmcgrad.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
# No sphinx.ext.intersphinx: the build must not need the network.

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

nb_execution_mode = "off"  # notebooks are executed (and asserted) by the notebook test step, not here
nb_merge_streams = True
nb_output_stderr = "remove"  # import-time warnings (tqdm, NetKet tips) are noise on the pages

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Members inherited from vmcgrad's private bases are documented on the public class (QGTOperator's
# and LinearizedQGT's solve, to_dense and replace live in vmcgrad._sr.qgt.abstract.AbstractQGT); those of
# Python's own bases (tuple for NamedTuples, exceptions, object) are not, nor NetKet's (the
# vmcgrad.netket page, below, documents what the adapter itself defines).
autodoc_default_options = {
    "members": True,
    "show-inheritance": False,
    "inherited-members": "tuple,BaseException,object",
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: no duplicate descriptions of NamedTuple fields

html_theme = "alabaster"
html_title = f"vmcgrad {release}"
html_static_path: list[str] = []


# --- notebooks: render the executed copies ------------------------------------------------------

NOTEBOOKS = ROOT / "notebooks"
EXECUTED = DOCS / "_notebooks"


def _code(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _sync_notebooks() -> None:
    """Ensures docs/_notebooks/ holds one page per notebooks/*.ipynb (executed when available)."""
    EXECUTED.mkdir(exist_ok=True)
    sources = {p.name: p for p in NOTEBOOKS.glob("*.ipynb")}
    for old in EXECUTED.glob("*.ipynb"):
        if old.name not in sources:
            old.unlink()
    missing = []
    for name, src in sorted(sources.items()):
        copy = EXECUTED / name
        if copy.exists() and _code(copy) == _code(src):
            if any(c.get("outputs") for c in json.loads(copy.read_text())["cells"]):
                continue
        missing.append(name)
        shutil.copyfile(src, copy)
    if not missing:
        return
    message = (
        f"docs: no up-to-date executed copy of {', '.join(missing)}; rendered without outputs. "
        "Execute them first (see docs/conf.py or the Getting started page)."
    )
    if os.environ.get("VMCGRAD_DOCS_REQUIRE_EXECUTED") == "1":
        raise RuntimeError(message)
    print(message, file=sys.stderr)


_sync_notebooks()


# --- API pages for optional subpackages ---------------------------------------------------------

GENERATED = DOCS / "_generated"


def _optional_api(module: str, title: str) -> None:
    """Writes _generated/<module>.md: its autodoc, or a note if it cannot be imported here."""
    GENERATED.mkdir(exist_ok=True)
    try:
        importlib.import_module(module)
    except ImportError as err:
        body = f"`{module}` could not be imported in this build ({err}); its reference is omitted.\n"
    else:
        body = f"```{{eval-rst}}\n.. automodule:: {module}\n   :no-inherited-members:\n```\n"
    target = GENERATED / f"{module}.md"
    if not target.exists() or target.read_text() != body:
        target.write_text(body)


_optional_api("vmcgrad.netket", "vmcgrad.netket")
