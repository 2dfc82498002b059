"""A Diagnosis to and from JSON and as text: a faithful round trip, and hostile files refused cleanly."""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import fields, replace
from pathlib import Path

import pytest

from spdl_lab._diagnose import result as io
from spdl_lab._diagnose.result import (
    VERDICTS,
    Diagnosis,
    DiagnosisFormatError,
    Point,
    StageDiagnosis,
)
from spdl_lab._json import plain
from spdl_lab.errors import SpdlLabError

NAN = math.nan
TRACEBACK = (
    'Traceback (most recent call last):\n  File "<lab>", line 3, in decode\n'
    "    return table[x]\nKeyError: '<script>alert(1)</script>'\n"
)


def point(stage: str, c: int, qps: float, *, executor: str = "thread", cpu: float = 0.5,
          gil: float = 0.05, status: str = "ok") -> Point:
    process = executor == "process"
    return Point(stage=stage, executor=executor, concurrency=c, qps=qps, qps_spread=0.03,
                 cpu_util=cpu, gil_wait_frac=NAN if process else gil,
                 runqueue_wait_frac=NAN if process else 0.01, p50_ms=1000 * c / max(qps, 1.0),
                 repeats=3, status=status, failures=0)


def sample_diagnosis() -> Diagnosis:
    """Three map stages and a batch stage, as lab.diagnose would report them."""
    read = StageDiagnosis(
        "read", "map", "scales", 8, "QPS grew 7.6x from 1 to 8 threads at 6% CPU.",
        "Keep the thread runner; set concurrency=8.",
        points=tuple(point("read", c, 100.0 * c * 0.95, cpu=0.06) for c in (1, 2, 4, 8)),
        inputs=256, outputs=256)
    decode = StageDiagnosis(
        "decode", "map", "gil-bound", 1, "Threads stayed at 410 items/s while GIL wait reached 0.81.",
        "Run decode in processes (runner='process', concurrency=2) or release the GIL.",
        points=(*(point("decode", c, 410.0, gil=0.2 * c) for c in (1, 2, 4)),
                point("decode", 8, 0.0, status="timeout"),
                point("decode", 1, 400.0, executor="process", cpu=0.5),
                point("decode", 2, 790.0, executor="process", cpu=0.99)),
        inputs=256, outputs=256)
    broken = StageDiagnosis(
        "lookup", "map", None, None, "The stage raised on every input; it was not measured.",
        "Fix the function: see the error.", points=(
            Point("lookup", "thread", 1, NAN, NAN, NAN, NAN, NAN, NAN, 0, "error", 12),),
        inputs=256, outputs=0, error=TRACEBACK)
    batch = StageDiagnosis("batch(32)", "batch", None, None, "Batching is not swept.", "", inputs=256,
                           outputs=8)
    return Diagnosis(
        pipeline="Pipeline(range(256)).map(read).map(decode).map(lookup).batch(32)",
        stages={s.name: s for s in (read, decode, broken, batch)},
        settings={"concurrency": [1, 2, 4, 8], "num_items": 256, "window_s": 0.5, "processes": True,
                  "executors": ["thread", "process"], "note": None, "spread": NAN},
        machine={"cores": 2, "python": "3.11.7", "gil": True},
        created="2025-01-02T03:04:05", elapsed_s=42.5)


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_round_trip_is_faithful(tmp_path):
    diag = sample_diagnosis()
    path = diag.to_json(tmp_path / "deep" / "dir" / "diag.json")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("spdl_lab.diagnosis", 2)
    assert "NaN" not in path.read_text()  # NaN is written as null
    back = Diagnosis.from_json(path)
    for name in ("pipeline", "created", "elapsed_s", "machine"):
        assert getattr(back, name) == getattr(diag, name)
    assert back.settings == {**diag.settings, "spread": None}  # NaN in settings comes back as null
    assert list(back.stages) == list(diag.stages)
    for name, stage in diag.stages.items():
        other = back.stages[name]
        for f in fields(StageDiagnosis):
            if f.name != "points":
                assert getattr(other, f.name) == getattr(stage, f.name), (name, f.name)
        assert len(other.points) == len(stage.points)
        for p, q in zip(stage.points, other.points):
            for f in fields(Point):
                assert same(getattr(p, f.name), getattr(q, f.name)), (name, f.name)
    assert back.table.shape == diag.table.shape


