"""Record files: a published run writes its frames and steps to an SQLite file (WAL mode) as it
goes, so a viewer reads it live and a killed script leaves it whole up to its last flush; pandas
reads it (``pd.read_sql("select * from frames", sqlite3.connect(path))``)."""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from itertools import repeat
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from .. import _forksafe
from .._json import dumps, loads
from .._telemetry.frames import FRAME_COLUMNS, FrameChunk, Ring
from .._telemetry.histogram import NUM_BUCKETS, bucket_of
from .._training.steps import StepRecord, StepSummary, Totals, summarize
from ..errors import FileFormatError, SpdlLabError
from .endpoint import pid_alive

# Ticks older than FULL_RATE_S keep the last value of each (series, stage) per THIN_EVERY_S.
FULL_RATE_S = 600.0
THIN_EVERY_S = 10.0
RECORD_ENV = "SPDL_LAB_RECORD"
THREAD_NAME = "spdl_lab:record"
#: Steps held for the next flush at most; more (a disk that fails for minutes) are dropped, counted.
MAX_BUFFERED_STEPS = 1_000_000
#: Steps kept one row each (table ``steps``); older ones are summed into one row per second,
#: with histograms (``step_seconds``), which ``read_step_summary`` reads as the live clock does.
STEPS_FULL_S = 3600.0
T = TypeVar("T")
Row = tuple[int, int, int, int, "int | None"]

# frames: long format (FRAME_COLUMNS), NaN not stored; meta: the run's facts (name, pid, started,
# runner, dropped_ticks, stats as JSON, the steps' facts, state: "running" until close).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS frames (time_s REAL, series TEXT, stage TEXT, value REAL);
CREATE INDEX IF NOT EXISTS frames_time_s ON frames (time_s);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS steps (idx INTEGER PRIMARY KEY, end_ns INTEGER, wait_ns INTEGER,
                                  step_ns INTEGER, device_ns INTEGER);
CREATE TABLE IF NOT EXISTS step_seconds (second INTEGER PRIMARY KEY, steps INTEGER, wait_ns INTEGER,
    step_ns INTEGER, last_end_ns INTEGER, device_steps INTEGER, device_ns INTEGER,
    device_loop_ns INTEGER, step_hist TEXT, wait_hist TEXT);
"""

_SET_META = "INSERT OR REPLACE INTO meta VALUES (?, ?)"

# Rows of [lo, hi) but the last of each (series, stage) per bucket (rows go in in time order).
_THIN = """
DELETE FROM frames WHERE time_s >= ? AND time_s < ? AND rowid NOT IN (
    SELECT max(rowid) FROM frames WHERE time_s >= ? AND time_s < ?
    GROUP BY series, stage, CAST(time_s / ? AS INTEGER))
