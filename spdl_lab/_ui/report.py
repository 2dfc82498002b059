"""Static, self-contained HTML reports (Bokeh INLINE: no network needed to open them), and the
figures and pages of a Comparison, a Tuning and a Diagnosis (its charts also as inline SVG, which
renders wherever HTML does). Every string that reaches a page is escaped: data, never markup."""

from __future__ import annotations

import html
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.embed import file_html
from bokeh.layouts import column, gridplot, row
from bokeh.models import ColumnDataSource, Div, FixedTicker, HoverTool, LinearAxis, Range1d
from bokeh.models.annotations import Legend, Whisker
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from bokeh.resources import INLINE

from .._table import amount

if TYPE_CHECKING:
    from .._diagnose.result import Diagnosis, Point, StageDiagnosis
    from .._experiments.compare import Comparison
    from .._tune.result import Tuning

#: Each runner's colour in the tuning plot.
_COLORS = {"thread": Category10_10[0], "subprocess-threads": Category10_10[1], "process": Category10_10[2]}

# Bokeh's own page (bokeh.core.templates.FILE) with our text and style around its plots;
# Jinja escapes nothing by itself here, so every text the user gave passes through ``e``.
_PAGE = """
{% block postamble %}<style>
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.note { color: #555; max-width: 60em; }
.warnings { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.5em 1em; max-width: 60em; }
</style>{% endblock %}
{% block contents %}<h1>{{ title | e }}</h1><p class="note">{{ note | e }}</p>{{ table }}{{ super() }}{{ after }}
{% endblock %}
"""


def write_page(layout: Any, path: str | Path, title: str, **variables: str) -> Path:
    """``layout`` in one HTML file, the page's ``note`` and the HTML of ``table`` above it and of
    ``after`` below it (both escaped by whoever made them); return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # INLINE: Bokeh's code in the page, only the bundles this layout uses; nothing fetched.
    page = file_html(layout, INLINE, title, template=_PAGE, template_variables=variables)
    path.write_text(page, encoding="utf-8")
    return path


def write_comparison_report(cmp: Comparison, path: str | Path, *, title: str = "spdl_lab comparison",
                            note: str = "") -> Path:
    """Write the comparison's warnings, table and plots to one HTML file; return its path."""
    note = note or f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}."
    return write_page(cmp.plot(), path, title, note=note, table=cmp._repr_html_())


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
    parts = {"gil_wait_frac": "GIL", "runqueue_wait_frac": "CPU run queue",
             "data_wait_frac": "data"}
    right = table[list(parts)].astype(float).fillna(0.0).cumsum(axis=1)  # the shares, stacked
    left = right.shift(1, axis=1, fill_value=0.0)
    items = [(label, [waits.hbar(y=runners, left=list(left[c]), right=list(right[c]), height=0.6,
                                 color=Category10_10[(i + 3) % 10])])
             for i, (c, label) in enumerate(parts.items())]
    waits.add_layout(Legend(items=items), "below")

    steps = figure(width=840, height=260, title="step time over the run (ms)", toolbar_location=None,
                   x_axis_label="seconds since the runner started", y_axis_label="step_ms")
    timed = {r: f[(f["series"] == "step_ms") & (f["stage"] == "step")] for r, f in cmp.frames.items()}
    lines = [(r, [steps.line(sel["time_s"], sel["value"], color=colors[r], line_width=2)])
             for r in runners if (sel := timed.get(r)) is not None and not sel.empty]
    if lines:
        steps.add_layout(Legend(items=lines), "right")
    return column(row(bars, waits), steps)


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
            "cpu_percent", "move", "kept", "others_percent", "restart_s"]
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


_W, _H, _PAD_L, _PAD_B, _PAD_T, _PAD_R = 250, 170, 52, 30, 26, 10
EXECUTOR_COLORS = {"thread": "#1f77b4", "process": "#ff7f0e"}
_CPU, _GIL = "#2ca02c", "#d62728"
_VERDICT_COLORS = {"scales": "#2ca02c", "cpu-bound": "#d68910", "gil-bound": "#c0392b", "contended": "#8e44ad"}
_FAILED = ("timeout", "error")
_TOOLTIPS = [("executor", "@executor"), ("concurrency", "@concurrency"), ("qps", "@qps{0,0.0}"),
             ("cpu util", "@cpu_util{0.00}"), ("GIL wait", "@gil_wait_frac{0.00}"),
             ("task p50 (ms)", "@p50_ms{0.000}"), ("windows", "@repeats"), ("status", "@status")]