def test_summary_names_every_stage_and_verdict():
    diag = sample_diagnosis()
    text = diag.summary()
    for name, stage in diag.stages.items():
        assert name in text
        if stage.verdict:
            assert stage.verdict in text
    assert "KeyError" in text  # the traceback's last line, not the whole traceback
    assert "410.0" in text and "790.0" in text  # peak thread and process QPS of decode
    assert all(len(line) <= 100 for line in text.splitlines()[2:])
    assert repr(diag) == text
    assert set(VERDICTS) >= {s.verdict for s in diag.stages.values() if s.verdict}


def good_doc() -> dict:
    return plain({"format": "spdl_lab.diagnosis", "version": 2, **sample_diagnosis()._saved_fields()})


def write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def refused(path: Path, *fragments: str) -> DiagnosisFormatError:
    with pytest.raises(DiagnosisFormatError) as info:
        Diagnosis.from_json(path)
    message = str(info.value)
    assert isinstance(info.value, SpdlLabError) and isinstance(info.value, ValueError)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def edited(**changes):
    """A doc with one field replaced: keys like 'stages.1.points.0.qps'."""
    def make():
        doc = good_doc()
        for key, value in changes.items():
            *parents, last = key.split(".")
            target = doc
            for part in parents:
                target = target[int(part)] if isinstance(target, list) else target[part]
            if value is DELETE:
                del target[last]
            else:
                target[last] = value
        return doc
    return make


DELETE = object()

