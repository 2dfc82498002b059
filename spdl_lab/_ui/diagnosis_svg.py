"""QPS against concurrency per stage as plain inline SVG, the first thing a Diagnosis shows: no
JavaScript, so it renders wherever HTML does (Bokeh's interactive figures are ``diagnosis_plot``)."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from .._table import amount

if TYPE_CHECKING:
    from .._diagnose.result import Diagnosis, StageDiagnosis

__all__ = ["EXECUTOR_COLORS", "qps_charts"]

_W, _H, _PAD_L, _PAD_B, _PAD_T, _PAD_R = 250, 170, 52, 30, 26, 10
EXECUTOR_COLORS = {"thread": "#1f77b4", "process": "#ff7f0e"}


def qps_charts(diag: Diagnosis) -> str:
    """One small chart per measured map stage, the limiting stage first, in a flex row."""
    stages = [s for s in diag.in_order() if s.kind == "map" and s.points]
    if not stages:
        return ""
    charts = "".join(_chart(s, s.name == diag.bottleneck) for s in stages)
    legend = ("<span style='color:#1f77b4'>&#9644; threads</span> &nbsp; "
              "<span style='color:#ff7f0e'>&#9644; processes</span> &nbsp; items/s against concurrency")
    return (f"<div style='display:flex;flex-wrap:wrap;gap:8px'>{charts}</div>"
            f"<div style='font-size:12px;color:#555'>{legend}</div>")


def _chart(stage: StageDiagnosis, limiting: bool) -> str:
    lines = {ex: sorted((p for p in stage.points if p.executor == ex and p.qps > 0 and math.isfinite(p.qps)),
                        key=lambda p: p.concurrency) for ex in EXECUTOR_COLORS}
    every = [p for pts in lines.values() for p in pts]
    if not every:
        return ""
    c_lo, c_hi = min(p.concurrency for p in every), max(p.concurrency for p in every)
    q_hi = max(p.qps for p in every) * 1.1
    span = math.log2(c_hi) - math.log2(c_lo) or 1.0

    def x(c: int) -> float:
        return _PAD_L + (math.log2(c) - math.log2(c_lo)) / span * (_W - _PAD_L - _PAD_R)

    def y(q: float) -> float:
        return _H - _PAD_B - q / q_hi * (_H - _PAD_B - _PAD_T)

    parts = [f"<line x1='{_PAD_L}' y1='{_H - _PAD_B}' x2='{_W - _PAD_R}' y2='{_H - _PAD_B}' stroke='#999'/>",
             f"<line x1='{_PAD_L}' y1='{_PAD_T}' x2='{_PAD_L}' y2='{_H - _PAD_B}' stroke='#999'/>",
             f"<text x='{_PAD_L - 4}' y='{_PAD_T + 4}' text-anchor='end'>{amount(q_hi / 1.1)}</text>",
             f"<text x='{_PAD_L - 4}' y='{_H - _PAD_B}' text-anchor='end'>0</text>"]
    for c in sorted({p.concurrency for p in every}):
        parts.append(f"<text x='{x(c):.1f}' y='{_H - _PAD_B + 13}' text-anchor='middle'>{c}</text>")
    for ex, pts in lines.items():
        if not pts:
            continue
        path = " ".join(f"{x(p.concurrency):.1f},{y(p.qps):.1f}" for p in pts)
        parts.append(f"<polyline points='{path}' fill='none' stroke='{EXECUTOR_COLORS[ex]}' stroke-width='2'/>")
        for p in pts:
            hollow = "white" if p.status == "unstable" else EXECUTOR_COLORS[ex]
            parts.append(f"<circle cx='{x(p.concurrency):.1f}' cy='{y(p.qps):.1f}' r='3' fill='{hollow}' "
                         f"stroke='{EXECUTOR_COLORS[ex]}'><title>{ex} x{p.concurrency}: {amount(p.qps)}/s "
                         f"({html.escape(p.status)})</title></circle>")
    title = f"{stage.name}: {stage.verdict or stage.status}" + (" (limits the pipeline)" if limiting else "")
    parts.append(f"<text x='{_PAD_L}' y='15' font-weight='bold'>{html.escape(title)}</text>")
    parts.append(f"<text x='{(_W + _PAD_L) / 2:.0f}' y='{_H - 3}' text-anchor='middle'>concurrency</text>")
    border = "#c0392b" if limiting else "#ddd"
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{_W}' height='{_H}' font-size='11' "
            f"font-family='sans-serif' style='border:1px solid {border}'>{''.join(parts)}</svg>")
