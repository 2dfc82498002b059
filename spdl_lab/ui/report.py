"""Static, self-contained HTML reports (Bokeh INLINE: no network needed to open them)."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bokeh.embed import components
from bokeh.embed.bundle import bundle_for_objs_and_resources
from bokeh.resources import INLINE

if TYPE_CHECKING:
    from ..experiments.compare import Comparison

__all__ = ["write_comparison_report"]

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
{resources}
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.note {{ color: #555; max-width: 60em; }}
.warnings {{ background: #fff4e5; border-left: 4px solid #e69500; padding: 0.5em 1em; max-width: 60em; }}
</style></head>
<body><h1>{title}</h1><p class="note">{note}</p>{table}{script}{div}</body></html>
"""


def write_comparison_report(cmp: Comparison, path: str | Path, *, title: str = "spdl_lab comparison",
                            note: str = "") -> Path:
    """Write the comparison's warnings, table and plots to one HTML file; return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = cmp.plot()
    script, div = components(layout)
    note = note or f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}."
    page = _PAGE.format(
        title=html.escape(title),
        note=html.escape(note),
        # Only the bundles this layout uses (not widgets, tables, MathJax): a third of the size.
        resources="".join(bundle_for_objs_and_resources([layout], INLINE)),
        table=cmp._repr_html_(),
        script=script,
        div=div,
    )
    path.write_text(page, encoding="utf-8")
    return path
