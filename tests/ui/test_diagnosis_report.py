"""A Diagnosis rendered: Bokeh figures per map stage, an escaped verdict table, one offline HTML file."""

from __future__ import annotations

import math
import re

from bokeh.models import LayoutDOM
from bokeh.plotting import figure

from spdl_lab._diagnose.result import Diagnosis, Point, StageDiagnosis
from spdl_lab._ui.report import diagnosis_plot

NAN = math.nan
EVIL = "<script>alert('stage')</script>"
TRACEBACK = "Traceback (most recent call last):\n  ...\nValueError: </pre><script>alert(1)</script>"


def point(stage: str, c: int, qps: float, executor: str = "thread", status: str = "ok") -> Point:
    gil = NAN if executor == "process" else 0.1 * c
    return Point(stage, executor, c, qps, 0.02, 0.4, gil, 0.01, 2.0, 3, status, 0)


def sample() -> Diagnosis:
    stages = [
        StageDiagnosis("read", "map", "scales", 4, "QPS grew 3.8x.", "Use concurrency=4.",
                       points=tuple(point("read", c, 100.0 * c) for c in (1, 2, 4))),
        StageDiagnosis(EVIL, "map", "gil-bound", 1, f"evidence {EVIL}", f"do {EVIL}",
                       points=(point(EVIL, 1, 300.0), point(EVIL, 2, 310.0), point(EVIL, 4, NAN, status="timeout"),
                               point(EVIL, 1, 290.0, "process"), point(EVIL, 2, 560.0, "process"))),
        StageDiagnosis("lookup", "map", None, None, "It raised.", "Fix it.",
                       points=(point("lookup", 1, NAN, status="error"),), error=TRACEBACK),
        StageDiagnosis("batch(8)", "batch", None, None, "Not swept.", ""),
    ]
    return Diagnosis(pipeline=f"Pipeline({EVIL})", stages={s.name: s for s in stages},
                     settings={"concurrency": [1, 2, 4], "note": EVIL}, machine={"cores": 2},
                     created="2025-01-02T03:04:05", elapsed_s=12.0)


def test_plot_has_one_figure_per_map_stage():
    layout = sample().plot()
    assert isinstance(layout, LayoutDOM)
    figs = list(layout.select({"type": figure}))
    assert len(figs) == 3
    titles = sorted(f.title.text for f in figs)
    assert titles == sorted(["read: scales (best at 4)", f"{EVIL}: gil-bound (best at 1)", "lookup: failed"])
    evil = next(f for f in figs if f.title.text.startswith(EVIL))
    assert evil.xaxis[0].ticker.ticks == [1, 2, 4]
    assert "frac" in evil.extra_y_ranges
    markers = {getattr(r.glyph, "marker", None) for r in evil.renderers}
    assert "x" in markers  # the timed-out point


def test_plot_without_map_stages_says_so():
    diag = Diagnosis("Pipeline(range(3)).batch(2)", {"batch(2)": StageDiagnosis(
        "batch(2)", "batch", None, None, "", "")})
    assert isinstance(diagnosis_plot(diag), LayoutDOM)


def test_repr_html_shows_verdicts_and_escapes():
    text = sample()._repr_html_()
    for verdict in ("scales", "gil-bound", "failed"):
        assert verdict in text
    assert "<script" not in text
    assert "&lt;script&gt;alert(&#x27;stage&#x27;)&lt;/script&gt;" in text
    assert "<details><summary>error</summary><pre>Traceback" in text
    assert "&lt;/pre&gt;&lt;script&gt;alert(1)" in text


def test_report_is_one_offline_file(tmp_path):
    diag = sample()
    path = diag.to_html(tmp_path / "sub" / "report.html")
    assert path == tmp_path / "sub" / "report.html"
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]
    text = path.read_text(encoding="utf-8")
    assert path.stat().st_size < 3 * 2**20  # Bokeh's core bundle only
    # INLINE: Bokeh's code is in the page; nothing is fetched (its source may still name sites).
    assert not re.search(r"<script[^>]*\bsrc=", text)
    assert not re.search(r"<link[^>]*\bhref=[\"']?https?://", text)
    for name in ("read", "lookup", "batch(8)", "&lt;script&gt;alert(&#x27;stage&#x27;)"):
        assert name in text
    body = text.split("<body>", 1)[1]
    assert "<script>alert" not in body and "</pre><script>" not in body
    assert "cores=2" in body and "concurrency=[1, 2, 4]" in body
    assert body.count("<tr") >= 4 + len(diag.table) + 1  # verdict rows, point rows, their headers
