"""The tutorial notebooks are generated from their jupytext sources and kept in sync."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _sync_tool():
    spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "tools" / "sync_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync = _sync_tool()


def test_every_source_has_a_notebook_and_every_notebook_a_source():
    sources = {p.stem for p in NOTEBOOKS.glob("*.py")}
    notebooks = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert sources == notebooks, "run: python tools/sync_notebooks.py"
    assert sources, "no tutorial sources in notebooks/"
    assert {p.stem for p in sync.sources()} == sources  # the tool sees every source


@pytest.mark.parametrize("source", sync.sources(), ids=lambda p: p.stem)
def test_notebook_is_in_sync_with_its_source(source):
    target = source.with_suffix(".ipynb")
    hint = f"{target.name} is out of date: run python tools/sync_notebooks.py"
    assert target.exists(), hint
    stored = nbformat.read(target, as_version=4)
    expected = sync.notebook(source)
    assert [(c.cell_type, c.source) for c in stored.cells] == \
        [(c.cell_type, c.source) for c in expected.cells], hint
    for cell in stored.cells:
        assert not cell.get("outputs") and cell.get("execution_count") is None, \
            f"{target.name}: cell {cell.id} stores outputs; run python tools/sync_notebooks.py"
    assert stored.metadata["kernelspec"]["name"] == "python3"
    assert target.read_text() == sync.render(source), hint  # ids and metadata too
