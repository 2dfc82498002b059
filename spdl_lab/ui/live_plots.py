"""The dashboard's Bokeh plots, fed from frame chunks through one ColumnDataSource.

Every series shares the sampler's tick times, so one source with a column per
(series, stage) carries them all: each publish is one ``stream`` event, one
patch message to the browser, however many lines are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from bokeh.layouts import gridplot
from bokeh.models import ColumnDataSource, HoverTool, Legend
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from ..telemetry.frames import FrameChunk

__all__ = ["SOURCE_NAME", "LivePlots", "column_name"]

#: The ColumnDataSource's Bokeh name (browser tests look it up by this name).
SOURCE_NAME = "spdl_lab_frames"
#: Ticks kept in the plots: five minutes at the sampler's 10 Hz.
DEFAULT_ROLLOVER = 3000

STEP_SERIES = (("data_wait_ms", "data wait"), ("step_ms", "step"), ("device_ms", "device"))
CPU_SERIES = (("main", "this process"), ("children", "child processes"), ("total", "total"))
WAIT_SERIES = (
    ("gil_wait_frac", "train", "training thread: GIL wait"),
    ("runqueue_wait_frac", "train", "training thread: run-queue wait"),
    ("gil_wait_frac", "gil", "GIL probe: GIL wait"),
    ("runqueue_wait_frac", "gil", "GIL probe: run-queue wait"),
)


def column_name(series: str, stage: str) -> str:
    return f"{series}:{stage}"


class LivePlots:
    """Five live figures: stage throughput, queue depth, step timings, CPU, GIL vs run-queue wait."""

    def __init__(
        self, stages: Sequence[str], queues: Sequence[str], *, rollover: int = DEFAULT_ROLLOVER,
        width: int = 460, height: int = 220,
    ) -> None:
        self.rollover = rollover
        self.queues = list(queues)
        keys = [("qps", s) for s in stages]
        keys += [(series, q) for q in queues for series in ("queue_depth", "queue_capacity")]
        keys += [(series, "step") for series, _ in STEP_SERIES]
        keys += [("cpu_percent", stage) for stage, _ in CPU_SERIES]
        keys += [(series, stage) for series, stage, _ in WAIT_SERIES]
        self.keys = keys
        self.source = ColumnDataSource(
            {"time_s": [], **{column_name(*k): [] for k in keys}}, name=SOURCE_NAME
        )
        size = dict(width=width, height=height)
        self.figures = [
            self._lines("throughput per stage (items/s)", [(("qps", s), s) for s in stages], **size),
            self._queues(queues, **size),
            self._lines("training step (ms per step)", [((s, "step"), label) for s, label in STEP_SERIES], **size),
            self._lines("CPU (% of one core)", [(("cpu_percent", s), label) for s, label in CPU_SERIES], **size),
            self._lines("waiting: GIL vs CPU run queue (share of time)",
                        [((s, g), label) for s, g, label in WAIT_SERIES], **size),
        ]
        self.layout = gridplot(self.figures, ncols=2, toolbar_location=None)
        # Per-step series have no value in a tick where no step ended (steps
        # are longer than ticks): drawn as the last value instead of a gap.
        self._hold = {k for k in keys if k[1] in ("step", "train")}
        self._last: dict[tuple[str, str], float] = {}

    def stream_chunk(self, chunk: FrameChunk) -> dict[str, list[float]] | None:
        """The new data for ``source.stream`` from a chunk; None when it has no ticks.

        Lists, not arrays: Bokeh sends each array as its own binary buffer, two
        comm messages per column per update, while lists travel in one message.
        """
        n = len(chunk)
        if not n:
            return None
        data = {"time_s": np.asarray(chunk.times, dtype=float).round(3).tolist()}
        for key in self.keys:
            values = chunk.columns.get(key)
            # a fresh list per column: Bokeh may keep it and extend it in place
            column = [math.nan] * n if values is None else np.asarray(values, dtype=float).tolist()
            if key in self._hold:
                column = self._held(key, column)
            data[column_name(*key)] = column
        return data

    def _held(self, key: tuple[str, str], column: list[float]) -> list[float]:
        last = self._last.get(key, math.nan)
        for i, value in enumerate(column):
            if value != value:  # NaN
                column[i] = last
            else:
                last = value
        self._last[key] = last
        return column

    def stream(self, data: dict[str, list[float]]) -> None:
        """Append ticks (call with the document lock held)."""
        self.source.stream(data, rollover=self.rollover)

    def _figure(self, title: str, **size: int):
        fig = figure(title=title, x_axis_label="seconds", toolbar_location=None, **size)
        fig.title.text_font_size = "11px"
        return fig

    def _lines(self, title: str, lines: list[tuple[tuple[str, str], str]], **size: int):
        fig = self._figure(title, **size)
        items = []
        for i, (key, label) in enumerate(lines):
            r = fig.line("time_s", column_name(*key), source=self.source,
                         color=Category10_10[i % 10], line_width=2)
            items.append((label, [r]))
        _legend(fig, items)
        fig.add_tools(HoverTool(tooltips=[("t", "@time_s{0.0} s"), ("value", "$y{0.00}")]))
        return fig

    def _queues(self, queues: Sequence[str], **size: int):
        fig = self._figure("queue depth (solid) against capacity (dashed)", **size)
        items = []
        for i, q in enumerate(queues):
            color = Category10_10[i % 10]
            depth = fig.line("time_s", column_name("queue_depth", q), source=self.source,
                             color=color, line_width=2)
            cap = fig.line("time_s", column_name("queue_capacity", q), source=self.source,
                           color=color, line_dash="dashed")
            items.append((q, [depth, cap]))
        _legend(fig, items)
        return fig


def _legend(fig, items) -> None:
    if not items:
        return
    legend = Legend(items=items, location="top_left", label_text_font_size="9px",
                    spacing=0, padding=2, background_fill_alpha=0.6, click_policy="hide")
    fig.add_layout(legend)
