"""Static, self-contained HTML reports (Bokeh INLINE: no network needed to open them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bokeh.embed import file_html
from bokeh.resources import INLINE

if TYPE_CHECKING:
    from .._experiments.compare import Comparison

__all__ = ["write_comparison_report", "write_page"]

# Bokeh's own page (bokeh.core.templates.FILE) with our text and style around its plots;
# Jinja escapes nothing by itself here, so every text the user gave passes through ``e``.
_PAGE = """
{% block postamble %}<style>
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.note { color: #555; max-width: 60em; }
.warnings { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.5em 1em; max-width: 60em; }
</style>{% endblock %}
{% block contents %}<h1>{{ title | e }}</h1><p class="note">{{ note | e }}</p>{{ table }}{{ super() }}{{ after }}
{% endblock %}
"""


def write_page(layout: Any, path: str | Path, title: str, **variables: str) -> Path:
    """``layout`` in one HTML file, the page's ``note`` and the HTML of ``table`` above it and of
    ``after`` below it (both escaped by whoever made them); return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # INLINE: Bokeh's code in the page, only the bundles this layout uses; nothing fetched.
    page = file_html(layout, INLINE, title, template=_PAGE, template_variables=variables)
    path.write_text(page, encoding="utf-8")
    return path


def write_comparison_report(cmp: Comparison, path: str | Path, *, title: str = "spdl_lab comparison",
                            note: str = "") -> Path:
    """Write the comparison's warnings, table and plots to one HTML file; return its path."""
    note = note or f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}."
    return write_page(cmp.plot(), path, title, note=note, table=cmp._repr_html_())
