"""Bokeh figures built from frames and tables (never from runners)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, HoverTool, Legend, Whisker
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

if TYPE_CHECKING:
    from .._experiments.compare import Comparison

__all__ = ["comparison_plot"]


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
