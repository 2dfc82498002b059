"""The live dashboard of a data-parallel job: its ranks side by side (steps/s, data wait, step
time, and each loader stage's items/s, a line per rank), a table with a row per rank, and the
straggler verdict. It only reads the job's frames; one thread pushes new ticks at ``hz``.
"""

from __future__ import annotations

import html
import math
import threading
from typing import Any

import ipywidgets as widgets
import numpy as np
from bokeh.layouts import gridplot
from bokeh.models import ColumnDataSource
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .._table import num
from ..errors import SpdlLabError
from .dashboard import _BokehView, _load_bokehjs, _set

__all__ = ["JobDashboard"]

DEFAULT_HZ = 1.0
#: Ticks each rank's plot lines keep (at the default 10 Hz sampler: ten minutes).
ROLLOVER = 6000
#: (series, title, y axis) of the plots drawn a line per rank; the loader's is added per stage.
_PLOTS = (("batches_per_s", "steps/s", "steps/s"),
          ("data_wait_frac", "data wait, share of the loop", "share"),
          ("step_ms", "step time (ms): a rank's step holds its wait in the all-reduce", "ms"))
_STEP = "step"
_DASHES = ("solid", "dashed", "dotted", "dotdash")


class JobDashboard(widgets.VBox):
    """A live view of a ``JobSession`` (``job.dashboard()``); ``close()`` stops it, not the job."""

    def __init__(self, job: Any, *, hz: float = DEFAULT_HZ) -> None:
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._bokeh: Any = None
        if not isinstance(hz, (int, float)) or not hz > 0:
            raise SpdlLabError(f"JobDashboard: hz must be a number > 0 (updates per second), got {hz!r}")
        super().__init__()
        self.add_class("spdl-lab-job-dashboard")
        _load_bokehjs()
        self.job = job
        self.interval_s = 1.0 / hz
        self.header, self.verdict, self.table = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.verdict.add_class("spdl-lab-job-verdict")
        self._plot_box = widgets.Box()
        self.children = [self.header, self.verdict, self._plot_box, self.table]
        self._lock = threading.Lock()
        self._cursors: dict[int, int] = {}
        self._sources: dict[int, ColumnDataSource] = {}
        self._drawn: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
        #: the verdict last shown
        self.last_verdict: Any = None
        self.publish()
        self._thread = threading.Thread(target=self._run, name="spdl_lab:job-dashboard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.publish()
            if not self.job.running:
                self.publish()  # the last ticks and the ranks' final states
                return

    def publish(self) -> None:
        """Push each rank's new ticks and rewrite the header, table and verdict."""
        with self._lock:
            ranks = self.job.ranks
            chunks = {rank: session.frames_since(self._cursors.get(rank, 0)) for rank, session in ranks.items()}
            stages = tuple(sorted({stage for chunk in chunks.values() for series, stage in chunk.columns
                                   if series == "qps" and "/worker" not in stage and stage != _STEP}))
            if (tuple(ranks), stages) != self._drawn:
                self._draw(tuple(ranks), stages)
                chunks = {rank: session.frames_since(0) for rank, session in ranks.items()}
            for rank, chunk in chunks.items():
                self._cursors[rank] = chunk.cursor
                if len(chunk):
                    self._sources[rank].stream(_columns(chunk, stages), rollover=ROLLOVER)
            self._write_text(ranks)

    def _draw(self, ranks: tuple[int, ...], stages: tuple[str, ...]) -> None:
        self._drawn = (ranks, stages)
        self._sources = {rank: ColumnDataSource(_columns(None, stages), name=f"spdl-lab-rank{rank}")
                         for rank in ranks}
        plots = [(series, title, axis) for series, title, axis in _PLOTS]
        plots += [(f"qps:{stage}", f"loader: {stage} items/s", "items/s") for stage in stages]
        figures = []
        for key, title, axis in plots:
            fig = figure(title=title, height=210, width=420, x_axis_label="seconds since the rank started",
                         y_axis_label=axis, toolbar_location=None)
            for i, rank in enumerate(ranks):
                fig.line("time_s", key, source=self._sources[rank], color=Category10_10[i % 10], line_width=2,
                         legend_label=f"rank {rank}", line_dash=_DASHES[0])
            fig.legend.location = "top_left"
            fig.legend.label_text_font_size = "9pt"
            figures.append(fig)
        old, self._bokeh = self._bokeh, _BokehView(gridplot(figures, ncols=2))
        self._plot_box.children = [self._bokeh]
        if old is not None:
            old.close()

    def _write_text(self, ranks: dict[int, Any]) -> None:
        job = self.job
        states = " · ".join(f"rank {rank} <b>{html.escape(s.state)}</b>" for rank, s in ranks.items())
        world = f" of {job.world_size}" if job.world_size else ""
        _set(self.header, f"<div style='font-size:13px'>spdl_lab · job <b>{html.escape(job.name)}</b> · "
                          f"{len(ranks)}{world} ranks · {states}</div>")
        self.last_verdict = verdict = job.judge()
        _set(self.verdict, f"<b>verdict:</b> {html.escape(verdict.text)}")
        _set(self.table, _table_html(job.summary()))

    def close(self) -> None:
        """Stop updating and close the widgets; the job and its sessions are left as they are."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        if self._bokeh is not None:
            self._bokeh.close()
        super().close()


def _columns(chunk: Any, stages: tuple[str, ...]) -> dict[str, list[float]]:
    """A rank's new ticks as the plots' columns (NaN where a tick has no value)."""
    keys = [(series, _STEP) for series, _, _ in _PLOTS] + [("qps", stage) for stage in stages]
    names = [series for series, _, _ in _PLOTS] + [f"qps:{stage}" for stage in stages]
    if chunk is None:
        return {"time_s": [], **{name: [] for name in names}}
    empty = np.full(len(chunk.times), math.nan)
    out = {"time_s": chunk.times.tolist()}
    for key, name in zip(keys, names):
        out[name] = chunk.columns.get(key, empty).tolist()
    return out


def _table_html(summary: Any) -> str:
    if summary.empty:
        return ""
    cols = [c for c in summary.columns if c not in ("name", "pid", "runner")]
    head = "".join(f"<th style='padding:0 8px'>{html.escape(str(c))}</th>" for c in ["rank", *cols])
    rows = []
    for rank, row in summary.iterrows():
        cells = [str(rank)] + [_cell(c, row[c]) for c in cols]
        rows.append("<tr>" + "".join(f"<td style='padding:0 8px'>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class='spdl-lab-job-table' style='font-size:12px'><tr>{head}</tr>{''.join(rows)}</table>"


def _cell(column: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if column == "data_wait_frac":
        return num(value, ".0%")
    return num(value, ".2f" if isinstance(value, float) else "d")
