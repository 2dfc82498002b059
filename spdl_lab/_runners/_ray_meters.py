"""The lab's meters inside Ray workers, and one ``MeterBoard`` actor that adds them up.

A daemon thread in each worker sends its counts every ``FLUSH_S``: a task never waits on a message.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from .._telemetry.histogram import NUM_BUCKETS, bucket_of, new_counts
from .._telemetry.meters import StageReading

__all__ = ["FLUSH_S", "MeterBoard", "board_class", "record", "reading_of"]

FLUSH_S = 0.1
#: Failures kept per stage (stage, item, what, when): the runner names the one too many.
MAX_FAILED = 4096
_FIELDS = ("started", "tasks", "failures", "busy_ns")

_LOCK = threading.Lock()
#: per worker process: board key -> (board actor, stage -> pending deltas)
_PENDING: dict[str, tuple[Any, dict[str, dict[str, Any]]]] = {}
_FLUSHER: list[threading.Thread] = []


def _blank() -> dict[str, Any]:
    return {"started": 0, "tasks": 0, "failures": 0, "busy_ns": 0, "hist": new_counts(), "failed": []}


def record(key: str, board: Any, stage: str, event: str, ns: int = 0, failure: tuple | None = None) -> None:
    """Count one ``event`` ("started", "done" or "failed") of ``stage`` for the run ``key``, here."""
    with _LOCK:
        pending = _PENDING.setdefault(key, (board, {}))[1].setdefault(stage, _blank())
        if event == "started":
            pending["started"] += 1
        else:
            pending["tasks"] += 1
            pending["busy_ns"] += ns
            pending["hist"][min(bucket_of(ns), NUM_BUCKETS - 1)] += 1
            if event == "failed":
                pending["failures"] += 1
                if len(pending["failed"]) < MAX_FAILED:
                    pending["failed"].append(failure)
        if not _FLUSHER:
            flusher = threading.Thread(target=_flush_forever, name="spdl_lab:ray-meters", daemon=True)
            _FLUSHER.append(flusher)
            flusher.start()


def _flush_forever() -> None:
    while True:
        time.sleep(FLUSH_S)
        with _LOCK:
            batches = [entry for entry in _PENDING.values() if entry[1]]
            _PENDING.clear()
        for board, stages in batches:
            with contextlib.suppress(Exception):  # the run is over and its board gone
                board.add.remote(stages)


class MeterBoard:
    """Totals per stage, added up from every worker's deltas (a Ray actor; see ``board_class``)."""

    def __init__(self, stages: list[str]) -> None:
        self.totals = {name: _blank() for name in stages}

    def add(self, deltas: dict[str, dict[str, Any]]) -> None:
        for stage, delta in deltas.items():
            total = self.totals.setdefault(stage, _blank())
            for field in _FIELDS:
                total[field] += delta[field]
            total["hist"] = [a + b for a, b in zip(total["hist"], delta["hist"])]
            total["failed"] = (total["failed"] + delta["failed"])[:MAX_FAILED]

    def read(self) -> dict[str, dict[str, Any]]:
        return self.totals


def board_class() -> Any:
    """``MeterBoard`` as a Ray actor class: no CPU reserved, one call at a time is plenty."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(MeterBoard)


def reading_of(totals: dict[str, Any] | None, name: str, kind: str, concurrency: int) -> StageReading:
    """One stage's totals as the engine's ``StageReading`` (busy time of finished tasks only)."""
    t = totals or _blank()
    done = t["tasks"]
    return StageReading(name=name, kind=kind, tasks=done, failures=t["failures"],
                        in_flight=max(0, t["started"] - done), busy_ns=t["busy_ns"], concurrency=concurrency,
                        hist=list(t["hist"]), busy_done_ns=t["busy_ns"])
