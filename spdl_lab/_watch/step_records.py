"""A published run's training steps in its record: every step in full for the last
``STEPS_FULL_S`` (table ``steps``), older ones thinned into per-second sums and histograms (table
``step_seconds``). A record's figures come from the same ``summarize`` as the live clock's, so
``lab.open(record)`` reads what the run read at its end.

Meta keys the publisher keeps for them: ``steps_first_ns`` (the first batch asked, ns from the
clock's origin, as ``end_ns``), ``steps_origin_s`` (``time.perf_counter()`` at that origin: the
machine's monotonic clock, so another process can hold its own times against the steps),
``steps_offset_s`` (the origin in the frames' time), ``steps_device``, ``step_copies``,
``step_copy_ns``."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._json import loads
from .._telemetry.histogram import bucket_of, new_counts
from .._training.steps import StepRecord, StepSummary, Totals, summarize

__all__ = ["SCHEMA", "STEPS_FULL_S", "read_step_summary", "step_rows", "thin_steps", "write_steps"]

#: Steps kept one row each; older ones become one row per second (a day at 60 steps/s: about
#: 13 MB of full steps plus 83,000 rows of seconds, instead of 5 million rows).
STEPS_FULL_S = 3600.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (idx INTEGER PRIMARY KEY, end_ns INTEGER, wait_ns INTEGER,
                                  step_ns INTEGER, device_ns INTEGER);
CREATE TABLE IF NOT EXISTS step_seconds (second INTEGER PRIMARY KEY, steps INTEGER, wait_ns INTEGER,
    step_ns INTEGER, last_end_ns INTEGER, device_steps INTEGER, device_ns INTEGER,
    device_loop_ns INTEGER, step_hist TEXT, wait_hist TEXT);
"""

Row = tuple[int, int, int, int, "int | None"]


def step_rows(records: Iterable[StepRecord]) -> list[Row]:
    """(idx, end_ns, wait_ns, step_ns, device_ns or None) of each step; the clock's own integers."""
    return [(r.index, round(r.end_s * 1e9), round(r.data_wait_s * 1e9), round(r.step_s * 1e9),
             None if math.isnan(r.device_s) else round(r.device_s * 1e9)) for r in records]


def write_steps(db: sqlite3.Connection, rows: list[Row]) -> None:
    db.executemany("INSERT OR IGNORE INTO steps VALUES (?, ?, ?, ?, ?)", rows)


def thin_steps(db: sqlite3.Connection) -> None:
    """Fold the steps that ended over ``STEPS_FULL_S`` before the newest into whole seconds."""
    newest = db.execute("SELECT max(end_ns) FROM steps").fetchone()[0]
    if newest is None:
        return
    cutoff_s = math.floor(newest / 1e9 - STEPS_FULL_S)
    old = db.execute("SELECT end_ns, wait_ns, step_ns, device_ns FROM steps WHERE end_ns < ?",
                     (cutoff_s * 1_000_000_000,)).fetchall()
    if not old:
        return
    seconds: dict[int, list[Any]] = {}
    for end_ns, wait_ns, step_ns, device_ns in old:
        s = seconds.setdefault(end_ns // 1_000_000_000, [0, 0, 0, 0, 0, 0, 0, {}, {}])
        s[0] += 1
        s[1] += wait_ns
        s[2] += step_ns
        s[3] = max(s[3], end_ns)
        if device_ns is not None:
            s[4] += 1
            s[5] += device_ns
            s[6] += wait_ns + step_ns
        for hist, ns in ((s[7], step_ns), (s[8], wait_ns)):
            hist[bucket_of(ns)] = hist.get(bucket_of(ns), 0) + 1
    for second, s in seconds.items():
        before = db.execute("SELECT steps, wait_ns, step_ns, last_end_ns, device_steps, device_ns, "
                            "device_loop_ns, step_hist, wait_hist FROM step_seconds WHERE second = ?",
                            (second,)).fetchone()
        if before is not None:  # a second thinned in two flushes: add up
            s = [*(a + b for a, b in zip(s[:3], before[:3])), max(s[3], before[3]),
                 *(a + b for a, b in zip(s[4:7], before[4:7])),
                 _merged(s[7], before[7]), _merged(s[8], before[8])]
        db.execute("INSERT OR REPLACE INTO step_seconds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (second, *s[:7], json.dumps(s[7]), json.dumps(s[8])))
    db.execute("DELETE FROM steps WHERE end_ns < ?", (cutoff_s * 1_000_000_000,))


def _merged(mine: dict[int, int], stored: str) -> dict[int, int]:
    out = dict(mine)
    for bucket, count in loads(stored).items():
        out[int(bucket)] = out.get(int(bucket), 0) + count
    return out


def read_step_summary(db: sqlite3.Connection, meta: dict[str, str]) -> StepSummary | None:
    """The figures over every recorded step, as the live clock computes them; None without steps
    (or in a record from before steps were kept)."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"steps", "step_seconds"} <= tables:
        return None
    full = np.array(db.execute("SELECT end_ns, wait_ns, step_ns, device_ns FROM steps ORDER BY idx")
                    .fetchall(), dtype=object).reshape(-1, 4)
    thinned = db.execute("SELECT steps, wait_ns, step_ns, last_end_ns, device_steps, device_ns, "
                         "device_loop_ns, step_hist, wait_hist FROM step_seconds").fetchall()
    if not len(full) and not thinned:
        return None
    ends, waits, steps = (full[:, i].astype(np.int64) for i in range(3))
    has_device = np.array([d is not None for d in full[:, 3]], dtype=bool)
    device = full[has_device, 3].astype(np.int64)
    step_hist, wait_hist = new_counts(), new_counts()
    for ns in steps.tolist():
        step_hist[bucket_of(ns)] += 1
    for ns in waits.tolist():
        wait_hist[bucket_of(ns)] += 1
    sums = [sum(row[i] for row in thinned) for i in (0, 1, 2, 4, 5, 6)]
    for row in thinned:
        for hist, stored in ((step_hist, row[7]), (wait_hist, row[8])):
            for bucket, count in loads(stored).items():
                hist[int(bucket)] += count
    last_end = max(([int(ends.max())] if len(ends) else []) + [row[3] for row in thinned])
    totals = Totals(steps=len(steps) + sums[0], wait_ns=int(waits.sum()) + sums[1],
                    step_ns=int(steps.sum()) + sums[2], last_end_ns=last_end,
                    device_steps=len(device) + sums[3], device_ns=int(device.sum()) + sums[4],
                    device_loop_ns=int((waits[has_device] + steps[has_device]).sum()) + sums[5],
                    copies=int(meta.get("step_copies", 0) or 0), copy_ns=int(meta.get("step_copy_ns", 0) or 0))
    exact = not thinned
    return summarize(totals, int(meta.get("steps_first_ns", 0) or 0), meta.get("steps_device", ""),
                     step_hist, wait_hist, steps / 1e9 if exact else None, waits / 1e9 if exact else None)
