"""A data-parallel job, live (``JobDashboard``: one thread pushes points at ``hz``) or as one page
(``write_job_report``): its ranks side by side, a line per rank (steps/s, data wait, step time,
each loader stage's items/s), a row per rank, and the straggler verdict."""

from __future__ import annotations

import html
import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
from bokeh.layouts import gridplot
from bokeh.models import ColumnDataSource
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .._table import num
from .._telemetry.frames import FrameChunk
from .._telemetry.live_verdict import rank_window
from .dashboard import LiveView, _set, html_table
from .report import write_page

DEFAULT_HZ = 1.0
#: A point a second per rank, each over the ticks of the latest SMOOTH_S (as the verdict reads
#: its window): a rank's steps do not fall on every 0.1 s tick, so a tick's own rate zigzags.
POINT_EVERY_S = 1.0
SMOOTH_S = 2.0
#: Points each rank's lines keep: an hour.
ROLLOVER = 3600
#: (column of a RankWindow, the step's series in a rank's frames, title, y axis) of the plots drawn
#: a line per rank; the loader's is added per stage.
_PLOTS = (("steps_per_s", "batches_per_s", "steps/s", "steps/s"),
          ("wait_frac", "data_wait_frac", "data wait, share of the loop", "share"),
          ("step_ms", "step_ms", "step time (ms): a rank's step holds its wait in the all-reduce", "ms"))


class JobDashboard(LiveView):
    """A live view of a ``JobSession`` (``job.dashboard()``); ``close()`` stops it, not the job."""

    def __init__(self, job: Any, *, hz: float = DEFAULT_HZ) -> None:
        super().__init__("spdl-lab-job-dashboard", hz)
        self.job = job
        self.verdict.add_class("spdl-lab-job-verdict")
        self.children = [self.header, self.verdict, self._plot_box, self.table]
        self._until: dict[int, float] = {}  # each rank's latest point (seconds since it started)
        self._sources: dict[int, ColumnDataSource] = {}
        self._drawn: tuple[tuple[tuple[int, str], ...], tuple[str, ...]] = ((), ())
        self.publish()
        self._publisher = threading.Thread(target=self._run, name="spdl_lab:job-dashboard",
                                           daemon=True)
        self._publisher.start()

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.publish()
            if not self.job.running:
                self.publish()  # the last ticks and the ranks' final states
                return

    def publish(self) -> None:
        """Push each rank's new points and rewrite the header, table and verdict."""
        with self._lock:
            ranks = self.job.ranks
            stages = tuple(sorted({stage for session in ranks.values()
                                   for series, stage in session.recent(SMOOTH_S).columns
                                   if series == "qps" and "/worker" not in stage and stage != "step"}))
            # A new rank, stage or training loop (a rank's runs keep their own clocks): drawn anew.
            drawn = (tuple((rank, session.name) for rank, session in ranks.items()), stages)
            if drawn != self._drawn:
                self._draw(tuple(ranks), stages)
                self._drawn, self._until = drawn, {}
            for rank, session in ranks.items():
                until = self._until.get(rank, -math.inf)
                chunk = session.recent(min(ROLLOVER * POINT_EVERY_S, session.elapsed_s - until) + SMOOTH_S)
                points, self._until[rank] = _points(chunk, rank, until, stages)
                if points["time_s"]:
                    self._sources[rank].stream(points, rollover=ROLLOVER)
            self._write_text(ranks)

    def _draw(self, ranks: tuple[int, ...], stages: tuple[str, ...]) -> None:
        empty = _points(FrameChunk(0, np.empty(0), {}), 0, 0.0, stages)[0]
        self._sources = {rank: ColumnDataSource(dict(empty), name=f"spdl-lab-rank{rank}") for rank in ranks}
        figures = []
        for key, _, title, axis in [*_PLOTS, *((f"cap:{stage}", "", f"loader: {stage}, items/s it can "
                                                "make (made: dashed)", "items/s") for stage in stages)]:
            fig = figure(title=title, height=210, width=420, x_axis_label="seconds since the rank started",
                         y_axis_label=axis, toolbar_location=None)
            for i, rank in enumerate(ranks):
                color = Category10_10[i % 10]
                fig.line("time_s", key, source=self._sources[rank], color=color, line_width=2,
                         legend_label=f"rank {rank}")
                if key.startswith("cap:"):
                    fig.line("time_s", f"qps:{key[4:]}", source=self._sources[rank], color=color, line_dash="dashed")
            fig.legend.location = "top_left"
            fig.legend.label_text_font_size = "9pt"
            figures.append(fig)
        self._show(gridplot(figures, ncols=2))

    def _write_text(self, ranks: dict[int, Any]) -> None:
        job = self.job
        states = " · ".join(f"rank {rank} <b>{html.escape(s.state)}</b>" for rank, s in ranks.items())
        world = f" of {job.world_size}" if job.world_size else ""
        _set(self.header, f"<div style='font-size:13px'>spdl_lab · job <b>{html.escape(job.name)}</b> · "
                          f"{len(ranks)}{world} ranks · {states}</div>")
        self.last_verdict = verdict = job.judge()
        _set(self.verdict, f"<b>verdict:</b> {html.escape(verdict.text)}")
        _set(self.table, _table_html(job.summary()))


