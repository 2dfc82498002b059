"""A Diagnosis to and from plain JSON, and as a fixed-width table for terminals.

Reading is strict and executes nothing: the file becomes dicts, lists, numbers and
strings only, and every field is checked for type and range before a Diagnosis is built.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import textwrap
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import SpdlLabError
from ..pipeline import MAX_CONCURRENCY
from .diagnosis import VERDICTS, Diagnosis, Point, StageDiagnosis

__all__ = ["DiagnosisFormatError", "read_json", "summary_text", "write_json"]

FORMAT, VERSION = "spdl_lab.diagnosis", 1
MAX_FILE_BYTES = 50 * 2**20
MAX_STAGES, MAX_POINTS = 1000, 10_000  # points: per stage and over the whole file
MAX_NAME, MAX_TEXT = 200, 100_000  # characters: names and short labels; evidence, tracebacks
MAX_META_KEYS, MAX_META_LIST = 200, 10_000
MAX_REPEATS, MAX_COUNT = 10**6, 10**15
_READ_FIX = "Only files written by Diagnosis.to_json can be read; run lab.diagnose again and save it with .to_json(path)"
_WRITE_FIX = "Correct that field of the Diagnosis (settings and machine take str, int, float, bool, None or flat lists of those)"


class DiagnosisFormatError(SpdlLabError, ValueError):
    """A diagnosis file (or a Diagnosis being written) does not fit the format; ``field`` is its JSON path."""

    def __init__(self, message: str, *, source: str, field: str) -> None:
        super().__init__(message)
        self.source, self.field = source, field


class _Checker:
    """Type and range checks that name the file, the JSON path and what was expected."""

    def __init__(self, source: Path, writing: bool) -> None:
        self.source, self.writing = str(source), writing

    def fail(self, where: str, problem: str, fix: str | None = None) -> DiagnosisFormatError:
        head = f"cannot write diagnosis {self.source}" if self.writing else f"diagnosis file {self.source}"
        fix = fix or (_WRITE_FIX if self.writing else _READ_FIX)
        at = f" {where}:" if where else ""
        return DiagnosisFormatError(f"{head}:{at} {problem}. {fix}.", source=self.source, field=where)

    def expected(self, where: str, what: str, value: Any) -> DiagnosisFormatError:
        return self.fail(where, f"expected {what}, got {_describe(value)}")

    def record(self, value: Any, where: str, spec: dict[str, Callable]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.expected(where, "an object", value)
        extra = [k for k in value if k not in spec]
        if extra:
            raise self.fail(f"{where}.{_key(extra[0])}".lstrip("."), f"unknown key (allowed: {', '.join(spec)})")
        missing = [k for k in spec if k not in value]
        if missing:
            raise self.fail(f"{where}.{missing[0]}".lstrip("."), "key is missing")
        return {k: check(self, value[k], f"{where}.{k}".lstrip(".")) for k, check in spec.items()}

    def integer(self, value: Any, where: str, lo: int, hi: int, null: bool = False) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.expected(where, f"an integer in {lo}..{hi}" + (" or null" if null else ""), value)
        return value

    def number(self, value: Any, where: str, lo: float, hi: float) -> float:
        # null stands for NaN: JSON has no NaN, and to_json writes NaN and inf as null.
        if value is None:
            return math.nan
        what = f"a number >= {lo:g} or null" if hi == math.inf else f"a number in {lo:g}..{hi:g} or null"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.expected(where, what, value)
        if isinstance(value, int) and not -1e300 < value < 1e300:  # float() of 10**400 overflows
            raise self.expected(where, what, value)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise self.expected(where, what, value)
        return float(value)

    def text(self, value: Any, where: str, limit: int, choices: tuple | None = None,
            null: bool = False) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str):
            raise self.expected(where, "a string" + (" or null" if null else ""), value)
        if choices is not None and value not in choices:
            raise self.expected(where, "one of " + ", ".join(map(repr, choices)), value)
        if len(value) > limit:
            raise self.fail(where, f"string of {len(value)} characters is longer than the limit of {limit}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: it would break every writer downstream
            raise self.fail(where, "string holds an unpaired surrogate (not valid Unicode)") from None
        return value

    def meta(self, value: Any, where: str) -> dict[str, Any]:
        """settings / machine: a flat dict of str to a scalar or a flat list of scalars."""
        if not isinstance(value, dict):
            raise self.expected(where, "an object", value)
        if len(value) > MAX_META_KEYS:
            raise self.fail(where, f"{len(value)} keys, more than the limit of {MAX_META_KEYS}")
        out = {}
        for key, item in value.items():
            self.text(key, f"{where} key", MAX_NAME)
            at = f"{where}[{_short(key)}]"
            if isinstance(item, (list, tuple)):
                if len(item) > MAX_META_LIST:
                    raise self.fail(at, f"list of {len(item)} items, more than the limit of {MAX_META_LIST}")
                out[key] = [self._scalar(x, f"{at}[{i}]") for i, x in enumerate(item)]
            else:
                out[key] = self._scalar(item, at)
        return out

    def _scalar(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return self.text(value, where, MAX_TEXT)
        if isinstance(value, numbers.Integral):
            return self.integer(int(value), where, -(2**63), 2**63 - 1)
        if isinstance(value, numbers.Real):
            value = float(value)
            if self.writing and not math.isfinite(value):
                return None
            return self.number(value, where, -math.inf, math.inf)
        raise self.expected(where, "a string, number, bool, null or a flat list of those", value)


def _describe(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an int of {value.bit_length()} bits"
    kind = {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null"}.get(
        type(value), type(value).__name__)
    return f"{kind} {_short(value)}" if kind not in ("object", "array") else kind


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(key: str) -> str:
    return key if key.isidentifier() and len(key) <= 60 else f"[{_short(key)}]"


def _text(limit: int, choices: tuple | None = None, null: bool = False) -> Callable:
    return lambda c, v, w: c.text(v, w, limit, choices, null)


def _int(lo: int, hi: int, null: bool = False) -> Callable:
    return lambda c, v, w: c.integer(v, w, lo, hi, null)


def _num(lo: float, hi: float = math.inf) -> Callable:
    return lambda c, v, w: c.number(v, w, lo, hi)


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
    "points": lambda c, v, w: v,  # checked by _points, which needs the stage's name
    "inputs": _int(0, MAX_COUNT), "outputs": _int(0, MAX_COUNT), "error": _text(MAX_TEXT, null=True),
}
_TOP = {
    "format": _text(MAX_NAME), "version": lambda c, v, w: v,  # checked first, with their own messages
    "pipeline": _text(MAX_TEXT), "created": _text(MAX_NAME), "elapsed_s": _num(0),
    "settings": lambda c, v, w: c.meta(v, w), "machine": lambda c, v, w: c.meta(v, w),
    "stages": lambda c, v, w: v,
}
assert list(_POINT) == [f.name for f in fields(Point)]
assert set(_STAGE) == {f.name for f in fields(StageDiagnosis)}


def _build(doc: dict[str, Any], checker: _Checker) -> Diagnosis:
    if doc.get("format") != FORMAT:
        raise checker.expected("format", repr(FORMAT), doc.get("format"))
    version = doc.get("version")
    if type(version) is not int or version != VERSION:  # True == 1 and 1.0 == 1 must not pass
        fix = "Upgrade spdl_lab to read it" if isinstance(version, int) and version > VERSION else None
        raise checker.fail("version", f"expected {VERSION}, got {_describe(version)}", fix)
    top = checker.record(doc, "", _TOP)
    stages_in = top["stages"]
    if not isinstance(stages_in, list):
        raise checker.expected("stages", "an array", stages_in)
    if len(stages_in) > MAX_STAGES:
        raise checker.fail("stages", f"{len(stages_in)} stages, more than the limit of {MAX_STAGES}")
    stages: dict[str, StageDiagnosis] = {}
    total = 0
    for i, raw in enumerate(stages_in):
        values = checker.record(raw, f"stages[{i}]", _STAGE)
        if values["name"] in stages:
            raise checker.fail(f"stages[{i}].name", f"stage {_short(values['name'])} appears twice")
        values["points"] = _points(checker, values["points"], f"stages[{i}].points", values["name"])
        total += len(values["points"])
        if total > MAX_POINTS:
            raise checker.fail(f"stages[{i}].points", f"more than the limit of {MAX_POINTS} points in all")
        stages[values["name"]] = StageDiagnosis(**values)
    return Diagnosis(pipeline=top["pipeline"], stages=stages, settings=top["settings"],
                     machine=top["machine"], created=top["created"], elapsed_s=top["elapsed_s"])


def _points(checker: _Checker, raw: Any, where: str, stage: str) -> tuple[Point, ...]:
    if not isinstance(raw, list):
        raise checker.expected(where, "an array", raw)
    if len(raw) > MAX_POINTS:
        raise checker.fail(where, f"{len(raw)} points, more than the limit of {MAX_POINTS}")
    points = []
    for j, item in enumerate(raw):
        values = checker.record(item, f"{where}[{j}]", _POINT)
        if values["stage"] != stage:
            raise checker.expected(f"{where}[{j}].stage", f"{_short(stage)} (the enclosing stage)", values["stage"])
        points.append(Point(**values))
    return tuple(points)


def _plain(value: Any) -> Any:
    """A field value as JSON takes it: NaN and inf become null (JSON has neither), numpy numbers plain."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


