"""A Tuning drawn and written: measured vs predicted trial by trial, and a self-contained page.
Every string that reaches the page (the log, stage names in the code) is escaped: a tuning file
read from elsewhere is data, never markup."""

from __future__ import annotations

import html
import time
from pathlib import Path

from bokeh.models import ColumnDataSource, HoverTool, Legend, Whisker
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .._tune.result import Tuning
from .report import write_page

__all__ = ["html_summary", "tuning_plot", "write_html"]

_COLORS = {"thread": Category10_10[0], "subprocess-threads": Category10_10[1], "process": Category10_10[2]}


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