HOSTILE = {
    "string for a number": (edited(**{"stages.1.points.0.qps": "fast"}), ["stages[1].points[0].qps", "number"]),
    "bool for an int": (edited(**{"stages.0.points.0.concurrency": True}), ["stages[0].points[0].concurrency", "integer"]),
    "float for an int": (edited(**{"stages.0.points.0.repeats": 3.0}), ["stages[0].points[0].repeats"]),
    "concurrency too big": (edited(**{"stages.0.points.1.concurrency": 4096}), ["stages[0].points[1].concurrency", "less than or equal to 1024"]),
    "concurrency zero": (edited(**{"stages.0.best_concurrency": 0}), ["stages[0].best_concurrency"]),
    "huge int": (edited(**{"stages.0.points.0.repeats": 10**400}), ["stages[0].points[0].repeats", "less than or equal to 1000000"]),
    "huge int as float": (edited(**{"stages.0.points.0.qps": 10**400}), ["stages[0].points[0].qps"]),
    "negative qps": (edited(**{"stages.0.points.0.qps": -1.0}), ["stages[0].points[0].qps", "greater than or equal to 0"]),
    "cpu over 1.5": (edited(**{"stages.0.points.0.cpu_util": 3.0}), ["stages[0].points[0].cpu_util", "less than or equal to 1.5"]),
    "unknown verdict": (edited(**{"stages.0.verdict": "fine"}), ["stages[0].verdict", "gil-bound"]),
    "unknown executor": (edited(**{"stages.1.points.4.executor": "gpu"}), ["stages[1].points[4].executor"]),
    "unknown status": (edited(**{"stages.1.points.0.status": "great"}), ["stages[1].points[0].status"]),
    "unknown kind": (edited(**{"stages.3.kind": "filter"}), ["stages[3].kind"]),
    "extra key": (edited(**{"stages.2.points.0.secret": 1}), ["stages[2].points[0].secret", "Unexpected keyword argument"]),
    "extra top key": (edited(__class__="os.system"), ["__class__", "Unexpected keyword argument"]),
    "missing key": (edited(**{"stages.0.points.2.qps": DELETE}), ["stages[0].points[2].qps", "Field required"]),
    "missing stages": (edited(stages=DELETE), ["stages", "Field required"]),
    "wrong format": (edited(format="pickle"), ["format", "spdl_lab.diagnosis"]),
    "newer version": (edited(version=3), ["version", "Upgrade spdl_lab"]),
    "bool version": (edited(version=True), ["version"]),
    "nested settings": (edited(**{"settings.concurrency": {"a": 1}}), ["settings.concurrency"]),
    "nested list in settings": (edited(**{"machine.cores": [[1]]}), ["machine.cores[0]"]),
    "points not a list": (edited(**{"stages.0.points": {"0": 1}}), ["stages[0].points", "valid tuple"]),
    "point of another stage": (edited(**{"stages.0.points.0.stage": "decode"}), ["stages[0].points[0].stage"]),
    "duplicate stage": (edited(**{"stages.1.name": "read"}), ["stages[1].name", "twice"]),
    "long name": (edited(**{"stages.0.name": "n" * 201}), ["stages[0].name", "at most 200 characters"]),
    "long evidence": (edited(**{"stages.0.evidence": "e" * 100_001}), ["stages[0].evidence", "100000"]),
    "lone surrogate": (edited(**{"stages.0.evidence": "\ud800"}), ["stages[0].evidence", "valid string"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_field_is_refused_by_name(tmp_path, case):
    make, fragments = HOSTILE[case]
    error = refused(write(tmp_path, make()), *fragments)
    assert error.field == fragments[0]


@pytest.mark.parametrize("text, fragment", [
    ("not json at all", "not valid JSON"),
    ('{"format": "spdl_lab.diagnosis", "version": 1, "elapsed_s": NaN}', "NaN is not JSON"),
    ('{"qps": 1e999}', "format"),
    ('{"a": 1, "a": 2}', "appears twice"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("1" * 5000, "not valid JSON"),  # past Python's int digit limit
    ("[1, 2]", "top level"),
    ('{"__class__": "subprocess.Popen", "args": ["rm", "-rf", "/"]}', "format"),
])
def test_malformed_file_is_refused(tmp_path, text, fragment):
    refused(write(tmp_path, text), fragment)


def test_infinite_number_is_refused(tmp_path):
    doc = json.dumps(good_doc()).replace('"elapsed_s": 42.5', '"elapsed_s": 1e999')
    refused(write(tmp_path, doc), "elapsed_s", "finite")


def test_pickle_and_binary_are_refused(tmp_path):
    path = tmp_path / "diag.json"
    path.write_bytes(pickle.dumps(sample_diagnosis()))
    refused(path, "not valid JSON")


def test_oversized_file_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(io.Diagnosis, "MAX_BYTES", 1000)
    refused(write(tmp_path, json.dumps(good_doc())), "larger than the limit of 1000")


def test_too_many_stages_and_points(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "MAX_STAGES", 3)
    refused(write(tmp_path, good_doc()), "stages:", "4 stages")
    monkeypatch.setattr(io, "MAX_STAGES", 1000)
    monkeypatch.setattr(io, "MAX_POINTS", 5)
    refused(write(tmp_path, good_doc()), "stages[1].points", "limit of 5")


def test_writing_refuses_what_reading_would(tmp_path):
    diag = sample_diagnosis()
    diag.settings["path"] = Path("/tmp")
    with pytest.raises(DiagnosisFormatError, match=r"cannot write .*settings\.path"):
        diag.to_json(tmp_path / "a.json")
    diag = sample_diagnosis()
    stage = diag.stages["read"]
    diag.stages["read"] = replace(stage, verdict="slow")
    with pytest.raises(DiagnosisFormatError, match=r"stages\[0\]\.verdict"):
        diag.to_json(tmp_path / "b.json")
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Diagnosis.from_json(tmp_path / "nope.json")


def test_a_version_1_file_is_still_read(tmp_path):
    doc = good_doc()
    doc["version"] = 1
    for stage in doc["stages"]:
        for key in ("status", "notes", "concurrency", "items_per_input"):  # new in version 2
            del stage[key]
    back = Diagnosis.from_json(write(tmp_path, doc))
    assert [s.name for s in back.stages.values()] == [s["name"] for s in doc["stages"]]
    for s in back.stages.values():
        assert s.notes == () and s.items_per_input == 1
        assert s.status in ("measured", "failed", "not measured", "batch")
