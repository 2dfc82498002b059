"""``lab.publish``: a training script makes its run visible to notebooks on this host.

``publish(loader_or_session, name=None)`` returns what it was given, to use as
before, and starts two things beside the training loop:

* a record file (``records.RecordWriter``): the run's frames, written as they
  come, flushed at least every 2 s, so a killed script leaves a record up to
  its last flush;
* a local endpoint (``endpoint.Endpoint``: a Unix socket in a 0700 folder)
  that viewers (``lab.attach``) ask for frames, stats and state, and through
  which they set a stage's concurrency where the runner can change it live.

Publishing never blocks training: a pump thread copies new frames from the
run's sampler ring into the record's buffer every ``PUMP_EVERY_S``; the
endpoint's threads answer viewers from the same ring. When the run ends the
record is closed with the run's state; the endpoint stays until ``close()``
or the interpreter exits, answering with the final state.
"""

from __future__ import annotations

import atexit
import datetime as dt
import os
import threading
from typing import Any

from ..errors import PipelineSpecError
from ..loader import Loader
from ..telemetry.frames import FrameChunk

__all__ = ["PUMP_EVERY_S", "Publisher", "publish", "unpublish"]

#: How often new frames go from the run's ring to the record's buffer.
PUMP_EVERY_S = 0.5
#: The open publishers, by id of what they publish.
_PUBLISHED: dict[int, Publisher] = {}
#: States after which a run produces no more frames.
_ENDED = ("finished", "failed", "stopped", "exhausted", "killed")


def publish(obj: Any, name: str | None = None) -> Any:
    """Publish a ``lab.Loader`` or a ``lab.Session`` (``lab.run``); returns ``obj`` to use as before.

    Example, in a training script::

        loader = lab.publish(lab.Loader(pipeline, runner="thread"), name="resnet")
        for batch in loader:
            train(batch)

    and in a notebook: ``lab.attach()`` lists it, ``lab.attach("resnet")`` watches it.
    """
    from .auto import caller_line

    Publisher(obj, name or caller_line(0))
    return obj


def unpublish(obj: Any) -> None:
    """Stop publishing ``obj`` now (otherwise it ends when the interpreter exits)."""
    publisher = _PUBLISHED.pop(id(obj), None)
    if publisher is not None:
        publisher.close()


class Publisher:
    """The record and the endpoint of one published run; ``close()`` ends both."""

    def __init__(self, obj: Any, name: str) -> None:
        from .discovery import safe_name
        from .endpoint import Endpoint, Handlers
        from .records import RecordWriter, default_record_path

        self.source = _Source.of(obj)
        self.name = name
        pid = os.getpid()
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        path = default_record_path(name, pid)
        if os.environ.get("SPDL_LAB_RECORD") and path.exists():  # a second run in one script
            path = path.with_name(f"{path.stem}-{safe_name(name)}{path.suffix}")
        self.record_path = path
        self.writer = RecordWriter(path, meta={"name": name, "pid": str(pid), "started": started,
                                               "runner": self.source.runner, "state": "running"})
        self._cursor = 0
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        handlers = Handlers(frames_since=self.source.frames_since, stats=self.source.stats,
                            state=self.source.state, set_concurrency=self.source.set_concurrency,
                            controls=self.source.controls)
        try:
            self.endpoint = Endpoint(name, handlers, record=str(path), runner=self.source.runner)
        except BaseException:
            self.writer.close(state="failed")
            raise
        self._pump = threading.Thread(target=self._run, name="spdl_lab:publish", daemon=True)
        self._pump.start()
        atexit.register(self.close)  # the record gets its last frames when the script ends
        _PUBLISHED[id(obj)] = self

    def _run(self) -> None:
        while not self._stop.wait(PUMP_EVERY_S):
            self._copy()
            state = self.source.state()
            if state in _ENDED:
                self._copy()
                self.writer.close(state="failed" if state == "failed" else "finished")
                return

    def _copy(self) -> None:
        chunk: FrameChunk = self.source.frames_since(self._cursor)
        self._cursor = chunk.cursor
        if len(chunk):
            self.writer.add(chunk)

    def close(self) -> None:
        """Stop publishing: the record gets the run's last frames and state, the endpoint goes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._pump.join(5.0)
        self._copy()
        state = self.source.state()
        self.writer.close(state="failed" if state == "failed" else "finished")
        self.endpoint.close()
        atexit.unregister(self.close)
        if _PUBLISHED.get(id(self.source.obj)) is self:
            del _PUBLISHED[id(self.source.obj)]


class _Source:
    """What a publisher reads from a Loader or a Session, with one set of names."""

    def __init__(self, obj: Any, runner: str) -> None:
        self.obj = obj
        self.runner = runner

    @classmethod
    def of(cls, obj: Any) -> _Source:
        from ..experiments.session import Session

        if isinstance(obj, (Loader, Session)):
            return cls(obj, obj.runner or "iterable")
        raise PipelineSpecError(
            f"lab.publish takes a lab.Loader or a lab.Session (lab.run), got {type(obj).__name__}; "
            f"for a torch DataLoader, publish lab.run(dataloader, step=...)")

    def frames_since(self, cursor: int) -> FrameChunk:
        return self.obj.frames_since(cursor)

    def stats(self) -> dict[str, Any]:
        snap = self.obj.stats()
        table = snap.table()
        rows = table.reset_index().to_dict(orient="records") if not table.empty else []
        return {"runner": snap.runner, "running": snap.running, "elapsed_s": snap.elapsed_s,
                "items_out": snap.items_out, "stages": rows}

    def state(self) -> str:
        """A Session's state; a Loader is "running" until closed (between epochs too), then "finished"."""
        state = self.obj.state
        if isinstance(self.obj, Loader):
            return "finished" if state == "closed" else "running"
        return state

    def set_concurrency(self, stage: str, n: int) -> None:
        self.obj.set_concurrency(stage, n)

    def controls(self) -> dict[str, int]:
        return dict(self.obj.controls())
