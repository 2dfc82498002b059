"""Write the tutorial notebooks, notebooks/*.ipynb, from their sources, notebooks/*.py.

The sources are jupytext percent-format scripts: edit them, not the notebooks, then run
    python tools/sync_notebooks.py
The notebooks store no outputs, and cell ids follow the cell's place, so diffs stay quiet.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
}


def notebook(source: Path) -> nbformat.NotebookNode:
    """The notebook that ``source`` (a percent-format script) describes."""
    nb = jupytext.read(source, fmt="py:percent")
    nb.metadata = nbformat.from_dict(METADATA)
    number = source.stem.split("_", 1)[0]
    for i, cell in enumerate(nb.cells):
        cell.id = f"nb{number}-{i:02d}"
    return nb


def render(source: Path) -> str:
    """The text of the .ipynb file written for ``source``."""
    return nbformat.writes(notebook(source)) + "\n"


def sources() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9]*.py"))


def main() -> None:
    for source in sources():
        target = source.with_suffix(".ipynb")
        text = render(source)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(NOTEBOOKS.parent)}")


if __name__ == "__main__":
    main()
