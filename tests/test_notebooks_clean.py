"""Committed notebooks carry no outputs (nbstripout's rule); they are executed in CI by nbmake."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/*.ipynb not found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell.get("outputs") or cell.get("execution_count") is not None
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; run `nbstripout {path}` before committing"
