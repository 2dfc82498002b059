"""A data-parallel job's records (a ``rankR.sqlite`` per rank, one folder) as one self-contained
HTML page: the verdict, a row per rank, and each figure over time with a line per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bokeh.layouts import gridplot
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .job_dashboard import _table_html
from .report import write_page

__all__ = ["write_job_report"]

#: (series, stage or None for each loader stage, title, y label) of the plots over time.
PLOTS = [("batches_per_s", "step", "steps/s", "steps/s"),
         ("data_wait_frac", "step", "data wait, share of the loop", "share"),
         ("step_ms", "step", "step time (ms)", "ms"),
         ("qps", None, "items/s", "items/s")]


def write_job_report(job: Any, path: str | os.PathLike) -> Path:
    """Write ``job`` (a JobSession, live or from its folder) to ``path``; return the path."""
    frames = job.frames().dropna(subset=["value"])  # numbers already: each rank's ring holds floats
    stages = sorted({s for s in frames.loc[frames["series"] == "qps", "stage"] if s != "step" and "/worker" not in s})
    figures = []
    for series, stage, title, axis in PLOTS:
        for name in [stage] if stage else stages:
            fig = figure(title=f"{name}: {title}" if stage is None else title, height=240, width=460,
                         x_axis_label="seconds since the rank started", y_axis_label=axis, toolbar_location=None)
            for i, (rank, rows) in enumerate(frames[(frames["series"] == series) & (frames["stage"] == name)]
                                             .groupby("rank")):
                fig.line(rows["time_s"], rows["value"], color=Category10_10[i % 10], line_width=2,
                         legend_label=f"rank {rank}")
            figures.append(fig)
    verdict = job.verdict()
    note = (f"{len(job.ranks)} ranks (world size {job.world_size or '?'}), {job.state}; "
            f"verdict over each rank's last seconds: {verdict}")
    table = _table_html(job.summary())
    return write_page(gridplot(figures, ncols=2), path, f"spdl_lab job {job.name}", note=note, table=table)
