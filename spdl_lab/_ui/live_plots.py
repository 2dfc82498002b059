"""The dashboard's Bokeh plots, fed from frame chunks through one ColumnDataSource: every series
shares the tick times, so a publish is one message however many lines are drawn. Rates, CPU and
waits are drawn smoothed over SMOOTH_S; a stage has one colour in every plot."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from bokeh.layouts import gridplot
from bokeh.models import ColumnDataSource, Div, HoverTool, Legend, Span
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .._pipeline import check_ints
from .._telemetry.frames import FrameChunk

#: The ColumnDataSource's Bokeh name (browser tests look it up by this name).
SOURCE_NAME = "spdl_lab_frames"
#: One point drawn per DRAW_EVERY_S bin of ticks (its last): fewer points to redraw and send.
DRAW_EVERY_S = 0.25
DEFAULT_ROLLOVER = int(1800 / DRAW_EVERY_S)  # thirty minutes, the longest window
#: The time windows the dashboard offers, in seconds.
WINDOWS_S = (60.0, 300.0, 1800.0)
#: Smoothing of the drawn rates (EWMA time constant, seconds).
SMOOTH_S = 2.0
_TOOLS = "xwheel_zoom,xbox_zoom,reset,save"

STEP_SERIES = (("data_wait_ms", "data wait"), ("step_ms", "step"), ("device_ms", "device"),
               ("copy_ms", "host-to-device copy"))
CPU_SERIES = (("main", "this process"), ("children", "child processes"), ("total", "total"),
              ("machine", "whole machine"))
WAIT_SERIES = (("gil_wait_frac", "train", "training thread: GIL wait"),
               ("runqueue_wait_frac", "train", "training thread: run-queue wait"),
               ("gil_wait_frac", "gil", "GIL probe: GIL wait"),
               ("runqueue_wait_frac", "gil", "GIL probe: run-queue wait"))


def column_name(series: str, stage: str) -> str:
    return f"{series}:{stage}"


class LivePlots:
    """Five live figures: stage throughput, queue depth, step timings, CPU, GIL vs run-queue wait;
    ``cpu``: the CPU lines to draw (default all of CPU_SERIES). A plot with no ``stages`` or no
    ``queues`` is one line of text saying why: ``why_empty["stages"]``, ``why_empty["queues"]``."""

    def __init__(self, stages: Sequence[str], queues: Sequence[str], *, cpu: Sequence[str] | None = None,
                 why_empty: Mapping[str, str] | None = None, rollover: int = DEFAULT_ROLLOVER) -> None:
        check_ints("LivePlots", rollover=(rollover, 1))
        self.max_rollover = self.rollover = rollover  # the window's points, at most max_rollover
        self.stages, self.queues = list(stages), list(queues)
        self.cpu = [s for s, _ in CPU_SERIES if cpu is None or s in cpu]
        #: the (series, stage) of every line drawn: the source's columns
        self.keys: list[tuple[str, str]] = []
        self.source = ColumnDataSource(name=SOURCE_NAME)
        self._size = dict(width=460, height=220)
        self.colors = stage_colors(stages)
        smooth = f"{SMOOTH_S:g} s average"
        why = self.why_empty = dict(why_empty or {})
        #: in place of a plot with nothing to draw: a line of text saying why
        self.notes: list[Div] = []
        throughput = (self._lines(f"throughput per stage ({smooth})", "items/s",
                                  [(("qps", s), s, self.colors[s]) for s in stages])
                      if stages else self._note(why.get("stages", "no stage meters in this run")))
        queue = (self._lines("queue depth (solid) against capacity (dashed)", "items",
                             [(("queue_depth", q), q, self.colors.get(q.split("→")[-1], "#555555"))
                              for q in queues], dashed="queue_capacity")  # its consumer's colour
                 if queues else self._note(why.get("queues", "no queue meters in this run")))
        step = self._lines("training step (per step)", "ms", [((s, "step"), label, Category10_10[i])
                           for i, (s, label) in enumerate(STEP_SERIES)])
        cpu_figure = self._lines(f"CPU ({smooth}; 100% = one core)", "% of one core",
                                 [(("cpu_percent", s), label, Category10_10[i])
                                  for i, (s, label) in enumerate(CPU_SERIES) if s in self.cpu])
        cpu_figure.add_layout(Span(location=100.0 * (os.cpu_count() or 1), dimension="width",
                                   line_dash="dotted", line_color="#888"))  # what the machine has
        waits = self._lines(f"waiting: GIL vs CPU run queue ({smooth})", "share of time",
                            [((s, g), label, Category10_10[i])
                             for i, (s, g, label) in enumerate(WAIT_SERIES)])
        panels = [throughput, queue, step, cpu_figure, waits]
        self.source.data = {"time_s": [], **{column_name(*k): [] for k in self.keys}}
        #: the plots drawn (a note is not one)
        self.figures = [p for p in panels if not isinstance(p, Div)]
        self.layout = gridplot(panels, ncols=2, toolbar_location="right")
        # A per-step series has no value in a tick where no step ended: drawn as its last value.
        self._hold = {k for k in self.keys if k[1] in ("step", "train")}
        self._smooth = {k for k in self.keys
                        if k[0] in ("qps", "cpu_percent") or k[0].endswith("_frac")}
        self._last: dict[tuple[str, str], float] = {}
        self._avg: dict[tuple[str, str], float] = {}
        self._last_t: float | None = None

    def set_window(self, seconds: float) -> None:
        """Show the last ``seconds`` of every plot: the source keeps that many points (a following
        x range would sync each of its moves back, comm messages that starve the kernel)."""
        self.rollover = max(1, min(self.max_rollover, int(round(float(seconds) / DRAW_EVERY_S))))

    def stream_chunk(self, chunk: FrameChunk) -> dict[str, list[float]] | None:
        """The new data for ``source.stream`` from a chunk; None when it has no ticks. Lists, not
        arrays: Bokeh sends each array as buffers of its own."""
        if not (n := len(chunk)):
            return None
        times = np.asarray(chunk.times, dtype=float)
        gaps = np.diff(times, prepend=times[0] if self._last_t is None else self._last_t)
        self._last_t = float(times[-1])
        # One point per DRAW_EVERY_S bin: the index of each bin's last tick.
        bins = np.floor(times / DRAW_EVERY_S)
        last = np.flatnonzero(np.append(bins[1:] != bins[:-1], True)).tolist()
        data = {"time_s": [round(float(times[i]), 3) for i in last]}
        for key in self.keys:
            values = chunk.columns.get(key)
            column = [math.nan] * n if values is None else np.asarray(values, dtype=float).tolist()
            if key in self._hold:
                column = pd.Series([self._last.get(key, math.nan), *column]).ffill().tolist()[1:]
                self._last[key] = column[-1]
            elif key in self._smooth:
                column = self._smoothed(key, column, gaps)
            # a fresh list per column: Bokeh may keep it and extend it in place
            data[column_name(*key)] = [column[i] for i in last]
        return data

    def _smoothed(self, key: tuple[str, str], column: list[float], gaps: np.ndarray) -> list[float]:
        """Exponential moving average over SMOOTH_S seconds; NaN ticks keep the average."""
        avg = self._avg.get(key, math.nan)
        for i, value in enumerate(column):
            if value == value:
                weight = 1.0 - math.exp(-max(0.0, float(gaps[i])) / SMOOTH_S)
                avg = value if avg != avg else avg + weight * (value - avg)
            column[i] = avg
        self._avg[key] = avg
        return column

    def stream(self, data: dict[str, list[float]] | None) -> None:
        """Append ticks, if any (call with the document lock held); keep the window's points."""
        if data is not None:
            self.source.stream(data, rollover=self.rollover)

    def _note(self, text: str) -> Div:
        note = Div(text=html.escape(text, quote=False), width=self._size["width"],
                   styles={"font-size": "12px", "color": "#555", "padding": "8px"})
        self.notes.append(note)
        return note

    def _lines(self, title: str, y_label: str, lines: list[tuple[tuple[str, str], str, str]],
               dashed: str | None = None):
        """A line per (key, label, colour); ``dashed``: each key's stage in that series too."""
        fig = figure(title=title, x_axis_label="seconds since the run started", y_axis_label=y_label,
                     tools=_TOOLS, active_scroll="xwheel_zoom", **self._size)
        fig.title.text_font_size = "11px"
        fig.xaxis.axis_label_text_font_size = fig.yaxis.axis_label_text_font_size = "10px"
        items = []
        for key, label, color in lines:
            r = fig.line("time_s", column_name(*key), source=self.source, color=color, line_width=2)
            items.append((label, [r]))
            self.keys.append(key)
            if dashed:
                self.keys.append((dashed, key[1]))
                items[-1][1].append(fig.line("time_s", column_name(dashed, key[1]),
                                             source=self.source, color=color, line_dash="dashed"))
            fig.add_tools(HoverTool(renderers=[r], tooltips=[
                ("", label), ("t", "@time_s{0.0} s"), ("value", f"@{{{column_name(*key)}}}{{0.00}}")]))
        if items:  # beside the plot, never over the data
            fig.add_layout(Legend(items=items, label_text_font_size="9px", spacing=0, padding=2,
                                  click_policy="hide"), "right")
        return fig


def stage_colors(stages: Sequence[str]) -> dict[str, str]:
    """One colour per stage, the same in every plot; the output queue is grey."""
    colors = {s: Category10_10[i % 10] for i, s in enumerate(stages)}
    colors.setdefault("output", "#555555")
    return colors

