"""A published run seen from a notebook: a ``RemoteSession`` has the read API of a Session (so a
``Dashboard`` reads it as a local one), fed by an ``EndpointClient`` or by the run's record."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pandas as pd

from .._json import loads
from .._telemetry.frames import FrameChunk, Ring, chunk_since, to_frame
from .._telemetry.sampler import DEFAULT_TICKS
from .._telemetry.snapshot import Snapshot, from_plain
from .._training.steps import StepSummary, summary_table
from .._views import view
from ..errors import SpdlLabError
from . import protocol as wire
from .endpoint import pid_alive
from .records import (
    append_rows,
    append_ticks,
    read_record,
    read_step_summary,
    record_meta,
    with_record,
)

#: How often a RemoteSession asks its run for new frames and its state.
POLL_S = 0.25
#: How long a DataLoader's ended run is watched for the next DataLoader of its line to go on with it.
RESUME_WAIT_S = 5.0


def record_state(record: str | None, default: str) -> str:
    with contextlib.suppress(SpdlLabError):
        return record_meta(record).get("state", default) if record else default
    return default


class EndpointClient(contextlib.AbstractContextManager):
    """A viewer's connection to a published run; ``request`` raises SpdlLabError on any failure."""

    def __init__(self, socket_path: str | os.PathLike, timeout: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise self._failure("connecting", exc) from None
        self._sock = sock
        return sock

    def request(self, op: str, **fields: Any) -> Any:
        """Send ``{"op": op, **fields}``; the reply, checked, as its model (``REQUESTS[op][1]``)."""
        with self._lock:
            sock = self._sock or self._connect()
            try:
                try:
                    wire.send_message(sock, {"op": op, **fields}, timeout=self.timeout,
                                      limit=wire.MAX_REQUEST_BYTES)
                except ConnectionError:  # closed after saying why (too many viewers): read that
                    message = wire.recv_message(sock, wire.MAX_REPLY_BYTES, min(self.timeout, 1.0))
                    self._drop()
                else:
                    message = wire.recv_message(sock, wire.MAX_REPLY_BYTES, self.timeout)
                reply = wire.read_reply(op, message)
            except (wire.ProtocolError, OSError) as exc:
                self._drop()  # after a timeout, a late reply would be read as the next one's
                raise self._failure(f"request {op!r}", exc) from None
        if isinstance(reply, wire.Failure):
            raise SpdlLabError(reply.error)
        return reply

    def _failure(self, doing: str, exc: Exception) -> SpdlLabError:
        run = f"the published run {self.socket_path}"
        if isinstance(exc, (wire.PeerClosed, ConnectionError, FileNotFoundError)):
            return SpdlLabError(f"{run} is gone (the script ended or was killed)")
        if isinstance(exc, wire.MessageTimeout):
            return SpdlLabError(f"{doing}: no reply from {run} within {self.timeout} s; it may be busy: "
                                "try again, or use a longer timeout")
        return SpdlLabError(f"{doing}: talking to {run} failed: {exc}")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteSession:
    """A published run seen from here: the read API of a Session, plus ``set_concurrency``. A
    poller copies its new ticks every ``POLL_S``, so they stay readable after it ends."""

    pipeline = None  # the Pipeline object lives in the script: no runner switch from here
    steps = None
    error = None

    def __init__(self, entry: dict[str, Any], ring: Ring | None = None, state: str = "running") -> None:
        """Watch the run a discovery ``entry`` names; given a ``ring`` (a record's), show it instead."""
        self.name, self.pid, self.record = entry["name"], entry["pid"], entry.get("record")
        self.rank: int | None = entry.get("rank")  # in a data-parallel job
        self.runner = entry.get("runner") or "?"
        self._client = EndpointClient(entry["socket"]) if ring is None else None
        self._ring = ring if ring is not None else Ring(DEFAULT_TICKS * 6)  # an hour of ticks at the default 10 Hz
        self._remote_cursor = 0
        self._state = state
        self._stats: dict[str, Any] = {}
        self.dropped_ticks: dict[str, int] = {}  # by the run rather than make training wait
        self._final: Snapshot | None = None  # a record's: its last stats, its steps' figures
        self._controls: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._client is not None:
            self._poll()  # the first frames before the call returns
            self._thread = threading.Thread(target=self._loop, name="spdl_lab:attach", daemon=True)
            self._thread.start()

    @classmethod
    def from_record(cls, path: str | os.PathLike) -> RemoteSession:
        """A run's record file, live or ended, read only (nothing to poll or steer):
        ``lab.open("spdl_lab_runs/resnet-4242.sqlite").frames()``."""
        meta = record_meta(path)
        ticks = read_record(path)
        ring = Ring(max(2, ticks["time_s"].nunique()))
        append_rows(ring, ticks)
        pid = int(meta["pid"]) if meta.get("pid", "").isdigit() else None
        rank = meta.get("rank", "")
        entry = {"name": meta.get("name", "?"), "pid": pid, "runner": meta.get("runner", "?"), "record": str(path),
                 "rank": int(rank) if rank.isdigit() else None}
        session = cls(entry, ring=ring, state=meta.get("state", "?"))
        session._final = _recorded_stats(path, meta)
        return session

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S) and (self._poll() or self._goes_on()):
            pass

    def _goes_on(self) -> bool:
        """A script that builds its DataLoader each epoch closes the run between them, and the next
        one goes on with it on the same endpoint (``publish_once``): True once it does. Meanwhile
        the run reads running: its script lives, and its loop is between two epochs."""
        if self._state != "running":
            return False
        until = time.monotonic() + RESUME_WAIT_S
        while time.monotonic() < until and not self._stop.wait(POLL_S) and self._may_go_on():
            if os.path.exists(self._client.socket_path) and self._poll():
                self._final = None  # the figures read from its record while it was closed
                return True
        state = record_state(self.record, "killed")
        self._state = "killed" if state == "running" else state
        return False

    def _poll(self) -> bool:
        """Fetch new frames, the state and the controls; False once the run's endpoint is gone."""
        try:
            chunk = self._client.request("frames_since", cursor=self._remote_cursor).chunk
            state = self._client.request("state").state
            controls = self._client.request("controls").controls
        except SpdlLabError:
            state = record_state(self.record, "killed")  # "running" only while its pid lives
            if state == "running":  # not answering, but alive: closing its run (a SIGTERM's flush
                return True  # on a busy machine), or too busy to answer in time: ask again
            self._catch_up()
            self._take(state)
            return False
        frame = chunk.frame_chunk()
        self._remote_cursor = frame.cursor
        new = frame.times > self._last_time()  # not those its record gave (a DataLoader's run going on)
        append_ticks(self._ring, frame.times[new], {key: v[new] for key, v in frame.columns.items()})
        self._take(state)
        self._controls = dict(controls)
        return True

    def _take(self, state: str) -> None:
        """The run's state, but a DataLoader's run ending while its script lives still runs: the
        script let go of its DataLoader, and the next of its line may go on with it (``_goes_on``)."""
        if state == "running" or not self._may_go_on():
            self._state = state

    def _may_go_on(self) -> bool:
        return self.runner == "DataLoader" and self.pid is not None and pid_alive(self.pid)

    def _catch_up(self) -> None:
        """The ticks its run made after the last poll, from its record (whole once the run is
        closed, up to its last flush if killed): the frames end where the run did."""
        if self.record:
            with contextlib.suppress(SpdlLabError):
                append_rows(self._ring, read_record(self.record, after=self._last_time()))

    def _last_time(self) -> float:
        times = self._ring.since(self._ring.count - 1)[1]
        return float(times[-1]) if len(times) else -math.inf

    @property
    def state(self) -> str:
        return self._state

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def elapsed_s(self) -> float:
        times, _ = self._ring.view()
        finite = times[~np.isnan(times)]
        return float(finite.max()) if finite.size else time.monotonic() - self._t0

    def frames(self) -> pd.DataFrame:
        """Every tick received so far, long format (FRAME_COLUMNS)."""
        return to_frame(self._ring)

    def frames_since(self, cursor: int = 0) -> FrameChunk:
        return chunk_since(self._ring, cursor)

    def recent(self, seconds: float) -> FrameChunk:
        """The ticks of the run's latest ``seconds`` (and the one before them), wide."""
        return FrameChunk(*self._ring.latest(seconds))

    def stats(self) -> Snapshot:
        """The run's figures as ``Session.stats()`` gives them, the step's by its own clock."""
        if self._final is None and self._client is not None and not self._ask_stats() and self.record:
            with contextlib.suppress(SpdlLabError):  # ended (or between the DataLoaders of its
                meta = record_meta(self.record)  # epochs): what its record says, as lab.open
                if meta.get("state") != "running":
                    self._final = _recorded_stats(self.record, meta)
        if self._final is not None:
            return self._final
        stats = dict(self._stats)
        self.dropped_ticks = dict(stats.get("dropped_ticks") or {})
        step = stats.get("step")
        return Snapshot.from_dict({"runner": self.runner, **stats, "running": self.running},
                                  step=from_plain(StepSummary, step) if step else None)

    def _ask_stats(self) -> bool:
        """Whether the run is running and answered for its figures now."""
        if not self.running:
            return False
        try:
            self._stats = self._client.request("stats").stats
        except SpdlLabError:
            return False
        return True

    def summary(self) -> pd.DataFrame:
        """One row per stage and one for the training step, as ``Session.summary``."""
        return summary_table(self.stats())

    @property
    def stage_names(self) -> list[str]:
        """The run's stages in order, the source first (what the dashboard plots)."""
        return [str(name) for name in self.stats().table().index]

    def controls(self) -> dict[str, int]:
        return dict(self._controls)

    def set_concurrency(self, stage: str, n: int) -> None:
        """Sent to the script, which applies it where its runner can change live."""
        if not self.running or self._client is None:
            raise SpdlLabError(f"the published run {self.name!r} is {self._state}: nothing to change")
        self._client.request("set_concurrency", stage=stage, n=n)
        self._controls[stage] = n

    def dashboard(self, **options: Any) -> Any:
        return view("dashboard")(self, **options)

    def to_html(self, path: str | os.PathLike) -> Any:
        """The run's record as one self-contained HTML page (as ``spdl-lab report RECORD``)."""
        if not self.record:
            raise SpdlLabError(f"the published run {self.name!r} has no record file to report")
        return view("run_report")(self.record, path)

    def restart(self, runner: str | None = None, **_: Any) -> Any:
        raise SpdlLabError("a RemoteSession cannot restart the script's run; restart the script")

    def close(self, timeout: float = 5.0) -> None:
        """Stop watching (the script goes on); the frames received stay readable."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._client is not None:
            self._client.close()

    stop = close  # as a Session's

    def __repr__(self) -> str:
        return f"RemoteSession({self.name!r}, pid={self.pid}, runner={self.runner!r}, {self._state})"


def _recorded_stats(path: str | os.PathLike, meta: dict[str, str]) -> Snapshot:
    """A record's last stats (its stages), with the step's figures from every step it holds."""
    step = with_record(path, lambda db: read_step_summary(db, meta))
    stats: Any = {}
    with contextlib.suppress(ValueError):  # a stats line cut short by a kill: the steps still stand
        stats = loads(meta.get("stats") or "{}")
    stats = stats if isinstance(stats, dict) else {}
    return Snapshot.from_dict({"runner": meta.get("runner", "?"), **stats, "running": False}, step=step)