"""


def append_ticks(ring: Ring, times: np.ndarray, columns: dict[tuple[str, str], np.ndarray],
                 shift: float = 0.0) -> None:
    """Append each tick of a chunk (``times`` and its ``columns``) to ``ring``, NaN left out."""
    for i, t in enumerate(times.tolist()):
        rows = [(series, stage, float(v[i])) for (series, stage), v in columns.items()]
        ring.append(t + shift, [row for row in rows if not math.isnan(row[2])])


class RecordWriter(contextlib.AbstractContextManager):
    """Writes frame chunks to a new SQLite record from its own thread, ``spdl_lab:record``. ``add``
    never waits on the disk: a ring of ``max_buffered_ticks`` (older ticks dropped, counted) is
    written every ``flush_every_s``; ``close`` raises a failed flush. ``resume=True`` goes on with
    the record of a run that ends and starts again (``Publisher``): its meta is kept, its state
    running again."""

    def __init__(self, path: str | os.PathLike, *, meta: dict[str, str], flush_every_s: float = 2.0,
                 max_buffered_ticks: int = 6000, resume: bool = False) -> None:
        self.path = Path(path)
        self.flush_every_s = flush_every_s
        self.dropped_ticks = 0
        self.error: BaseException | None = None
        self._buffer = Ring(max(2, max_buffered_ticks))
        self._written = 0  # the buffer's cursor: ticks before it are flushed or dropped
        self._steps: list[Row] = []
        self._facts: dict[str, str] = {}
        self.dropped_steps = 0
        self._steps_lock = _forksafe.Lock()
        self._db_lock = _forksafe.Lock()
        self._thinned_until = -math.inf
        self._newest_s = -math.inf
        self.closed = False
        self._stop = threading.Event()
        self._db = self._open(meta, resume)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _open(self, meta: dict[str, str], resume: bool) -> sqlite3.Connection:
        if self.path.exists() and not resume:
            raise SpdlLabError(f"record file {self.path} already exists; choose another path "
                               f"(--record or ${RECORD_ENV}) or delete the old record")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode loses nothing when the process dies, only on power loss.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA journal_size_limit=8388608")  # the WAL shrinks after each checkpoint
            db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise SpdlLabError(f"cannot create record file {self.path}: {e}; pick a writable path "
                               f"(--record or ${RECORD_ENV})") from e
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        facts = {"pid": os.getpid(), "started": started, **meta, "state": "running", "dropped_ticks": 0}
        if resume:
            kept = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('started', 'dropped_ticks', "
                                   "'dropped_steps')"))
            self.dropped_ticks, self.dropped_steps = (int(kept.pop(k, 0)) for k in ("dropped_ticks", "dropped_steps"))
            facts = {**facts, **kept, "dropped_ticks": self.dropped_ticks}
        with db:
            db.executemany(_SET_META, [(str(k), str(v)) for k, v in facts.items()])
        return db

    def add(self, chunk: FrameChunk) -> None:
        if self.closed:
            raise SpdlLabError(f"the record writer for {self.path} is closed; add frames before close()")
        append_ticks(self._buffer, chunk.times, chunk.columns)

    def add_steps(self, rows: list[Row], facts: dict[str, str]) -> None:
        """Queue training steps (``step_rows``) and meta facts (stats...) for the next flush."""
        with self._steps_lock:
            self._steps += rows
            over = len(self._steps) - MAX_BUFFERED_STEPS
            if over > 0:
                del self._steps[:over]
                self.dropped_steps += over
            self._facts.update(facts)

    def flush(self) -> None:
        """Write what is buffered now, in one transaction, and thin what is old."""
        with self._db_lock:  # two flushes write their ticks in time order
            if self._db is None:
                return
            cursor, times, columns = self._buffer.since(self._written)
            self.dropped_ticks += cursor - self._written - len(times)
            self._written = cursor
            with self._db:
                self._db.execute("BEGIN")
                for (series, stage), values in columns.items():
                    keep = ~np.isnan(values)
                    self._db.executemany("INSERT INTO frames VALUES (?, ?, ?, ?)", zip(
                        times[keep].tolist(), repeat(series), repeat(stage), values[keep].tolist()))
                if len(times):
                    self._newest_s = max(self._newest_s, float(times.max()))
                self._thin()
                with self._steps_lock:
                    steps, self._steps = self._steps, []
                    facts, self._facts = self._facts, {}
                self._db.executemany("INSERT OR IGNORE INTO steps VALUES (?, ?, ?, ?, ?)", steps)
                thin_steps(self._db)
                self._db.executemany(_SET_META, [*facts.items(), ("dropped_ticks", str(self.dropped_ticks)),
                                                 ("dropped_steps", str(self.dropped_steps))])

    def _thin(self) -> None:
        # Whole buckets only, so a bucket is thinned once, when it is complete (NaN before a tick).
        lo = self._thinned_until
        until = (self._newest_s - FULL_RATE_S) // THIN_EVERY_S * THIN_EVERY_S
        if until > lo:
            self._db.execute(_THIN, (lo, until, lo, until, THIN_EVERY_S))
            self._thinned_until = until

    def _run(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            try:
                self.flush()
            except Exception as e:  # training goes on; the buffer stays bounded; close() reports it
                self.error = e

    def close(self, state: str = "finished") -> None:
        """Flush, set meta ``state`` (how the run ended: "finished", "failed" by an uncaught
        exception, "stopped" by a signal) and close the file; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._thread.join()
        try:
            self.flush()
            with self._db_lock, self._db:
                self._db.execute(_SET_META, ("state", state))
        except sqlite3.Error as e:
            raise SpdlLabError(f"could not finish record {self.path}: {e}") from e
        finally:
            with self._db_lock:
                db, self._db = self._db, None
            with contextlib.suppress(sqlite3.Error):  # one plain file, unless a viewer reads it
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                db.execute("PRAGMA journal_mode=DELETE")
            db.close()
        if self.error is not None:
            raise SpdlLabError(f"some flushes of record {self.path} failed ({self.error}); "
                               "the record may miss ticks: check the disk") from self.error

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("failed" if exc_type is not None else "finished")


