"""A Diagnosis to and from plain JSON, and as a fixed-width table for terminals.

Reading is strict and executes nothing: the file becomes dicts, lists, numbers and strings
only, and the schema below (``DiagnosisFile``) checks every field before a Diagnosis is built.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import model_validator

from ..errors import FileFormatError
from ..file_checks import (
    MAX_COUNT,
    MAX_NAME,
    MAX_TEXT,
    Checker,
    Meta,
    Record,
    at_most,
    choice,
    describe,
    dump_document,
    integer,
    load_document,
    number,
    plain,
    refuse,
    short,
    string,
)
from ..pipeline import MAX_CONCURRENCY
from .result import VERDICTS, Diagnosis, Point, StageDiagnosis

__all__ = ["DiagnosisFormatError", "build", "read_json", "summary_text", "write_json"]

FORMAT, VERSION = "spdl_lab.diagnosis", 2
MAX_FILE_BYTES = 50 * 2**20
MAX_STAGES, MAX_POINTS = 1000, 10_000  # points: per stage and over the whole file
MAX_REPEATS, MAX_NOTES = 10**6, 100


class DiagnosisFormatError(FileFormatError):
    """A diagnosis file (or a Diagnosis being written) does not fit the format; ``field`` is its JSON path."""


class _Checker(Checker):
    noun = "diagnosis"
    read_fix = ("Only files written by Diagnosis.to_json can be read; "
                "run lab.diagnose again and save it with .to_json(path)")
    write_fix = ("Correct that field of the Diagnosis (settings and machine take str, int, float, bool, "
                 "None or flat lists of those)")
    error = DiagnosisFormatError


Name, Text, TextOrNone = string(MAX_NAME), string(MAX_TEXT), string(MAX_TEXT, null=True)
Rate, Count, Positive, Repeats = number(0), integer(0, MAX_COUNT), integer(1, MAX_COUNT), integer(0, MAX_REPEATS)
Share = number(0, 1.5)  # of time or of cores; timer skew takes it a little over 1
Concurrency, ConcurrencyOrNone = integer(1, MAX_CONCURRENCY), integer(1, MAX_CONCURRENCY, null=True)
Executor, PointStatus = choice("thread", "process"), choice("ok", "unstable", "timeout", "error")
Kind, Verdict = choice("map", "batch"), choice(*VERDICTS, null=True)
StageStatus = choice("measured", "unstable", "failed", "not measured", "batch")


class PointRecord(Record):
    stage: Name
    executor: Executor
    concurrency: Concurrency
    qps: Rate
    qps_spread: Rate
    cpu_util: Share
    gil_wait_frac: Share
    runqueue_wait_frac: Share
    p50_ms: Rate
    repeats: Repeats
    status: PointStatus
    failures: Count
    machine_cpu_util: Share


class StageRecordV1(Record):
    name: Name
    kind: Kind
    verdict: Verdict
    best_concurrency: ConcurrencyOrNone
    evidence: Text
    recommendation: Text
    points: Annotated[list[PointRecord], at_most(lambda: MAX_POINTS, "points")]
    inputs: Count
    outputs: Count
    error: TextOrNone


class StageRecord(StageRecordV1):
    status: StageStatus
    notes: Annotated[list[Text], at_most(MAX_NOTES, "notes")]
    concurrency: ConcurrencyOrNone
    items_per_input: Positive


class DiagnosisFileV1(Record):
    format: Literal[FORMAT]
    version: Literal[1]
    pipeline: Text
    created: Name
    elapsed_s: Rate
    settings: Meta
    machine: Meta
    stages: Annotated[list[StageRecordV1], at_most(lambda: MAX_STAGES, "stages")]

    @model_validator(mode="after")
    def _each_stage_once_with_its_points(self) -> DiagnosisFileV1:
        names, points = set(), 0
        for i, stage in enumerate(self.stages):
            if stage.name in names:
                refuse(("stages", i, "name"), f"stage {short(stage.name)} appears twice")
            names.add(stage.name)
            for j, point in enumerate(stage.points):
                if point.stage != stage.name:
                    refuse(("stages", i, "points", j, "stage"), f"expected {short(stage.name)} "
                                                                f"(the enclosing stage), got {describe(point.stage)}")
            points += len(stage.points)
            if points > MAX_POINTS:
                refuse(("stages", i, "points"), f"more than the limit of {MAX_POINTS} points in all")
        return self


class DiagnosisFile(DiagnosisFileV1):
    version: Literal[2]
    stages: Annotated[list[StageRecord], at_most(lambda: MAX_STAGES, "stages")]


#: Fields version 1 files do not have, and what they read as (``status`` from the others).
_NEW_IN_2 = {"status": None, "notes": (), "concurrency": None, "items_per_input": 1}
assert list(PointRecord.model_fields) == [f.name for f in fields(Point)]
assert set(StageRecord.model_fields) == {f.name for f in fields(StageDiagnosis)}


def _read(doc: dict[str, Any], checker: _Checker) -> Diagnosis:
    version = checker.check_header(doc, FORMAT, VERSION, older=(1,))
    file = checker.validate(DiagnosisFile if version == VERSION else DiagnosisFileV1, doc)
    return Diagnosis(pipeline=file.pipeline, stages={s.name: _stage(s) for s in file.stages},
                     settings=file.settings, machine=file.machine, created=file.created, elapsed_s=file.elapsed_s)


def _stage(record: StageRecordV1) -> StageDiagnosis:
    values = dict(record)
    if not isinstance(record, StageRecord):
        values = {**_NEW_IN_2, **values, "status": _v1_status(record)}
    return StageDiagnosis(**{**values, "notes": tuple(values["notes"]),
                             "points": tuple(Point(**dict(p)) for p in record.points)})


def _v1_status(stage: StageRecordV1) -> str:
    if stage.kind == "batch":
        return "batch"
    if stage.verdict is not None:
        return "measured"
    return "not measured" if stage.evidence.startswith("not measured") else "failed"


def _encode(diag: Diagnosis) -> dict[str, Any]:
    stages = [asdict(s) for s in diag.stages.values()]
    for stage in stages:
        stage["points"] = stage.pop("points")  # last: after the short fields a reader looks for
    return plain({"format": FORMAT, "version": VERSION, "pipeline": diag.pipeline, "created": diag.created,
                  "elapsed_s": diag.elapsed_s, "settings": diag.settings, "machine": diag.machine,
                  "stages": stages})


def write_json(diag: Diagnosis, path: str | Path) -> Path:
    """Write ``diag`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    doc = _encode(diag)
    _read(doc, _Checker(path, writing=True))  # refuse now what read_json would refuse later
    return dump_document(doc, path)


def read_json(path: str | Path) -> Diagnosis:
    """Read and validate a file written by ``write_json``; raise DiagnosisFormatError if it does not fit."""
    path = Path(path)
    return build(load_document(path, _Checker(path), MAX_FILE_BYTES), path)


def build(doc: dict[str, Any], source: str | Path) -> Diagnosis:
    """A Diagnosis from an already parsed document (``load_document``), checked field by field."""
    return _read(doc, _Checker(source))


def summary_text(diag: Diagnosis, width: int = 100) -> str:
    """One block per stage: a row of numbers, then its evidence, recommendation and error.

    Every string from the Diagnosis passes through ``_printable``: a file someone sent
    must not drive the terminal its summary is printed on.
    """
    order = sorted(diag.stages.values(), key=lambda s: s.name != diag.bottleneck)  # the limit first
    names = {s.name: _printable(s.name) for s in diag.stages.values()}
    name_w = min(max([5, *(len(n) for n in names.values())]), 30)
    head = f"{'stage':<{name_w}}  {'kind':<5}  {'verdict':<9}  {'best':>4}  {'thread qps':>10}  {'process qps':>11}"
    pipeline = _printable(diag.pipeline.splitlines()[0]) if diag.pipeline else ""
    elapsed = f", {diag.elapsed_s:.1f} s" if math.isfinite(diag.elapsed_s) else ""
    created = f", {_printable(diag.created)}" if diag.created else ""
    lines = [textwrap.shorten(f"diagnosis of {pipeline}", width, placeholder="..."),
             f"{len(diag.stages)} stages{elapsed}{created}", ""]
    lines += textwrap.wrap(_printable(diag.headline()), width)
    load = diag.machine_load()
    if load:
        lines += textwrap.wrap(_printable(load), width)
    lines += ["", head, "-" * len(head)]
    for s in order:
        name = names[s.name] if len(names[s.name]) <= name_w else names[s.name][: name_w - 3] + "..."
        best = "-" if s.best_concurrency is None else str(s.best_concurrency)
        verdict = _printable(s.verdict or s.shown_status())
        lines.append(f"{name:<{name_w}}  {_printable(s.kind):<5}  {verdict:<9}  {best:>4}  "
                     f"{_peak(s.thread_points()):>10}  {_peak(s.process_points()):>11}")
        for label, text in (("evidence", s.evidence), ("do", s.recommendation), ("error", _last_line(s.error))):
            if text:
                lines += textwrap.wrap(_printable(" ".join(text.split())), width, initial_indent=f"    {label}: ",
                                       subsequent_indent="      ", max_lines=4, placeholder=" ...")
    return "\n".join(lines)


def _printable(text: str) -> str:
    """``text`` with control and format characters (ESC, BEL, CSI, bidi overrides) written as escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _peak(points: list[Point]) -> str:
    qps = [p.qps for p in points if math.isfinite(p.qps)]
    return f"{max(qps):,.1f}" if qps else "-"


def _last_line(error: str | None) -> str:
    """A traceback's last line is the exception and its message: enough for a terminal."""
    lines = [ln for ln in (error or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
