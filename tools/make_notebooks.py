"""Write the tutorial notebooks from the cell sources below (no outputs stored).

Notebooks are edited here, not in Jupyter, so that reviews read as code:
    python tools/make_notebooks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from notebook_sources import NOTEBOOKS  # noqa: E402


def build(name: str, cells: list[tuple[str, str]]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    stem = name.split("_", 1)[0]
    for i, (kind, source) in enumerate(cells):
        source = source.strip("\n")
        cell = nbformat.v4.new_markdown_cell(source) if kind == "md" else nbformat.v4.new_code_cell(source)
        cell.id = f"nb{stem}-{i:02d}"  # stable ids keep diffs quiet
        nb.cells.append(cell)
    path = ROOT / "notebooks" / name
    nbformat.write(nb, path)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    for name, cells in NOTEBOOKS.items():
        build(name, cells)
