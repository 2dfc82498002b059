"""What ``lab.diagnose`` returns: per stage, the measured points, a verdict and what to change.

Plain data (dataclasses of numbers and strings), so a Diagnosis round-trips
through JSON (``to_json`` / ``from_json``, never pickle) and renders to a
self-contained HTML report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .._views import view

__all__ = ["VERDICTS", "Diagnosis", "Point", "StageDiagnosis", "TABLE_COLUMNS"]

#: The verdict vocabulary (see DESIGN.md and ``verdict_rules``).
VERDICTS = ("scales", "cpu-bound", "gil-bound", "contended")

#: ``Diagnosis.table`` columns, in order.
TABLE_COLUMNS = [
    "stage", "executor", "concurrency", "qps", "cpu_util", "gil_wait_frac",
    "runqueue_wait_frac", "p50_ms", "repeats", "qps_spread", "status", "machine_cpu_util",
]


@dataclass(frozen=True)
class Point:
    """One measured setting: a stage run alone at one concurrency by one executor."""

    stage: str
    executor: str  # "thread" | "process"
    concurrency: int
    qps: float  # items/s: the second-best window (_slices.point_qps; processes: _process_qps); NaN: none finished
    qps_spread: float  # (max - min) / qps over the windows; NaN with < 2 windows
    cpu_util: float  # CPU of this process and its children / (wall time x cores): 0..1
    gil_wait_frac: float  # the GIL probe during the windows (NaN for processes)
    runqueue_wait_frac: float  # the probe's run-queue wait (NaN for processes)
    p50_ms: float  # task time p50 over the windows
    repeats: int  # measurement windows
    status: str = "ok"  # "ok" | "unstable" (cap reached before stable) | "timeout" | "error"
    failures: int = 0  # tasks that raised during the point
    machine_cpu_util: float = math.nan  # the whole machine's busy share (every process), 0..1


@dataclass(frozen=True)
class StageDiagnosis:
    name: str
    kind: str  # "map" | "batch"
    verdict: str | None  # one of VERDICTS; None for batch stages and stages not measured
    best_concurrency: int | None  # smallest concurrency within 5% (or the noise) of the best thread QPS
    evidence: str  # one sentence with the numbers behind the verdict
    recommendation: str  # what to change: runner, concurrency, or the function
    points: tuple[Point, ...] = ()
    inputs: int = 0  # cached inputs the stage was fed
    outputs: int = 0  # outputs it produced (fewer when items failed or a batch dropped its tail)
    error: str | None = None  # the traceback of a raising stage, or why it was not measured
    #: "measured" | "unstable" (measure again) | "failed" (an input raised: no verdict) |
    #: "not measured" | "batch"
    status: str = "measured"
    notes: tuple[str, ...] = ()  # the details behind the one-sentence evidence
    concurrency: int | None = None  # the stage's concurrency in the pipeline
    items_per_input: int = 1  # source items per input of this stage (a batch's size after it)

    def shown_status(self) -> str:
        """What a table shows in place of a verdict: "failed", "not measured" or "-"."""
        if self.status in ("failed", "not measured"):
            return self.status
        return "failed" if self.error and self.kind == "map" else "-"

    def rate_now(self) -> float:
        """Source items/s at its concurrency in the pipeline, from its thread points (NaN: unknown)."""
        from ._bottleneck import rate_at

        return rate_at(self)

    def thread_points(self) -> list[Point]:
        return [p for p in self.points if p.executor == "thread"]

    def process_points(self) -> list[Point]:
        return [p for p in self.points if p.executor == "process"]


@dataclass
class Diagnosis:
    """``lab.diagnose``'s result. ``stages[name].verdict``, ``.table``, ``.plot()``,
    ``to_html(path)``, ``to_json(path)``, ``Diagnosis.from_json(path)``."""

    pipeline: str  # the pipeline's repr
    stages: dict[str, StageDiagnosis]
    settings: dict[str, Any] = field(default_factory=dict)  # concurrency, num_items, windows...
    machine: dict[str, Any] = field(default_factory=dict)  # cores, python, gil
    created: str = ""  # ISO 8601 time the diagnosis started
    elapsed_s: float = math.nan

    @property
    def table(self) -> pd.DataFrame:
        """One row per measured point (TABLE_COLUMNS)."""
        rows = [
            {c: getattr(p, c) for c in TABLE_COLUMNS}
            for s in self.stages.values() for p in s.points
        ]
        return pd.DataFrame(rows, columns=TABLE_COLUMNS)

    @property
    def bottleneck(self) -> str | None:
        """The stage that limits the pipeline at its current concurrency (None: none measured)."""
        from ._bottleneck import limiting

        found = limiting(self.stages.values())
        return found[0].name if found else None

    def headline(self) -> str:
        """One sentence: which stage limits the pipeline, by how much, and what to change."""
        from ._bottleneck import headline

        return headline(self)

    def machine_load(self) -> str:
        """One line naming the load from other processes while the stages were measured, and the
        kernel's sessions paused meanwhile ("" if neither)."""
        from ._bottleneck import machine_load

        return machine_load(self)

    def verdicts(self) -> pd.DataFrame:
        """One row per stage, the limiting stage first: verdict, best concurrency, evidence, advice."""
        order = sorted(self.stages.values(), key=lambda s: s.name != self.bottleneck)
        rows = [
            {"stage": s.name, "verdict": s.verdict or s.status, "best_concurrency": s.best_concurrency,
             "evidence": s.evidence, "recommendation": s.recommendation}
            for s in order
        ]
        frame = pd.DataFrame(rows).set_index("stage")
        frame["best_concurrency"] = frame["best_concurrency"].astype("Int64")  # None stays <NA>, ints stay ints
        return frame

    def summary(self) -> str:
        """A plain-text table for terminals: stage, verdict, best concurrency, peak QPS."""
        from .file_format import summary_text

        return summary_text(self)

    def plot(self) -> Any:
        """Bokeh: QPS against concurrency per stage, with CPU and GIL wait."""
        diagnosis_plot = view("diagnosis_plot")

        return diagnosis_plot(self)

    def to_html(self, path: str | Path) -> Path:
        """One self-contained HTML file (INLINE Bokeh, no network)."""
        write_diagnosis_report = view("diagnosis_report")

        return write_diagnosis_report(self, path)

    def to_json(self, path: str | Path) -> Path:
        from .file_format import write_json

        return write_json(self, path)

    @classmethod
    def from_json(cls, path: str | Path) -> Diagnosis:
        """Read a Diagnosis written by ``to_json``; plain JSON, validated, never executed."""
        from .file_format import read_json

        return read_json(path)

    def _repr_html_(self) -> str:
        diagnosis_html = view("diagnosis_html")

        return diagnosis_html(self)

    def __repr__(self) -> str:
        return self.summary()