def _points(chunk: FrameChunk, rank: int, after: float, stages: tuple[str, ...]) -> tuple[dict[str, list], float]:
    """A rank's points after ``after`` (seconds since it started), one each POINT_EVERY_S, each over
    the ticks of the SMOOTH_S before it; and the time of the last one."""
    out: dict[str, list] = {"time_s": [], **{c: [] for c, *_ in _PLOTS},
                            **{f"{kind}:{s}": [] for s in stages for kind in ("qps", "cap")}}
    times = chunk.times
    if len(times) < 2:
        return out, after
    first = max(after, times[0] + SMOOTH_S - POINT_EVERY_S)
    for end in np.arange((first // POINT_EVERY_S + 1) * POINT_EVERY_S, times[-1] + 1e-9, POINT_EVERY_S):
        upto = int(np.searchsorted(times, end, side="right"))
        window = rank_window(FrameChunk(upto, times[:upto], {k: v[:upto] for k, v in chunk.columns.items()}),
                             rank, "", SMOOTH_S)
        out["time_s"].append(float(end))
        for column, *_ in _PLOTS:
            out[column].append(getattr(window, column))
        by_name = {stage.name: stage for stage in window.stages}
        for name in stages:
            stage = by_name.get(name)
            out[f"qps:{name}"].append(stage.items_per_s if stage else math.nan)
            out[f"cap:{name}"].append(stage.capacity_per_s if stage else math.nan)
        after = float(end)
    return out, after


def _table_html(summary: Any) -> str:
    if summary.empty:
        return ""
    cols = [str(c) for c in summary.columns if c not in ("name", "pid", "runner")]
    rows = [[str(rank), *(_cell(c, row[c]) for c in cols)] for rank, row in summary.iterrows()]
    return html_table(["rank", *cols], rows, "spdl-lab-job-table")


def _cell(column: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    fmt = ".0%" if column == "data_wait_frac" else ".2f" if isinstance(value, float) else "d"
    return num(value, fmt)


def write_job_report(job: Any, path: str | os.PathLike) -> Path:
    """Write ``job`` (a JobSession, live or from its folder) to ``path``; return the path."""
    frames = job.frames().dropna(subset=["value"])  # numbers already: each rank's ring holds floats
    stages = sorted({s for s in frames.loc[frames["series"] == "qps", "stage"] if s != "step" and "/worker" not in s})
    figures = []
    plots = [*((series, "step", title, axis) for _, series, title, axis in _PLOTS),
             *(("qps", stage, f"{stage}: items/s", "items/s") for stage in stages)]
    for series, stage, title, axis in plots:
        fig = figure(title=title, height=240, width=460, x_axis_label="seconds since the rank started",
                     y_axis_label=axis, toolbar_location=None)
        lines = frames[(frames["series"] == series) & (frames["stage"] == stage)]
        for i, (rank, rows) in enumerate(lines.groupby("rank")):
            fig.line(rows["time_s"], rows["value"], color=Category10_10[i % 10], line_width=2,
                     legend_label=f"rank {rank}")
        figures.append(fig)
    note = (f"{len(job.ranks)} ranks (world size {job.world_size or '?'}), {job.state}; "
            f"verdict over each rank's last seconds: {job.verdict()}")
    table = _table_html(job.summary())
    return write_page(gridplot(figures, ncols=2), path, f"spdl_lab job {job.name}", note=note, table=table)
