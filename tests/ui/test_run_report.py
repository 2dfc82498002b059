"""A run's record as one HTML page (spdl-lab report RECORD): what it shows, and that a record
is data: names escaped, numbers only, nothing fetched."""

from __future__ import annotations

import os
import re
import sqlite3

import numpy as np
import pytest

from spdl_lab._telemetry.frames import FrameChunk
from spdl_lab._ui.run_report import read_run, run_summary, write_run_report
from spdl_lab._watch.records import RecordWriter
from spdl_lab.cli import main
from spdl_lab.errors import FileFormatError

pytestmark = pytest.mark.usefixtures("no_thread_leak")

HOSTILE = "<script>alert(1)</script>"


def make_record(path, *, name="resnet", state="finished", stages=("decode",), pid=None, runner="thread") -> None:
    ticks = np.arange(50)
    columns = {("batches_per_s", "step"): 10 + np.sin(ticks), ("data_wait_frac", "step"): np.full(50, 0.25),
               ("cpu_percent", "main"): np.full(50, 80.0), ("gil_wait_frac", "gil"): np.full(50, 0.1)}
    for stage in stages:
        columns[("qps", stage)] = np.full(50, 300.0)
        columns[("queue_depth", stage)] = np.full(50, 2.0)
    writer = RecordWriter(path, meta={"name": name, "pid": str(pid or os.getpid()), "started": "2026-11-25T07:00:00",
                                      "runner": runner, "state": "running"})
    writer.add(FrameChunk(50, ticks / 10, columns))
    # 49 steps of 60 ms, each after 20 ms of data wait, ending every 0.1 s from 0.1 s on
    writer.add_steps([(i, (i + 1) * 100_000_000, 20_000_000, 60_000_000, None) for i in range(49)],
                     {"steps_first_ns": "0", "steps_device": ""})
    writer.close(state="finished" if state == "killed" else state)
    if state == "killed":  # what a killed script leaves: its last flush, "running" in meta, no pid
        with sqlite3.connect(path) as db:
            db.execute("UPDATE meta SET value = 'running' WHERE key = 'state'")


def no_external_scripts(page: str) -> None:
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.IGNORECASE) and "<link" not in page
    assert "Bokeh" in page


def test_the_page_shows_the_run_its_summary_and_plots(tmp_path):
    record = tmp_path / "run.sqlite"
    make_record(record)
    page = write_run_report(record, tmp_path / "run.html").read_text(encoding="utf-8")
    no_external_scripts(page)
    assert "resnet" in page and "<td>finished</td>" in page and "the training loop, over every step" in page
    assert page.count("recorded") == 1  # the header once: its table, not again in the note
    assert "49 steps in 4.9 s, 10 steps/s; step p50 60 ms, data wait p50 20 ms, 25% of the loop" in page
    assert "<td>duration recorded</td>" in page and "<td>4.9 s</td>" in page  # ticks 0.0 .. 4.9 s
    assert "items/s: decode" in page and "queue depth" in page
    meta, frames = read_run(record)
    summary = run_summary(frames).set_index("what")
    assert "training batches/s" not in summary.index  # the loop's figures are per step, not ticks
    assert summary.loc["items/s: decode", "median"] == 300.0


def test_a_dataloader_run_without_stages_and_a_killed_run(tmp_path):
    record = tmp_path / "dl.sqlite"
    make_record(record, stages=(), state="killed", pid=2**22 + 12345)  # a pid that is not running
    page = write_run_report(record, tmp_path / "dl.html").read_text(encoding="utf-8")
    assert "<td>killed</td>" in page and "up to its" in page
    assert "items/s:" not in page and "queue depth" not in page and "49 steps in 4.9 s" in page


def test_a_record_without_frames_still_makes_a_page(tmp_path):
    record = tmp_path / "empty.sqlite"
    RecordWriter(record, meta={"name": "fresh", "runner": "thread"}).close()
    page = write_run_report(record, tmp_path / "empty.html").read_text(encoding="utf-8")
    assert "fresh" in page and "the record holds no frames yet" in page


def test_a_record_with_the_wrong_tables_is_a_file_format_error(tmp_path):
    record = tmp_path / "other.sqlite"
    with sqlite3.connect(record) as db:
        db.execute("CREATE TABLE meta (key TEXT, value TEXT)")
        db.execute("CREATE TABLE frames (t REAL, what TEXT)")
    with pytest.raises(FileFormatError, match="other.sqlite"):
        write_run_report(record, tmp_path / "other.html")
    assert not (tmp_path / "other.html").exists()


def test_hostile_names_are_escaped_and_non_numbers_dropped(tmp_path):
    record = tmp_path / "evil.sqlite"
    make_record(record, name=HOSTILE, stages=(HOSTILE,), runner=HOSTILE)
    with sqlite3.connect(record) as db:
        db.execute("INSERT INTO frames VALUES (1.0, 'qps', 'x', 'not a number')")
    page = write_run_report(record, tmp_path / "evil.html").read_text(encoding="utf-8")
    assert HOSTILE not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    _, frames = read_run(record)
    assert frames["value"].dtype == float and not (frames["stage"] == "x").any()


def test_spdl_lab_report_takes_a_record(tmp_path, capsys):
    record, out = tmp_path / "run.sqlite", tmp_path / "out" / "page.html"
    make_record(record)
    assert main(["report", str(record), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resnet (pid" in printed and "finished, 4.9 s recorded" in printed and out.is_file()
    assert "training: 49 steps in 4.9 s, 10 steps/s; step p50 60 ms" in printed
    assert f"report: {out.resolve()}" in printed
    assert main(["report", str(record)]) == 0 and record.with_suffix(".html").is_file()


def test_spdl_lab_report_takes_a_killed_dataloader_record(tmp_path, capsys):
    record = tmp_path / "dl.db"
    make_record(record, stages=(), state="killed", pid=2**22 + 12345, runner="torch DataLoader")
    assert main(["report", str(record)]) == 0
    assert "killed" in capsys.readouterr().out and "killed" in record.with_suffix(".html").read_text()


@pytest.mark.parametrize("name, content, says", [
    ("bad.sqlite", b"SQLite format 3\x00" + b"\x00" * 100, "not a readable spdl_lab record"),
    ("bad.sqlite", b"not json, not sqlite", "not a readable spdl_lab record"),
    ("bad.db", b"", "not a readable spdl_lab record"),
    ("bad.txt", b"not json, not sqlite", "a run's record (.sqlite"),
])
def test_a_broken_file_is_a_usage_error_with_one_line(tmp_path, capsys, name, content, says):
    bad = tmp_path / name
    bad.write_bytes(content)
    assert main(["report", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and says in err[0]
    assert not (tmp_path / "x.html").exists()


def test_lab_open_writes_the_same_page(tmp_path):
    import spdl_lab as lab

    record = tmp_path / "run.sqlite"
    make_record(record)
    run = lab.open(record)
    assert "resnet" in run.to_html(tmp_path / "r.html").read_text(encoding="utf-8")
    run.close()