def read_record(path: str | os.PathLike, after: float = -math.inf) -> pd.DataFrame:
    """The record's frames (``FRAME_COLUMNS``) later than ``after``, sorted by time; the file is
    opened read-only."""
    query = "SELECT time_s, series, stage, value FROM frames WHERE time_s > ? ORDER BY time_s, rowid"
    return with_record(path, lambda db: pd.read_sql(query, db, params=(after,)))[FRAME_COLUMNS]


def append_rows(ring: Ring, frames: pd.DataFrame) -> None:
    """Append a record's ``frames`` (long, sorted by time) to ``ring``, a tick per time."""
    for t, rows in frames.groupby("time_s", sort=True):
        ring.append(float(t), list(zip(rows["series"], rows["stage"], rows["value"].astype(float))))


def record_meta(path: str | os.PathLike) -> dict[str, str]:
    """The record's meta table; ``state`` says ``"killed"`` for "running" if its pid is gone."""
    meta = with_record(path, lambda db: dict(db.execute("SELECT key, value FROM meta").fetchall()))
    if meta.get("state") == "running" and not pid_alive(meta.get("pid", "")):
        meta["state"] = "killed"
    return meta


def mark_ended(path: str | os.PathLike, state: str) -> None:
    """Set how the run of a record closed before now ended: its script ends (``Publisher``)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute(_SET_META, ("state", state))
    finally:
        db.close()


def recorded_steps(path: str | os.PathLike | None) -> int:
    """Steps in a run's record so far (written every ``flush_every_s``); 0 without one."""
    with contextlib.suppress(SpdlLabError, sqlite3.Error):
        return with_record(path, lambda db: db.execute("SELECT coalesce(max(idx) + 1, 0) FROM steps")
                           .fetchone()[0])
    return 0


def with_record(path: str | os.PathLike, read: Callable[[sqlite3.Connection], T]) -> T:
    """``read`` on the record at ``path``, opened read-only; SpdlLabError if it is none."""
    path = Path(path)
    if not path.is_file():
        raise SpdlLabError(f"record {path} does not exist; pass the path of a .sqlite record "
                           "(see the runs in ./spdl_lab_runs)")
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return read(db)
    except (sqlite3.Error, pd.errors.DatabaseError) as e:
        raise FileFormatError(f"{path} is not a readable spdl_lab record ({e}); pass a file written "
                              "by RecordWriter", source=str(path), field="") from e


# -- training steps --------------------------------------------------------------------------------
# Their meta keys: steps_first_ns (the first batch asked, ns from the clock's origin, as end_ns),
# steps_origin_s (perf_counter() at that origin, for other processes' times), steps_offset_s (the
# origin in the frames' time), steps_device, step_copies, step_copy_ns.
_NS = 1_000_000_000
_STEP = "end_ns, wait_ns, step_ns, device_ns"
_SECOND = ("steps, wait_ns, step_ns, last_end_ns, device_steps, device_ns, device_loop_ns, "
           "step_hist, wait_hist")
