"""The live plots read well for hours: smoothing, colours, legends, tooltips, labels, windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bokeh.models import HoverTool, Legend

from spdl_lab._telemetry.frames import FrameChunk
from spdl_lab._ui.live_plots import DRAW_EVERY_S, SMOOTH_S, WINDOWS_S, LivePlots, column_name


def plots() -> LivePlots:
    return LivePlots(["read", "decode"], ["source→read", "read→decode", "decode→output"])


def chunk(times, **columns) -> FrameChunk:
    return FrameChunk(len(times), np.asarray(times, dtype=float),
                      {tuple(k.split(":")): np.asarray(v, dtype=float) for k, v in columns.items()})


def test_rates_are_drawn_smoothed_and_the_title_says_over_what():
    p = plots()
    times = np.arange(0, 4.0, 0.1)
    noisy = [100.0 if i % 2 else 0.0 for i in range(len(times))]
    data = p.stream_chunk(chunk(times, **{"qps:read": noisy}))
    drawn = data[column_name("qps", "read")]
    assert max(drawn[-10:]) - min(drawn[-10:]) < 20  # raw swings 0..100 every tick
    assert 35 < drawn[-1] < 65
    assert f"{SMOOTH_S:g} s average" in p.figures[0].title.text


def test_each_stage_has_one_colour_everywhere_and_legends_sit_beside_the_plots():
    p = plots()
    qps_fig, queue_fig = p.figures[0], p.figures[1]
    colors = {r.glyph.y: r.glyph.line_color for r in qps_fig.renderers}
    assert colors[column_name("qps", "read")] == p.colors["read"]
    queue_colors = {r.glyph.y: r.glyph.line_color for r in queue_fig.renderers}
    assert queue_colors[column_name("queue_depth", "read→decode")] == p.colors["decode"]  # the stage it feeds
    for fig in p.figures:
        assert fig.xaxis[0].axis_label and fig.yaxis[0].axis_label, fig.title.text
        assert any(isinstance(t, HoverTool) for t in fig.tools), fig.title.text
        assert [leg for leg in fig.right if isinstance(leg, Legend)], fig.title.text  # beside, not over


def test_the_time_window_keeps_that_many_seconds_of_points():
    p = plots()
    p.set_window(WINDOWS_S[0])
    times = np.arange(0.0, 120.0, 0.1)  # two minutes of ticks
    p.stream(p.stream_chunk(chunk(times, **{"qps:read": np.ones_like(times)})))
    shown = p.source.data["time_s"]
    assert 59.0 <= shown[-1] - shown[0] <= 60.0  # the last minute only
    p.set_window(WINDOWS_S[2])
    assert p.rollover == 1800 / DRAW_EVERY_S


def test_rollover_caps_the_points_a_plot_keeps_whatever_the_window():
    capped = LivePlots(["read"], ["q"], rollover=40)
    capped.set_window(WINDOWS_S[0])
    assert capped.rollover == 40  # a minute would be 240 points
    times = np.arange(0.0, 120.0, 0.1)
    capped.stream(capped.stream_chunk(chunk(times, **{"qps:read": np.ones_like(times)})))
    assert len(capped.source.data["time_s"]) == 40
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="rollover must be an int >= 1"):
            LivePlots(["read"], ["q"], rollover=bad)


def test_nan_ticks_keep_the_average_rather_than_break_the_line():
    p = plots()
    data = p.stream_chunk(chunk([0.0, 0.3, 0.6], **{"qps:read": [10.0, math.nan, 10.0]}))
    assert data[column_name("qps", "read")] == [10.0, 10.0, 10.0]


def test_one_point_is_drawn_per_bin_so_the_browser_redraws_little():
    p = plots()
    times = np.arange(0.0, 10.0, 0.1)  # 100 ticks at 10 Hz
    data = p.stream_chunk(chunk(times, **{"queue_depth:source→read": np.arange(100.0)}))
    assert len(data["time_s"]) == pytest.approx(10.0 / DRAW_EVERY_S, abs=1)
    assert data[column_name("queue_depth", "source→read")][-1] == 99.0  # the bin's last tick
