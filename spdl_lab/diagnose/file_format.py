"""A Diagnosis to and from plain JSON, and as a fixed-width table for terminals.

Reading is strict and executes nothing: the file becomes dicts, lists, numbers and
strings only, and every field is checked for type and range before a Diagnosis is built.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..file_checks import (
    MAX_COUNT,
    MAX_NAME,
    MAX_TEXT,
    Checker,
    FileFormatError,
    check_header,
    dump_document,
    later,
    load_document,
    plain,
    short,
)
from ..file_checks import int_field as _int
from ..file_checks import num_field as _num
from ..file_checks import text_field as _text
from ..pipeline import MAX_CONCURRENCY
from .result import VERDICTS, Diagnosis, Point, StageDiagnosis

__all__ = ["DiagnosisFormatError", "build", "read_json", "summary_text", "write_json"]

FORMAT, VERSION = "spdl_lab.diagnosis", 2
MAX_FILE_BYTES = 50 * 2**20
MAX_STAGES, MAX_POINTS = 1000, 10_000  # points: per stage and over the whole file
MAX_REPEATS = 10**6


class DiagnosisFormatError(FileFormatError):
    """A diagnosis file (or a Diagnosis being written) does not fit the format; ``field`` is its JSON path."""


class _Checker(Checker):
    noun = "diagnosis"
    read_fix = ("Only files written by Diagnosis.to_json can be read; "
                "run lab.diagnose again and save it with .to_json(path)")
    write_fix = ("Correct that field of the Diagnosis (settings and machine take str, int, float, bool, "
                 "None or flat lists of those)")
    error = DiagnosisFormatError


_POINT = {
    "stage": _text(MAX_NAME), "executor": _text(MAX_NAME, ("thread", "process")),
    "concurrency": _int(1, MAX_CONCURRENCY), "qps": _num(0), "qps_spread": _num(0),
    "cpu_util": _num(0, 1.5), "gil_wait_frac": _num(0, 1.5), "runqueue_wait_frac": _num(0, 1.5),
    "p50_ms": _num(0), "repeats": _int(0, MAX_REPEATS),
    "status": _text(MAX_NAME, ("ok", "unstable", "timeout", "error")), "failures": _int(0, MAX_COUNT),
    "machine_cpu_util": _num(0, 1.5),
}
_STAGE = {
    "name": _text(MAX_NAME), "kind": _text(MAX_NAME, ("map", "batch")),
    "verdict": _text(MAX_NAME, VERDICTS, null=True), "best_concurrency": _int(1, MAX_CONCURRENCY, null=True),
    "evidence": _text(MAX_TEXT), "recommendation": _text(MAX_TEXT),
    "points": later,  # checked by _points, which needs the stage's name
    "inputs": _int(0, MAX_COUNT), "outputs": _int(0, MAX_COUNT), "error": _text(MAX_TEXT, null=True),
    "status": _text(MAX_NAME, ("measured", "unstable", "failed", "not measured", "batch")),
    "notes": lambda c, v, w: _notes(c, v, w),
    "concurrency": _int(1, MAX_CONCURRENCY, null=True), "items_per_input": _int(1, MAX_COUNT),
}
#: Fields version 1 files do not have, and what they read as.
_NEW_IN_2 = {"status": None, "notes": (), "concurrency": None, "items_per_input": 1}
_STAGE_1 = {k: v for k, v in _STAGE.items() if k not in _NEW_IN_2}
MAX_NOTES = 100
_TOP = {
    "format": _text(MAX_NAME), "version": later,  # checked first, with their own messages
    "pipeline": _text(MAX_TEXT), "created": _text(MAX_NAME), "elapsed_s": _num(0),
    "settings": lambda c, v, w: c.meta(v, w), "machine": lambda c, v, w: c.meta(v, w),
    "stages": later,
}
assert list(_POINT) == [f.name for f in fields(Point)]
assert set(_STAGE) == {f.name for f in fields(StageDiagnosis)}


def _notes(checker: _Checker, value: Any, where: str) -> tuple[str, ...]:
    items = checker.array(value, where, MAX_NOTES, "notes")
    return tuple(checker.text(v, f"{where}[{i}]", MAX_TEXT) for i, v in enumerate(items))


def _v1_status(values: dict[str, Any]) -> str:
    if values["kind"] == "batch":
        return "batch"
    if values["verdict"] is not None:
        return "measured"
    return "not measured" if values["evidence"].startswith("not measured") else "failed"


def _build(doc: dict[str, Any], checker: _Checker) -> Diagnosis:
    version = check_header(doc, checker, FORMAT, VERSION, older=(1,))
    top = checker.record(doc, "", _TOP)
    stages_in = checker.array(top["stages"], "stages", MAX_STAGES, "stages")
    stages: dict[str, StageDiagnosis] = {}
    total = 0
    for i, raw in enumerate(stages_in):
        values = checker.record(raw, f"stages[{i}]", _STAGE if version == VERSION else _STAGE_1)
        if version == 1:
            values = {**_NEW_IN_2, **values, "status": _v1_status(values)}
        if values["name"] in stages:
            raise checker.fail(f"stages[{i}].name", f"stage {short(values['name'])} appears twice")
        values["points"] = _points(checker, values["points"], f"stages[{i}].points", values["name"])
        total += len(values["points"])
        if total > MAX_POINTS:
            raise checker.fail(f"stages[{i}].points", f"more than the limit of {MAX_POINTS} points in all")
        stages[values["name"]] = StageDiagnosis(**values)
    return Diagnosis(pipeline=top["pipeline"], stages=stages, settings=top["settings"],
                     machine=top["machine"], created=top["created"], elapsed_s=top["elapsed_s"])


def _points(checker: _Checker, raw: Any, where: str, stage: str) -> tuple[Point, ...]:
    points = []
    for j, item in enumerate(checker.array(raw, where, MAX_POINTS, "points")):
        values = checker.record(item, f"{where}[{j}]", _POINT)
        if values["stage"] != stage:
            raise checker.expected(f"{where}[{j}].stage", f"{short(stage)} (the enclosing stage)", values["stage"])
        points.append(Point(**values))
    return tuple(points)


def _encode(diag: Diagnosis, checker: _Checker) -> dict[str, Any]:
    stages = []
    for s in diag.stages.values():
        out = {f.name: plain(getattr(s, f.name)) for f in fields(StageDiagnosis) if f.name != "points"}
        out["notes"] = list(s.notes)
        out["points"] = [{f.name: plain(getattr(p, f.name)) for f in fields(Point)} for p in s.points]
        stages.append(out)
    return {
        "format": FORMAT, "version": VERSION, "pipeline": diag.pipeline, "created": diag.created,
        "elapsed_s": plain(diag.elapsed_s), "settings": checker.meta(diag.settings, "settings"),
        "machine": checker.meta(diag.machine, "machine"), "stages": stages,
    }


def write_json(diag: Diagnosis, path: str | Path) -> Path:
    """Write ``diag`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    checker = _Checker(path, writing=True)
    doc = _encode(diag, checker)
    _build(doc, checker)  # refuse now what read_json would refuse later
    return dump_document(doc, path)


def read_json(path: str | Path) -> Diagnosis:
    """Read and validate a file written by ``write_json``; raise DiagnosisFormatError if it does not fit."""
    path = Path(path)
    checker = _Checker(path, writing=False)
    return build(load_document(path, checker, MAX_FILE_BYTES), path)


def build(doc: dict[str, Any], source: str | Path) -> Diagnosis:
    """A Diagnosis from an already parsed document (``load_document``), checked field by field."""
    return _build(doc, _Checker(source, writing=False))


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