def _source(points: list[Point]) -> ColumnDataSource:
    # Arrays, not lists: NaN stays NaN (a gap in the line) rather than a JSON problem.
    cols = ("concurrency", "qps", "cpu_util", "gil_wait_frac", "p50_ms", "repeats")
    data = {c: np.array([getattr(p, c) for p in points], dtype=float) for c in cols}
    return ColumnDataSource({**data, "executor": [p.executor for p in points],
                             "status": [p.status for p in points]})


def _title(stage: StageDiagnosis) -> str:
    if stage.verdict is None:
        why = "failed" if stage.error else "unstable" if stage.status == "unstable" else "no verdict"
        return f"{stage.name}: {why}"
    best = f" (best at {stage.best_concurrency})" if stage.best_concurrency is not None else ""
    return f"{stage.name}: {stage.verdict}{best}"


def stage_figure(stage: StageDiagnosis):
    """One map stage: QPS per executor on the left axis, CPU and GIL wait (0..1) on the right."""
    concurrencies = sorted({p.concurrency for p in stage.points}) or [1]
    fig = figure(width=560, height=300, title=_title(stage), x_axis_type="log",
                 x_axis_label="concurrency", y_axis_label="items/s", toolbar_location="right",
                 x_range=Range1d(concurrencies[0] / 1.3, concurrencies[-1] * 1.3))
    fig.y_range.start = 0
    fig.xaxis.ticker = FixedTicker(ticks=concurrencies)
    fig.xaxis.major_label_overrides = {c: str(c) for c in concurrencies}  # "8", not "10^0.9"
    fig.extra_y_ranges = {"frac": Range1d(0, 1)}
    fig.add_layout(LinearAxis(y_range_name="frac", axis_label="CPU util, GIL wait"), "right")
    hovered = []
    for executor, color in EXECUTOR_COLORS.items():
        points = sorted((p for p in stage.points if p.executor == executor), key=lambda p: p.concurrency)
        if not points:
            continue
        src = _source(points)
        fig.line("concurrency", "qps", source=src, color=color, line_width=2, legend_label=f"{executor} QPS")
        ok = [p for p in points if p.status not in _FAILED]
        hovered.append(fig.scatter("concurrency", "qps", source=_source(ok), color=color, size=8,
                                   legend_label=f"{executor} QPS"))
        fig.line("concurrency", "cpu_util", source=src, y_range_name="frac", color=_CPU,
                 line_dash="solid" if executor == "thread" else "dotted",
                 legend_label=f"{executor} CPU util")
        if executor == "thread":
            fig.line("concurrency", "gil_wait_frac", source=src, y_range_name="frac", color=_GIL,
                     line_dash="dashed", legend_label="GIL wait")
        if failed := [p for p in points if p.status in _FAILED]:
            bad = _source(failed)
            bad.data["qps"] = np.nan_to_num(bad.data["qps"], nan=0.0)  # no QPS: mark it on the axis
            hovered.append(fig.scatter("concurrency", "qps", source=bad, marker="x", size=12,
                                       line_width=2, color=color, legend_label="timeout / error"))
    if hovered:
        fig.add_tools(HoverTool(renderers=hovered, tooltips=_TOOLTIPS))
        legend = fig.legend[0]
        legend.click_policy, legend.label_text_font_size = "hide", "8pt"
        fig.add_layout(legend, "right")  # beside the plot, so it never hides a point
    return fig


def diagnosis_plot(diag: Diagnosis):
    """One figure per map stage (a batch stage has no concurrency to sweep), the limiting first."""
    if not (figs := [stage_figure(s) for s in diag.in_order() if s.kind == "map" and s.points]):
        return column(Div(text="No map stage was measured, so there is nothing to plot."))
    return gridplot(figs, ncols=2)


def qps_charts(diag: Diagnosis) -> str:
    """One small chart per measured map stage, the limiting stage first, in a flex row."""
    if not (stages := [s for s in diag.in_order() if s.kind == "map" and s.points]):
        return ""
    charts = "".join(_chart(s, s.name == diag.bottleneck) for s in stages)
    legend = ("<span style='color:#1f77b4'>&#9644; threads</span> &nbsp; "
              "<span style='color:#ff7f0e'>&#9644; processes</span> &nbsp; items/s against concurrency")
    return (f"<div style='display:flex;flex-wrap:wrap;gap:8px'>{charts}</div>"
            f"<div style='font-size:12px;color:#555'>{legend}</div>")