_NO_SECOND = (0, 0, 0, 0, 0, 0, 0, "{}", "{}")


def step_rows(records: Iterable[StepRecord]) -> list[Row]:
    """(idx, end_ns, wait_ns, step_ns, device_ns or None) of each step; the clock's own integers."""
    return [(r.index, round(r.end_s * 1e9), round(r.data_wait_s * 1e9), round(r.step_s * 1e9),
             None if math.isnan(r.device_s) else round(r.device_s * 1e9)) for r in records]


def _sums(second: tuple) -> list[Any]:
    """A ``step_seconds`` row as running sums, its histograms as Counters."""
    return [*second[:7], *(Counter({int(b): n for b, n in loads(h).items()}) for h in second[7:])]


def _add_step(sums: list[Any], end_ns: int, wait_ns: int, step_ns: int,
              device_ns: int | None) -> None:
    on_device = device_ns is not None
    sums[:7] = [sums[0] + 1, sums[1] + wait_ns, sums[2] + step_ns, max(sums[3], end_ns),
                sums[4] + on_device, sums[5] + (device_ns or 0),
                sums[6] + on_device * (wait_ns + step_ns)]
    sums[7][bucket_of(step_ns)] += 1
    sums[8][bucket_of(wait_ns)] += 1


def thin_steps(db: sqlite3.Connection) -> None:
    """Fold the steps that ended over ``STEPS_FULL_S`` before the newest into whole seconds; a
    second thinned in two flushes adds up."""
    newest = db.execute("SELECT max(end_ns) FROM steps").fetchone()[0]
    if newest is None:
        return
    cutoff_ns = math.floor(newest / 1e9 - STEPS_FULL_S) * _NS
    seconds: dict[int, list[Any]] = {}
    for row in db.execute(f"SELECT {_STEP} FROM steps WHERE end_ns < ?", (cutoff_ns,)).fetchall():
        if (second := row[0] // _NS) not in seconds:
            before = db.execute(f"SELECT {_SECOND} FROM step_seconds WHERE second = ?", (second,))
            seconds[second] = _sums(before.fetchone() or _NO_SECOND)
        _add_step(seconds[second], *row)
    db.executemany("INSERT OR REPLACE INTO step_seconds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   [(n, *s[:7], dumps(s[7]), dumps(s[8])) for n, s in seconds.items()])
    db.execute("DELETE FROM steps WHERE end_ns < ?", (cutoff_ns,))


def read_step_summary(db: sqlite3.Connection, meta: dict[str, str]) -> StepSummary | None:
    """The figures over every recorded step, as the live clock computes them; None without steps."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"steps", "step_seconds"} <= tables:
        return None
    full = db.execute(f"SELECT {_STEP} FROM steps ORDER BY idx").fetchall()
    thinned = db.execute(f"SELECT {_SECOND} FROM step_seconds").fetchall()
    if not full and not thinned:
        return None
    sums = _sums(_NO_SECOND)
    for row in full:
        _add_step(sums, *row)
    for row in thinned:  # a second's sums add up, but for its last end
        sums = [max(a, b) if i == 3 else a + b for i, (a, b) in enumerate(zip(sums, _sums(row)))]
    totals = Totals(*sums[:7], copies=int(meta.get("step_copies", 0) or 0),
                    copy_ns=int(meta.get("step_copy_ns", 0) or 0))
    exact = [None if thinned else np.array([r[i] for r in full], dtype=np.int64) / 1e9
             for i in (2, 1)]
    return summarize(totals, int(meta.get("steps_first_ns", 0) or 0), meta.get("steps_device", ""),
                     *([sums[i][b] for b in range(NUM_BUCKETS)] for i in (7, 8)), *exact)
