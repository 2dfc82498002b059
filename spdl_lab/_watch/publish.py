"""``lab.publish``: a training script shows its run (a record file and a local endpoint) to
notebooks on this host; under ``SPDL_LAB_WATCH=1`` (``spdl-lab watch``) every session and unowned
Loader, and through ``hook`` every DataLoader and SPDL pipeline, is published unchanged."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import sqlite3
import sys
import sysconfig
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from .. import _forksafe
from .._integrations.torch_dataloader import is_dataloader
from .._json import dumps
from .._pipeline import unique_name
from .._telemetry.frames import FrameChunk, Ring, chunk_since
from .._telemetry.sampler import DEFAULT_TICKS, Sampler
from .endings import signals_held
from .endings import watch as watch_endings
from .endpoint import Endpoint, Handlers, safe_name
from .records import RECORD_ENV, RecordWriter, append_ticks, mark_ended, step_rows
from .sources import LoopSource, held_weakly, source_of

ENV = "SPDL_LAB_WATCH"  # hook.ENV too: hook loads before spdl_lab, and imports this module
ENV_NAME = "SPDL_LAB_WATCH_NAME"
#: The job id ``spdl-lab watch`` gives what it runs, for a launcher that sets none of its own.
JOB_ENV = "SPDL_LAB_WATCH_JOB"

#: How often new frames and steps go from the run to the record's buffer.
PUMP_EVERY_S = 0.25
#: How often the run's stats are kept in the record, besides at its end.
STATS_EVERY_S = 5.0
_PUBLISHED: dict[int, Publisher] = {}  # by id of what they publish
#: States after which a run produces no more frames.
_ENDED = ("finished", "failed", "stopped", "exhausted", "killed")
#: The names taken by runs published with no code change.
_taken: set[str] = set()
#: The latest run published with no code change from each script line and loader (``_origin``).
_by_origin: dict[tuple[Any, ...], Publisher] = {}
#: How long a DataLoader waits for the run it goes on with to finish closing.
CLOSE_WAIT_S = 10.0
_lock = _forksafe.Lock()


def publish(obj: Any, name: str | None = None) -> Any:
    """Publish what the training loop iterates (a Loader, a Session, a DataLoader, any iterable of
    batches, an SPDL pipeline); returns what to iterate in its place. ``name``: ``SCRIPT-LINE``
    of the call by default. A notebook then watches it with ``lab.attach("resnet")``::

        loader = lab.publish(torch.utils.data.DataLoader(ds, batch_size=32), "resnet")
        for batch in loader:
            train(batch)
    """
    return (published_by(obj) or Publisher(obj, name or caller_line())).source.published


#: Where the standard library and installed packages live: a loop that a library runs for the
#: script (Lightning's fit loop) is named by the script's line that called it.
_LIBRARIES = ("<frozen ", *{os.path.join(sysconfig.get_path(key), "")
                            for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def caller_line() -> str:
    """``SCRIPT-LINE`` of the user's line that started a run (a published run's name): the innermost
    frame outside spdl_lab (the watch hook's module ``spdl_lab_watch_hook`` included) and outside
    the libraries, else the innermost outside spdl_lab (a script installed as a package)."""
    frame: Any = sys._getframe(1)  # the caller's: this frame in its own local would be a cycle
    while frame is not None and frame.f_globals.get("__name__", "").startswith("spdl_lab"):
        frame = frame.f_back
    user = frame
    while user is not None and user.f_code.co_filename.startswith(_LIBRARIES):
        user = user.f_back
    frame = user or frame
    return f"{Path(frame.f_code.co_filename).stem}-{frame.f_lineno}" if frame is not None else "run"


def published_by(obj: Any) -> Publisher | None:
    publisher = _PUBLISHED.get(id(obj))  # by id, and ``obj`` itself: a dropped one's id is reused
    return publisher if publisher is not None and publisher.obj is obj else None


def unpublish(obj: Any) -> None:
    """Stop publishing ``obj`` (what was published, or what ``publish`` returned) now."""
    for publisher in list(_PUBLISHED.values()):
        if obj is publisher.obj or obj is publisher.source.published:
            publisher.close()


def _runs() -> list[Publisher]:
    """The runs the script's end ends: those open, and the latest closed of each origin."""
    return list({id(p): p for p in [*_PUBLISHED.values(), *_by_origin.values()]}.values())


def publish_once(obj: Any) -> Publisher:
    """Publish ``obj`` unless it is: as ``$SPDL_LAB_WATCH_NAME`` or the line that started the run,
    ``-rank$RANK`` appended, then ``-2``, ``-3``... if taken. A DataLoader from where one came that
    the script let go of, with its epoch (a loop that builds its DataLoader each epoch), goes on
    with that run (``_origin``): one run, one record, every step, as the script counts them."""
    publisher = published_by(obj)  # each epoch of a published loop: no lock, no signal held
    if publisher is not None:
        return publisher
    with signals_held(), _lock:
        publisher = published_by(obj)
        if publisher is None:
            line, rank = caller_line(), os.environ.get("RANK", "")
            base = os.environ.get(ENV_NAME, "") or line
            base = f"{base}-rank{rank}" if rank.isdigit() else base
            origin = _origin(obj, line)
            prior = _by_origin.get(origin)
            if prior is not None and prior.resumable(obj):
                publisher = Publisher(obj, prior.given, resume=prior)
            else:
                name = unique_name(base, _taken, sep="-")
                _taken.add(name)
                publisher = Publisher(obj, name)
            _by_origin[origin] = publisher
    return publisher


def _origin(obj: Any, line: str) -> tuple[Any, ...]:
    """Where a loader comes from, as far as its runs go on: the script's line, and what tells a
    training DataLoader from a validation one iterated there (Lightning iterates both from the
    ``trainer.fit`` line): the type and length of its dataset, its batch size, its sampler's type."""
    dataset = getattr(obj, "dataset", None)
    try:
        size = len(dataset)
    except Exception:  # an IterableDataset without a length, or none
        size = None
    return (line, type(dataset).__qualname__, size, getattr(obj, "batch_size", None),
            type(getattr(obj, "sampler", None)).__qualname__)


def start_hook(event: str, subject: Any) -> None:
    """The ``_runs.StartHook``: with ``SPDL_LAB_WATCH=1``, publish a session or unowned Loader."""
    if event in ("loader", "session") and os.environ.get(ENV, "") == "1":
        publish_once(subject)


def record_of(name: str, pid: int) -> tuple[str, Path, dict[str, str | int]]:
    """A run's name, record and facts: ``name``, ``$SPDL_LAB_RECORD`` or ``spdl_lab_runs/NAME-PID.sqlite``
    and none; a torchrun rank's ``name-rankR``, ``rankR.sqlite`` in the override (``x.sqlite`` for
    ``x/``) or in ``spdl_lab_runs/NAME-JOBID``, and the job's. The rank's next runs of that name
    (Lightning's validation loop, then its training loop) are ``NAME-rankR-2``, ``rankR-2.sqlite``...
    in the same folder. The job id: TORCHELASTIC_RUN_ID, else ``spdl-lab watch``'s, else the
    launcher's pid (every rank's parent)."""
    override = os.environ.get(RECORD_ENV)
    alone = name, Path(override or f"spdl_lab_runs/{safe_name(name)}-{pid}.sqlite"), {}
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        return alone
    if not 0 <= rank < world:
        return alone
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = safe_name(job if job not in ("", "none") else
                    os.environ.get(JOB_ENV) or f"launcher-{os.getppid()}")
    job_name, again = re.fullmatch(rf"(.*?)(?:-rank{rank}(-\d+)?)?", name, re.DOTALL).groups()
    again = again or ""
    if override:
        folder = Path(override)
        folder = folder.with_suffix("") if folder.suffix == ".sqlite" else folder
    else:
        folder = Path("spdl_lab_runs") / f"{safe_name(job_name)}-{job[:8]}"
    facts = {"job_name": job_name, "job": job, "rank": rank, "local_rank": local,
             "world_size": world}
    return f"{job_name}-rank{rank}{again}", folder / f"rank{rank}{again}.sqlite", facts


class Timeline:
    """A run's ticks on one clock across its samplers (a Loader starts one each epoch), read
    thread-safely; the old sampler's last ticks are taken first, so an epoch's end is kept."""

    def __init__(self, capacity: int = DEFAULT_TICKS) -> None:
        self.ring = Ring(capacity)
        self.started_at = time.perf_counter()
        self._sampler: Sampler | None = None
        self._cursor = 0
        #: ticks viewers asked for after the ring had moved past them (a stalled viewer skips ahead)
        self.skipped_by_viewers = 0

    def pull(self, sampler: Sampler | None) -> None:
        if sampler is not self._sampler:
            if self._sampler is not None:
                self._take(self._sampler)  # the previous run's last ticks
            self._sampler, self._cursor = sampler, 0
        if sampler is not None:
            self._take(sampler)

    def frames_since(self, cursor: int) -> FrameChunk:
        """The ticks after ``cursor`` that the ring still holds (the oldest go first, counted)."""
        self.skipped_by_viewers += max(0, self.ring.count - len(self.ring) - cursor)
        return chunk_since(self.ring, cursor)

    def _take(self, sampler: Sampler) -> None:
        self._cursor, ticks, values = sampler.ring.since(self._cursor)
        append_ticks(self.ring, ticks, values, shift=sampler.started_at - self.started_at)


class Publisher:
    """The record and the endpoint of one published run; ``close()`` (or the exit) ends both.
    It never blocks training: a pump thread copies new ticks into one ``Timeline`` and the
    record's buffer; the endpoint's threads answer viewers from the timeline."""

    def __init__(self, obj: Any, name: str, resume: Publisher | None = None) -> None:
        """``resume``: a closed run of a DataLoader that this one goes on with (``resumable``)."""
        # First: every tick of the source counts from here, none before.
        self.timeline = resume.timeline if resume is not None else Timeline()
        self._pid = os.getpid()
        self.source = source_of(obj) if resume is None else LoopSource(obj, resume.source)
        # A dropped iterable ends its run (LoopSource.dropped); a Session or Loader ends by its own close.
        weakly = isinstance(self.source, LoopSource)
        self._key, self._obj = id(obj), held_weakly(obj) if weakly else (lambda: obj)
        self.given = name
        name, path, job = record_of(name, self._pid)  # job: the rank's facts, {} outside torchrun
        self.name = name
        if resume is not None:
            path = resume.writer.path
        elif (os.environ.get(RECORD_ENV) or job) and path.exists():  # a second run in one script
            path = path.with_name(f"{path.stem}-{safe_name(name)}{path.suffix}")
        self.ended_by: str | None = None  # "failed" or "stopped", set by end_as
        # The timeline's cursor (ticks before it are in the record) and the clock's step index.
        self._recorded, self._steps_recorded = (resume._recorded, resume._steps_recorded) if resume else (0, 0)
        self._stats_at = -math.inf
        self._stop = threading.Event()
        self._closed = threading.Event()  # set once close() has run to its end
        self._lock = _forksafe.Lock()
        self._copy_lock = _forksafe.RLock()
        handlers = Handlers(frames_since=self.timeline.frames_since, stats=self.stats,
                            state=self.state, set_concurrency=self.source.set_concurrency,
                            controls=self.source.controls)
        with contextlib.ExitStack() as undo:  # a step that fails stops what the steps before started
            undo.callback(self.source.close)
            self.writer = RecordWriter(path, meta={"name": name, "runner": self.source.runner, **job},
                                       resume=resume is not None)
            undo.callback(self.writer.close, state="failed")
            self.endpoint = Endpoint(name, handlers, record=str(path), runner=self.source.runner, job=job)
            undo.pop_all()
        loop = getattr(self.source, "loop", None)
        if loop is not None:  # a batch the loop holds as the script fails was no step
            me = weakref.ref(self)  # weakly: the loop's DataLoader goes when its user drops it
            loop.left_counts = lambda: getattr(me(), "ended_by", None) is None
        watch_endings(_runs)
        self._pump = threading.Thread(target=self._run, name="spdl_lab:publish", daemon=True)
        self._pump.start()
        atexit.register(self.close)  # the record gets its last frames when the script ends
        _PUBLISHED[self._key] = self

    @property
    def obj(self) -> Any:
        """What was published (None once its user dropped an iterable, which ended the run)."""
        return self._obj()

    def _run(self) -> None:
        while not self._stop.wait(PUMP_EVERY_S):
            if self.source.dropped():  # closed as without the lab: its own thread, as close() joins this one
                threading.Thread(target=self.close, name="spdl_lab:dropped", daemon=True).start()
                return
            self._copy()
            if self.source.state() in _ENDED:
                self._copy(final=True)
                self.writer.close(state=self._final_state())
                return

    def _copy(self, final: bool = False) -> None:
        with self._copy_lock:  # the pump, close() and a signal's flush(): one at a time
            self.timeline.pull(self.source.sampler())
            chunk = chunk_since(self.timeline.ring, self._recorded)
            self._recorded = chunk.cursor
            clock = self.source.clock
            if final:
                clock.summary()  # resolves the CUDA time of the last steps
            rows = step_rows(clock.records_since(self._steps_recorded))
            if rows:
                self._steps_recorded = rows[-1][0] + 1
            totals = clock.totals
            facts = {"steps_first_ns": str(clock.first_ns), "steps_device": clock.device_name,
                     "steps_offset_s": repr(clock.origin_s - self.timeline.started_at),
                     "steps_origin_s": repr(clock.origin_s),
                     "step_copies": str(totals.copies), "step_copy_ns": str(totals.copy_ns)}
            now = time.monotonic()
            if final or now - self._stats_at >= STATS_EVERY_S:
                self._stats_at = now
                facts["stats"] = dumps(self.stats())
            if not self.writer.closed:  # the pump closes it when the run ends
                self.writer.add(chunk)
                self.writer.add_steps(rows, facts)

    def flush(self) -> None:
        """Put everything so far in the record file now (a signal is about to end the script)."""
        if os.getpid() != self._pid or self._stop.is_set():  # a forked worker's SIGTERM, or closed
            return
        self._copy()
        self.writer.flush()

    def resumable(self, obj: Any) -> bool:
        """Whether DataLoader ``obj`` goes on with this run: it is one, whose DataLoader the script
        let go of, with its epoch (or that epoch ran out); closes it (as the pump would) and waits
        for that. An epoch the script still holds mid-way may be iterated again, beside ``obj``'s
        (datasets taken in turn): that is another run."""
        if not (is_dataloader(obj) and self.let_go() and self.source.loop.idle()):
            return False
        self.close()  # or waits for the close under way (the pump's, when it saw the drop)
        return self._closed.is_set() and self.ended_by is None

    def end_as(self, how: str) -> None:
        """The script ends ``how`` ("failed", "stopped"): so does this run, if open; or if closed as
        the script let go of its DataLoader (one built each epoch), no next one going on with it."""
        if not self._stop.is_set():
            if self.ended_by is None and self.source.state() == "running":
                self.ended_by = how
        elif self.let_go() and self._closed.wait(CLOSE_WAIT_S):
            self.ended_by = how
            with contextlib.suppress(sqlite3.Error):  # a record that cannot be marked must not keep it alive
                mark_ended(self.writer.path, how)

    def let_go(self) -> bool:
        """A DataLoader's run, whose DataLoader the script let go of."""
        source = self.source
        return isinstance(source, LoopSource) and source.workers is not None and source.obj is None

    def _final_state(self) -> str:
        return "failed" if self.source.state() == "failed" else self.ended_by or "finished"

    def stats(self) -> dict[str, Any]:
        """The source's stats, plus the ticks publishing dropped rather than make training wait."""
        return {**self.source.stats(), "dropped_ticks": {"record": self.writer.dropped_ticks,
                                                         "viewers": self.timeline.skipped_by_viewers}}

    def state(self) -> str:
        return self.ended_by or self.source.state()

    def close(self) -> None:
        """Stop publishing: the record gets the run's last frames and state, the endpoint goes; not
        in a forked child, whose atexit and SIGTERM handlers, record, endpoint are the script's."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            closing = self._stop.is_set()
            self._stop.set()
        if closing:  # by another thread: a SIGTERM's close waits for it, or ends the process mid-way
            self._closed.wait(CLOSE_WAIT_S)
            return
        with signals_held():
            self._pump.join(5.0)
            state = self._final_state()
            with contextlib.ExitStack() as steps:  # each step runs even when one before it fails
                steps.callback(self._closed.set)
                steps.callback(self._forget)
                steps.callback(self.endpoint.close)
                steps.callback(self.writer.close, state=state)
                steps.callback(self._copy, final=True)
                self.source.close()  # a source's sampler takes its last tick as it stops

    def _forget(self) -> None:
        atexit.unregister(self.close)
        if _PUBLISHED.get(self._key) is self:
            del _PUBLISHED[self._key]
