"""Comparison to and from JSON: an exact round trip, and hostile files refused by their JSON path."""

from __future__ import annotations

import json
import math
import time
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

import spdl_lab as lab
from spdl_lab._experiments import comparison as io
from spdl_lab._experiments.comparison import (
    ROUND_COLUMNS,
    TABLE_COLUMNS,
    ComparisonFormatError,
    Row,
)
from spdl_lab._json import plain
from spdl_lab._runners import RUNNERS
from spdl_lab._telemetry.frames import FRAME_COLUMNS
from spdl_lab.errors import FileFormatError, SpdlLabError


def slow_items(x):
    time.sleep(0.002)
    return x


@pytest.fixture(scope="module")
def measured() -> lab.Comparison:
    """A real comparison: a tiny pipeline under thread and cache, a few steps."""
    p = lab.Pipeline(range(10**6)).map(slow_items, concurrency=2, name="slow").batch(2)
    return lab.compare(p, step=lambda b: time.sleep(0.002), runners=("thread", "cache"),
                       steps=12, warmup=2, repeats=3, progress=False)


def same_comparison(a: lab.Comparison, b: lab.Comparison) -> None:
    assert_frame_equal(a.table, b.table)
    assert list(a.frames) == list(b.frames)
    for runner in a.frames:
        assert_frame_equal(a.frames[runner], b.frames[runner])
    assert (a.steps, a.warmup, a.repeats, a.warnings) == (b.steps, b.warmup, b.repeats, b.warnings)
    assert_frame_equal(a.rounds, b.rounds, check_dtype=False)


def test_round_trip_of_a_real_comparison_is_exact(tmp_path, measured):
    path = measured.to_json(tmp_path / "deep" / "dir" / "cmp.json")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    text = path.read_text(encoding="utf-8")
    doc = json.loads(text)
    assert (doc["format"], doc["version"]) == ("spdl_lab.comparison", 2)
    assert len(doc["rounds"]) == 2 * 3 and doc["repeats"] == 3
    assert "NaN" not in text and "Infinity" not in text
    assert [row["runner"] for row in doc["table"]] == ["thread", "cache"]
    back = lab.Comparison.from_json(path)
    same_comparison(back, measured)
    assert len(back.frames["thread"]) > 0
    assert back.ratios("cache")["thread"] == pytest.approx(measured.ratios("cache")["thread"])
    assert back.to_json(tmp_path / "again.json").read_text(encoding="utf-8") == text


def sample() -> lab.Comparison:
    """Two runners by hand: NaN cells, a series missing from some ticks, an empty frame."""
    table = pd.DataFrame(
        [[2.4, 2.3, 2.5, 0.57, 0.55, 0.6, 80.0, 95.5, 0.4, 0.55, 180.0, 12.0, 0.1, 0.02, 0.3, 0.05, 50, 20.8],
         [4.2, 4.1, 4.3, 1.0, 1.0, 1.0, 79.0, 81.0, 0.01, math.nan, 101.0, 8.0, math.nan, math.nan, 0.0, 0.0,
          50, 11.9]],
        index=pd.Index(["process", "cache"], name="runner"), columns=TABLE_COLUMNS)
    frame = pd.DataFrame([[0.1, "qps", "decode", 10.0], [0.1, "step_ms", "step", 81.0],
                          [0.2, "qps", "decode", 12.5], [0.3, "qps", "decode", 0.0],
                          [0.3, "queue_depth", "source→decode", 3.0]], columns=FRAME_COLUMNS)
    empty = {c: pd.Series(dtype=t) for c, t in zip(FRAME_COLUMNS, ["float64", "object", "object", "float64"])}
    rounds = pd.DataFrame([["process", 0, 1.5, 2.4], ["cache", 0, 9.0, 4.2]], columns=ROUND_COLUMNS)
    return lab.Comparison(table=table, frames={"process": frame, "cache": pd.DataFrame(empty)},
                          steps=50, warmup=5, repeats=1, rounds=rounds,
                          warnings=["Only 1 round(s) per runner: the spread cannot be told from so few."])


def test_round_trip_keeps_nan_gaps_and_empty_frames(tmp_path):
    cmp = sample()
    back = lab.Comparison.from_json(cmp.to_json(tmp_path / "c.json"))
    same_comparison(back, cmp)
    assert math.isnan(back.table.loc["cache", "device_util"])
    assert back.table["steps"].dtype == np.int64


