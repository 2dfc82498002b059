"""Static, self-contained HTML reports (Bokeh INLINE: no network needed to open them), and the
figures and pages of a Comparison and a Tuning. Every string that reaches a page is escaped: a
file read from elsewhere is data, never markup."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, HoverTool, Legend, Whisker
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from bokeh.resources import INLINE

if TYPE_CHECKING:
    from .._experiments.compare import Comparison
    from .._tune.result import Tuning

#: Each runner's colour in the tuning plot.
_COLORS = {"thread": Category10_10[0], "subprocess-threads": Category10_10[1], "process": Category10_10[2]}

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


def comparison_plot(cmp: Comparison):
    """Batches/s per runner, step time over time per runner, and where the training thread waited."""
    table = cmp.table
    runners = list(table.index)
    colors = {name: Category10_10[i % 10] for i, name in enumerate(runners)}
    one_row_each = dict(y_range=runners[::-1], height=60 + 40 * len(runners), width=420,
                        toolbar_location=None)
    bars = figure(title=f"training throughput: median of {cmp.repeats} round(s), whiskers the "
                  "slowest and fastest", x_axis_label="batches/s (higher is better)",
                  **one_row_each)
    source = ColumnDataSource(dict(runner=runners, value=list(table["batches_per_s"]),
                                   color=[colors[r] for r in runners],
                                   lo=list(table["batches_per_s_lo"]),
                                   hi=list(table["batches_per_s_hi"])))
    bars.hbar(y="runner", right="value", height=0.6, color="color", source=source)
    bars.add_layout(Whisker(source=source, base="runner", lower="lo", upper="hi", dimension="width"))
    bars.add_tools(HoverTool(tooltips=[("runner", "@runner"), ("batches/s", "@value{0.00}"),
                                       ("rounds", "@lo{0.00} to @hi{0.00}")]))

    waits = figure(title="training thread: share of time waiting (GIL, CPU, data)",
                   x_axis_label="share of the loop", **one_row_each)
    parts = [("gil_wait_frac", "GIL"), ("runqueue_wait_frac", "CPU run queue"), ("data_wait_frac", "data")]
    left = [0.0] * len(runners)
    items = []
    for i, (col, label) in enumerate(parts):
        values = [float(v) if pd.notna(v) else 0.0 for v in table[col]]
        right = [a + b for a, b in zip(left, values)]
        items.append((label, [waits.hbar(y=runners, left=left, right=right, height=0.6,
                                         color=Category10_10[(i + 3) % 10])]))
        left = right
    waits.add_layout(Legend(items=items), "below")

    steps = figure(width=840, height=260, title="step time over the run (ms)", toolbar_location=None,
                   x_axis_label="seconds since the runner started", y_axis_label="step_ms")
    lines = []
    for runner in runners:
        frame = cmp.frames.get(runner)
        sel = frame[(frame["series"] == "step_ms") & (frame["stage"] == "step")] if frame is not None else None
        if sel is not None and not sel.empty:
            lines.append((runner, [steps.line(sel["time_s"], sel["value"], color=colors[runner], line_width=2)]))
    if lines:
        steps.add_layout(Legend(items=lines), "right")
    return column(row(bars, waits), steps)


def tuning_plot(tuning: Tuning):
    """Each trial's measured batches/s (its windows' range as whiskers) and the model's prediction."""
    t = tuning.trials
    x = list(range(1, len(t) + 1))
    fig = figure(width=760, height=320, toolbar_location=None, x_axis_label="trial (in the order measured)",
                 y_axis_label="training batches/s", title=f"tuning: {tuning.summary()}"[:160])
    numbers = {name: t[col].astype(float).tolist() for name, col in (
        ("measured", "batches_per_s"), ("lo", "batches_per_s_lo"), ("hi", "batches_per_s_hi"),
        ("predicted", "predicted_batches_per_s"))}
    source = ColumnDataSource(dict(
        x=x, **numbers, color=[_COLORS.get(r, "#777") for r in t["runner"]], move=list(t["move"]),
        kept=["kept" if k else "reverted" for k in t["kept"]], runner=list(t["runner"]),
        size=[11 if k else 7 for k in t["kept"]],
    ))
    measured = fig.scatter("x", "measured", size="size", color="color", source=source)
    fig.add_layout(Whisker(source=source, base="x", lower="lo", upper="hi", line_color="#999"))
    predicted = fig.scatter("x", "predicted", marker="x", size=10, color="#444", source=source)
    running = t["batches_per_s"].astype(float).where(t["kept"].astype(bool)).ffill().tolist()  # best so far
    line = fig.step(x, running, mode="after", color="#d62728", line_dash="dashed")
    fig.add_tools(HoverTool(renderers=[measured], tooltips=[
        ("move", "@move"), ("runner", "@runner"), ("measured", "@measured{0.00} (@lo{0.00}-@hi{0.00})"),
        ("predicted", "@predicted{0.00}"), ("", "@kept")]))
    fig.add_layout(Legend(items=[("measured (size: kept)", [measured]), ("predicted", [predicted]),
                                 ("best so far", [line])]), "right")
    return fig


def html_summary(tuning: Tuning) -> str:
    """The summary, the code and the log as HTML, everything escaped."""
    log = "".join(f"<li>{html.escape(line)}</li>" for line in tuning.log)
    cols = ["runner", "concurrency", "batches_per_s", "predicted_batches_per_s", "step_p50_ms", "data_wait_frac",
            "cpu_percent", "move", "kept"]
    cols += [c for c in ("others_percent", "restart_s") if c in tuning.trials]
    table = tuning.trials[cols].to_html(float_format=lambda v: f"{v:,.3g}", escape=True)
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in tuning.warnings)
    warned = (f'<div style="background:#fff3cd;border-left:4px solid #d9a400;padding:4px 8px">'
              f"<b>No move recommended from this measurement:</b><ul>{warnings}</ul></div>") if warnings else ""
    return (f"<p><b>{html.escape(tuning.summary())}</b></p>{warned}<pre>{html.escape(tuning.code)}</pre>"
            f"<ol>{log}</ol>{table}")


def write_html(tuning: Tuning, path: str | Path, *, title: str = "spdl_lab tuning") -> Path:
    """One HTML file (Bokeh inline, nothing fetched): summary, code, log, trials and the plot."""
    note = f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}; {tuning.cores} cores."
    return write_page(tuning_plot(tuning), path, title, note=note, table=html_summary(tuning))
