"""A recorded training run (``lab.publish`` / ``spdl-lab watch``) as one self-contained HTML file.
The record is data: its numbers are read as numbers (anything else is dropped), its names reach
the page only escaped, and Bokeh's code is inlined, so the page opens with no network."""

from __future__ import annotations

import html
import os
from pathlib import Path

import pandas as pd
from bokeh.layouts import column
from bokeh.models import Legend
from bokeh.plotting import figure

from .._training.steps import StepSummary
from .._watch.records import read_record, read_step_summary, record_meta, with_record
from .live_plots import stage_colors
from .report import write_page

#: (series, label) in the table over ticks, a row per stage, in this order: what the stages and
#: probes did. The training loop's figures are per step (``step_table``).
SUMMARY = [("qps", "items/s"), ("p50_ms", "task p50 (ms)"), ("busy_frac", "busy share of its workers"),
           ("cpu_percent", "CPU (% of one core)"), ("gil_wait_frac", "GIL wait share")]
#: (StepSummary field, label) of the training loop's figures, over every step.
STEP_FIGURES = [("steps", "steps"), ("elapsed_s", "seconds, first batch asked to last step"),
                ("batches_per_s", "steps/s"), ("step_p50_ms", "step p50 (ms)"),
                ("step_p90_ms", "step p90 (ms)"), ("step_p99_ms", "step p99 (ms)"),
                ("data_wait_p50_ms", "data wait p50 (ms)"), ("data_wait_p90_ms", "data wait p90 (ms)"),
                ("data_wait_frac", "data wait, share of the loop"),
                ("device_mean_ms", "device time per step (ms)"),
                ("device_util", "device busy, share of the loop"),
                ("copy_mean_ms", "host-to-device copy (ms)")]
#: (title, series, y label) of the plots over time, each a line per stage.
PLOTS = [("training step: batches/s", "batches_per_s", "batches/s"),
         ("share of the loop spent waiting for data", "data_wait_frac", "share"),
         ("items/s per stage", "qps", "items/s"),
         ("queue depth", "queue_depth", "items"),
         ("CPU", "cpu_percent", "% of one core"),
         ("GIL wait (probe) and the training thread's", "gil_wait_frac", "share")]


def read_run(record: str | os.PathLike) -> tuple[dict[str, str], pd.DataFrame]:
    """The record's meta and its frames, finite numbers only: a record from elsewhere may hold anything."""
    meta, frames = record_meta(record), read_record(record)
    frames = frames.assign(time_s=pd.to_numeric(frames["time_s"], errors="coerce"),
                           value=pd.to_numeric(frames["value"], errors="coerce"),
                           series=frames["series"].astype(str), stage=frames["stage"].astype(str))
    return meta, frames.dropna(subset=["time_s", "value"]).sort_values("time_s", kind="stable")


def step_table(step: StepSummary | None) -> pd.DataFrame:
    """The training loop's figures, one row each (those the run has: no device, no device rows)."""
    rows = [] if step is None else [{"what": label, "value": getattr(step, name)} for name, label in STEP_FIGURES
                                    if pd.notna(getattr(step, name))]
    return pd.DataFrame(rows, columns=["what", "value"])


def run_summary(frames: pd.DataFrame) -> pd.DataFrame:
    """Median, 10th and 90th percentile over the ticks of the stages' and probes' series."""
    groups = frames.groupby(["series", "stage"], sort=False)["value"]
    rows = [{"what": f"{label}: {name}", "median": values.median(), "p10": values.quantile(0.1),
             "p90": values.quantile(0.9), "ticks": len(values)}
            for series, label in SUMMARY for (kind, name), values in groups if kind == series]
    return pd.DataFrame(rows, columns=["what", "median", "p10", "p90", "ticks"])


def _plot(frames: pd.DataFrame, series: str, title: str, y_label: str):
    chosen = frames[frames["series"] == series]
    if chosen.empty:
        return None
    colors = stage_colors(list(dict.fromkeys(chosen["stage"])))
    fig = figure(width=840, height=240, title=title, x_axis_label="seconds since publishing started",
                 y_axis_label=y_label, toolbar_location=None)
    items = [(stage, [fig.line(part["time_s"].to_numpy(), part["value"].to_numpy(),
                               color=colors[stage], line_width=2)])
             for stage, part in chosen.groupby("stage", sort=False)]
    fig.add_layout(Legend(items=items), "right")
    return fig