def good_doc() -> dict:
    return plain({"format": "spdl_lab.comparison", "version": 2, **sample()._saved_fields()})


def write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


def refused(path: Path, *fragments: str) -> ComparisonFormatError:
    with pytest.raises(ComparisonFormatError) as info:
        lab.Comparison.from_json(path)
    message = str(info.value)
    assert isinstance(info.value, FileFormatError) and isinstance(info.value, SpdlLabError)
    assert isinstance(info.value, ValueError)
    assert str(path) in message
    assert "Comparison.to_json" in message or "Upgrade spdl_lab" in message  # what to do
    for fragment in fragments:
        assert fragment in message, message
    return info.value


DELETE = object()


def edited(**changes):
    """A doc with fields replaced: keys like 'frames.process.series.0.values.1' (a / for a dotted key)."""
    def make():
        doc = good_doc()
        for key, value in changes.items():
            *parents, last = key.split(".")
            target = doc
            for part in parents:
                target = target[int(part)] if isinstance(target, list) else target[part]
            last = int(last) if isinstance(target, list) else last
            if value is DELETE:
                del target[last]
            else:
                target[last] = value
        return doc
    return make


SERIES = "frames.process.series.0"
HOSTILE = {
    "string for a number": (edited(**{"table.0.batches_per_s": "fast"}), ["table[0].batches_per_s", "number"]),
    "negative rate": (edited(**{"table.1.batches_per_s": -1.0}), ["table[1].batches_per_s", "greater than or equal to 0"]),
    "share over 1.5": (edited(**{"table.0.data_wait_frac": 7.0}), ["table[0].data_wait_frac", "less than or equal to 1.5"]),
    "bool for an int": (edited(steps=True), ["steps", "integer"]),
    "float for an int": (edited(**{"table.0.steps": 50.0}), ["table[0].steps", "integer"]),
    "huge int": (edited(**{"table.0.steps": 10**400}), ["table[0].steps", "less than or equal to 1000000000000000"]),
    "huge int as a number": (edited(**{"table.0.cpu_percent": 10**400}), ["table[0].cpu_percent"]),
    "unknown runner": (edited(**{"table.0.runner": "gpu"}), ["table[0].runner", "'thread'"]),
    "runner twice": (edited(**{"table.1.runner": "process"}), ["table[1].runner", "twice"]),
    "no rows": (edited(table=[]), ["table", "at least one row"]),
    "table not an array": (edited(table={"thread": {}}), ["table", "valid list"]),
    "extra top key": (edited(__reduce__=["os.system", "id"]), ["__reduce__", "Unexpected keyword argument"]),
    "extra row key": (edited(**{"table.0.speedup": 1.0}), ["table[0].speedup", "Unexpected keyword argument"]),
    "extra frames key": (edited(**{"frames.process.dtype": "object"}), ["frames.process.dtype", "Unexpected keyword argument"]),
    "extra series key": (edited(**{f"{SERIES}.py/object": "x"}), ["frames.process.series[0]['py/object']"]),
    "missing key": (edited(**{"table.1.elapsed_s": DELETE}), ["table[1].elapsed_s", "Field required"]),
    "missing frames": (edited(frames=DELETE), ["frames", "Field required"]),
    "wrong format": (edited(format="spdl_lab.diagnosis"), ["format", "'spdl_lab.comparison'"]),
    "newer version": (edited(version=3), ["version", "Upgrade spdl_lab"]),
    "round of an unknown runner": (edited(**{"rounds.0.runner": "thread"}), ["rounds[0].runner", "no row"]),
    "a warning that is not text": (edited(**{"warnings.0": 7}), ["warnings[0]"]),
    "frames not an object": (edited(frames=[1, 2]), ["frames", "valid dictionary"]),
    "frames of a runner not in the table": (edited(**{"frames.thread": {"time_s": [], "series": []}}),
                                            ["frames.thread", "no row for this runner"]),
    "tick times not increasing": (edited(**{"frames.process.time_s.2": 0.1}),
                                  ["frames.process.time_s[2]", "strictly increasing"]),
    "null tick time": (edited(**{"frames.process.time_s.0": None}), ["frames.process.time_s[0]", "valid number"]),
    "negative tick time": (edited(**{"frames.process.time_s.0": -1.0}), ["frames.process.time_s[0]", "greater than or equal to 0"]),
    "value of no number": (edited(**{f"{SERIES}.values.1": [1]}), ["frames.process.series[0].values[1]"]),
    "huge value": (edited(**{f"{SERIES}.values.1": 10**400}), ["frames.process.series[0].values[1]", "valid number"]),
    "values for other ticks": (edited(**{f"{SERIES}.values": [1.0]}),
                               ["frames.process.series[0].values", "1 values for 3 ticks"]),
    "series twice": (edited(**{"frames.process.series.1.series": "qps", "frames.process.series.1.stage": "decode"}),
                     ["frames.process.series[1]", "appears twice"]),
    "long label": (edited(**{f"{SERIES}.stage": "s" * 1001}), ["frames.process.series[0].stage", "at most 1000 characters"]),
    "lone surrogate": (edited(**{f"{SERIES}.series": "\ud800"}), ["frames.process.series[0].series", "valid string"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_field_is_refused_by_its_json_path(tmp_path, case):
    make, fragments = HOSTILE[case]
    error = refused(write(tmp_path, make()), *fragments)
    assert error.field == fragments[0]


@pytest.mark.parametrize("text, fragment", [
    ("not json at all", "not valid JSON"),
    ('{"format": "spdl_lab.comparison", "version": 1, "steps": NaN}', "NaN is not JSON"),
    ('{"a": 1, "a": 2}', "appears twice"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "spdl_lab.comparison", "version": 1, "frames": ' + "[" * 50_000 + "]" * 50_000 + "}",
     "nested too deeply"),
    ("[1, 2]", "top level"),
    ('{"py/object": "subprocess.Popen", "args": ["rm", "-rf", "/"]}', "format"),
])
def test_malformed_file_is_refused(tmp_path, text, fragment):
    refused(write(tmp_path, text), fragment)


def test_too_many_rows_ticks_series_and_values(tmp_path, monkeypatch):
    doc = good_doc()
    monkeypatch.setattr(io, "MAX_TICKS", 2)
    refused(write(tmp_path, doc), "frames.process.time_s", "3 ticks, more than the limit of 2")
    monkeypatch.setattr(io, "MAX_TICKS", 100)
    monkeypatch.setattr(io, "MAX_SERIES", 1)
    refused(write(tmp_path, doc), "frames.process.series", "more than the limit of 1")
    monkeypatch.setattr(io, "MAX_SERIES", 100)
    monkeypatch.setattr(io, "MAX_VALUES", 5)
    refused(write(tmp_path, doc), "frames.process.series", "limit of 5 values")
    too_many = dict(doc, table=doc["table"] * 3)  # one row a runner: the local four and ray
    refused(write(tmp_path, too_many), "table", f"at most {len(RUNNERS)} items")
    monkeypatch.setattr(io.Comparison, "MAX_BYTES", 100)
    refused(write(tmp_path, doc), "larger than the limit of 100")


def test_writing_refuses_what_reading_would(tmp_path):
    cmp = sample()
    cmp.table["speedup"] = 1.0
    with pytest.raises(ComparisonFormatError, match=r"cannot write comparison .*table\[0\]\.speedup.*Unexpected keyword"):
        cmp.to_json(tmp_path / "a.json")
    cmp = sample()
    cmp.table = cmp.table.rename(index={"process": "gpu"})
    cmp.frames = {"cache": cmp.frames["cache"]}
    with pytest.raises(ComparisonFormatError, match=r"table\[0\]\.runner"):
        cmp.to_json(tmp_path / "b.json")
    cmp = sample()
    frame = cmp.frames["process"]
    cmp.frames["process"] = pd.concat([frame, frame.iloc[:1]], ignore_index=True)
    with pytest.raises(ComparisonFormatError, match="two values in one tick"):
        cmp.to_json(tmp_path / "c.json")
    assert not list(tmp_path.iterdir())


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        lab.Comparison.from_json(tmp_path / "nope.json")


def test_a_version_1_file_is_still_read(tmp_path):
    doc = good_doc()
    doc["version"] = 1
    for key in ("repeats", "warnings", "rounds"):
        del doc[key]
    for row in doc["table"]:
        for col in [f.name for f in fields(Row) if f.default is not MISSING]:  # new in version 2
            del row[col]
    back = lab.Comparison.from_json(write(tmp_path, doc))
    assert back.repeats == 1 and back.warnings == [] and back.rounds.empty
    assert back.table["batches_per_s_lo"].isna().all()
    assert back.table.loc["process", "batches_per_s"] == 2.4