def _chart(stage: StageDiagnosis, limiting: bool) -> str:
    lines = {ex: sorted((p for p in stage.points if p.executor == ex and p.qps > 0 and math.isfinite(p.qps)),
                        key=lambda p: p.concurrency) for ex in EXECUTOR_COLORS}
    if not (every := [p for pts in lines.values() for p in pts]):
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


_STYLE = """<style>
.spdl-diag table { border-collapse: collapse; font-size: 13px; }
.spdl-diag th, .spdl-diag td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
.spdl-diag td.num { text-align: right; }
.spdl-diag pre { max-height: 24em; overflow: auto; font-size: 12px; white-space: pre-wrap; }
.spdl-diag .verdict { font-weight: bold; }
.spdl-diag .note { color: #555; }
</style>"""


def _row(stage: StageDiagnosis) -> str:
    e = html.escape
    color = _VERDICT_COLORS.get(stage.verdict or "", "#555")
    verdict = e(stage.verdict or stage.shown_status())
    best = "" if stage.best_concurrency is None else str(stage.best_concurrency)
    peak = stage.peak_qps()
    error = f"<details><summary>error</summary><pre>{e(stage.error)}</pre></details>" if stage.error else ""
    return (f"<tr><td>{e(stage.name)}</td><td>{e(stage.kind)}</td>"
            f"<td class='verdict' style='color:{color}'>{verdict}</td><td class='num'>{best}</td>"
            f"<td class='num'>{'' if math.isnan(peak) else f'{peak:,.1f}'}</td>"
            f"<td>{e(stage.evidence)}{error}</td><td>{e(stage.recommendation)}</td></tr>")


def diagnosis_html(diag: Diagnosis, *, charts: bool = True) -> str:
    """The diagnosis as an HTML fragment: the limiting stage, QPS against concurrency per stage
    (inline SVG), the verdict table, then the details (no Bokeh: ``.plot()`` for those figures)."""
    heads = ("stage", "kind", "verdict", "best concurrency", "peak thread QPS", "evidence", "recommendation")
    elapsed = f" in {diag.elapsed_s:.1f} s" if math.isfinite(diag.elapsed_s) else ""
    created = f", started {diag.created}" if diag.created else ""
    order = diag.in_order()
    load = diag.machine_load()
    return (
        f"<div class='spdl-diag'>{_STYLE}"
        f"<p><b>{html.escape(diag.headline())}</b></p>"
        + (f"<p class='note'>{html.escape(load)}</p>" if load else "")
        + (qps_charts(diag) if charts else "")
        + f"<table><thead><tr>{''.join(f'<th>{h}</th>' for h in heads)}</tr></thead>"
        f"<tbody>{''.join(_row(s) for s in order)}</tbody></table>"
        f"{_details(order)}"
        f"<p class='note'>Diagnosis of <code>{html.escape(diag.pipeline)}</code>: "
        f"{len(diag.stages)} stages{html.escape(elapsed + created)}; "
        f"<code>.plot()</code> draws the interactive figures, <code>.table</code> has every point.</p></div>"
    )


def _details(stages: list[StageDiagnosis]) -> str:
    """Per stage, the numbers behind its one-sentence evidence."""
    items = "".join(f"<li><b>{html.escape(s.name)}</b>: " + " ".join(html.escape(n) for n in s.notes)
                    + "</li>" for s in stages if s.notes)
    return f"<details><summary>details</summary><ul>{items}</ul></details>" if items else ""


def _mapping_line(label: str, values: dict) -> str:
    items = ", ".join(f"{k}={v}" for k, v in values.items())
    return f"<p class='note'><b>{label}:</b> {html.escape(items) or '-'}</p>"


def write_diagnosis_report(diag: Diagnosis, path: str | Path, *, title: str = "spdl_lab diagnosis") -> Path:
    """Write the verdicts, figures and every measured point to one self-contained HTML file."""
    # Bokeh escapes the names inside its document JSON itself.
    verdicts = diagnosis_html(diag, charts=False)  # Bokeh draws the charts
    points = diag.table.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}", escape=True)
    details = (f"<h2>Details</h2>{_mapping_line('machine', diag.machine)}{_mapping_line('settings', diag.settings)}"
               f"<h3>All measured points</h3>{points}")
    return write_page(diagnosis_plot(diag), path, title, note="", table=f"{verdicts}<h2>QPS against concurrency</h2>",
                      after=details)