def duration_s(frames: pd.DataFrame) -> float:
    return float(frames["time_s"].max() - frames["time_s"].min()) if len(frames) else 0.0


def run_text(meta: dict[str, str], frames: pd.DataFrame, step: StepSummary | None = None) -> str:
    """The run for a terminal: who and in what state, the training loop per step, the stages."""
    who = (f"{meta.get('name', '?')} (pid {meta.get('pid', '?')}, runner {meta.get('runner', '?')}, "
           f"started {meta.get('started', '?')}): state {meta.get('state', '?')}, "
           f"{duration_s(frames):.1f} s recorded")
    lines = [who, _headline(step)]
    if step is not None and step.steps:
        lines.append(step_table(step).to_string(index=False, header=False, float_format=lambda v: f"{v:,.4g}"))
    if not (summary := run_summary(frames)).empty:
        lines += ["over the ticks (10 a second):",
                  summary.to_string(index=False, float_format=lambda v: f"{v:,.3g}")]
    return "\n".join(lines)


def _headline(step: StepSummary | None) -> str:
    if step is None or not step.steps:
        return "training: no steps in the record (no training step was timed)"
    return (f"training: {step.steps:,} steps in {step.elapsed_s:,.1f} s, {step.batches_per_s:,.4g} steps/s; "
            f"step p50 {step.step_p50_ms:,.3g} ms, data wait p50 {step.data_wait_p50_ms:,.3g} ms, "
            f"{step.data_wait_frac:.0%} of the loop waiting for data")


def _facts(meta: dict[str, str], frames: pd.DataFrame) -> str:
    """The run's header as an HTML table; every value from the file is escaped by pandas."""
    facts = [(key, meta.get(key, "?")) for key in ("name", "pid", "started", "runner", "state")]
    facts.append(("duration recorded", f"{duration_s(frames):.1f} s"))
    if meta.get("dropped_ticks", "0") not in ("0", ""):
        facts.append(("ticks dropped", meta["dropped_ticks"]))
    return pd.DataFrame(facts, columns=["run", ""]).to_html(index=False, escape=True)


_STATE_NOTES = {"killed": "The script was killed: the record holds what was written before, up to "
                          "its last flush (at most 2 s before the end).",
                "running": "The run is still going: this is the record so far."}


def _note(meta: dict[str, str]) -> str:
    """What the header table (``_facts``) cannot say: what a state or dropped ticks mean."""
    parts = [_STATE_NOTES.get(meta.get("state", "?"), "")]
    if meta.get("dropped_ticks", "0") not in ("0", ""):
        parts.append(f"{meta['dropped_ticks']} ticks were dropped rather than make training wait.")
    return " ".join(filter(None, parts))


def write_run_report(record: str | os.PathLike, out: str | os.PathLike, title: str | None = None) -> Path:
    """Write the run in ``record`` (a ``.sqlite`` record) as one HTML file; return its path."""
    return report_run(record, out, title)[1]


def report_run(record: str | os.PathLike, out: str | os.PathLike, title: str | None = None) -> tuple[str, Path]:
    """The run in ``record`` as text (``run_text``) and as a page: header, the training loop per
    step, the stages over ticks, plots over time. Read once: a running record grows meanwhile."""
    meta, frames = read_run(record)
    step = with_record(record, lambda db: read_step_summary(db, meta))
    figures = [f for f in (_plot(frames, s, t, y) for t, s, y in PLOTS) if f is not None] or [
        figure(width=840, height=120, title="the record holds no frames yet", toolbar_location=None)]
    summary = run_summary(frames).to_html(index=False, float_format=lambda v: f"{v:,.3g}", escape=True)
    steps = step_table(step).to_html(index=False, header=False, float_format=lambda v: f"{v:,.4g}", escape=True)
    tables = (f"{_facts(meta, frames)}<h2>the training loop, over every step</h2>"
              f"<p>{html.escape(_headline(step))}</p>{steps}"
              f"<h2>stages and probes over the ticks: median, 10th and 90th percentile</h2>{summary}")
    title = title or f"spdl_lab run: {meta.get('name', Path(record).stem)}"
    page = write_page(column(*figures), out, title, note=_note(meta), table=tables)
    return run_text(meta, frames, step), page