def _encode(diag: Diagnosis, checker: _Checker) -> dict[str, Any]:
    stages = []
    for s in diag.stages.values():
        out = {f.name: _plain(getattr(s, f.name)) for f in fields(StageDiagnosis) if f.name != "points"}
        out["points"] = [{f.name: _plain(getattr(p, f.name)) for f in fields(Point)} for p in s.points]
        stages.append(out)
    return {
        "format": FORMAT, "version": VERSION, "pipeline": diag.pipeline, "created": diag.created,
        "elapsed_s": _plain(diag.elapsed_s), "settings": checker.meta(diag.settings, "settings"),
        "machine": checker.meta(diag.machine, "machine"), "stages": stages,
    }


def write_json(diag: Diagnosis, path: str | Path) -> Path:
    """Write ``diag`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    checker = _Checker(path, writing=True)
    doc = _encode(diag, checker)
    _build(doc, checker)  # refuse now what read_json would refuse later
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, allow_nan=False, ensure_ascii=False, indent=1)
        os.replace(tmp, path)  # a reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (NaN and infinities are written as null)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {_short(dup)} appears twice in one object")
    return out


def read_json(path: str | Path) -> Diagnosis:
    """Read and validate a file written by ``write_json``; raise DiagnosisFormatError if it does not fit."""
    path = Path(path)
    checker = _Checker(path, writing=False)
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise checker.fail("", f"{size} bytes, larger than the limit of {MAX_FILE_BYTES}")
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)  # the file may have grown since stat
    if len(data) > MAX_FILE_BYTES:
        raise checker.fail("", f"larger than the limit of {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants,
                         object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise checker.fail("", "nested too deeply to be a diagnosis") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, digit limit, our hooks
        raise checker.fail("", f"not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise checker.expected("top level", "an object", doc)
    return _build(doc, checker)


def summary_text(diag: Diagnosis, width: int = 100) -> str:
    """One block per stage: a row of numbers, then its evidence, recommendation and error."""
    name_w = min(max([5, *(len(n) for n in diag.stages)]), 30)
    head = f"{'stage':<{name_w}}  {'kind':<5}  {'verdict':<9}  {'best':>4}  {'thread qps':>10}  {'process qps':>11}"
    pipeline = diag.pipeline.splitlines()[0] if diag.pipeline else ""
    elapsed = f", {diag.elapsed_s:.1f} s" if math.isfinite(diag.elapsed_s) else ""
    lines = [textwrap.shorten(f"diagnosis of {pipeline}", width, placeholder="..."),
             f"{len(diag.stages)} stages{elapsed}{', ' + diag.created if diag.created else ''}",
             "", head, "-" * len(head)]
    for s in diag.stages.values():
        name = s.name if len(s.name) <= name_w else s.name[: name_w - 3] + "..."
        best = "-" if s.best_concurrency is None else str(s.best_concurrency)
        lines.append(f"{name:<{name_w}}  {s.kind:<5}  {s.verdict or ('failed' if s.error else '-'):<9}  {best:>4}  "
                     f"{_peak(s.thread_points()):>10}  {_peak(s.process_points()):>11}")
        for label, text in (("evidence", s.evidence), ("do", s.recommendation), ("error", _last_line(s.error))):
            if text:
                lines += textwrap.wrap(" ".join(text.split()), width, initial_indent=f"    {label}: ",
                                       subsequent_indent="      ", max_lines=4, placeholder=" ...")
    return "\n".join(lines)


def _peak(points: list[Point]) -> str:
    qps = [p.qps for p in points if math.isfinite(p.qps)]
    return f"{max(qps):,.1f}" if qps else "-"


def _last_line(error: str | None) -> str:
    """A traceback's last line is the exception and its message: enough for a terminal."""
    lines = [ln for ln in (error or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
