"""The ray runner's meters: each worker counts its stages' events (per node), and a daemon thread
sends them every ``FLUSH_S`` (a task its own before its block: it never waits on a message) to a
``MeterBoard`` actor, which adds them up per run."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._telemetry.histogram import NUM_BUCKETS, bucket_of, new_counts
from .._telemetry.meters import StageReading

FLUSH_S = 0.1
#: Failures kept per stage (stage, item, what, when): the runner names the one too many.
MAX_FAILED = 4096
_FIELDS = ("started", "tasks", "failures", "busy_ns")

_LOCK = threading.Lock()
#: per worker process: board key -> (board actor, stage -> pending deltas)
_PENDING: dict[str, tuple[Any, dict[str, dict[str, Any]]]] = {}
_FLUSHER: list[threading.Thread] = []
#: Set while counts wait to be sent: an idle worker's flusher sleeps until the next count.
_WAITING = threading.Event()


def _blank() -> dict[str, Any]:
    return {**dict.fromkeys(_FIELDS, 0), "hist": new_counts(), "failed": [], "nodes": Counter()}


@functools.cache
def _node() -> str:
    """This worker's node: its address and the start of its node ID (nodes on one host share one)."""
    return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"


def record(key: str, board: Any, stage: str, event: str, ns: int = 0, failure: tuple | None = None,
           n: int = 1) -> None:
    """Count ``n`` ``event``s of ``stage`` for the run ``key``: "started", "done", "failed", or
    "ran" (started and done; ``n`` done in ``ns`` together count at the mean: a range's items)."""
    node = _node()
    with _LOCK:
        pending = _entry(key, board, stage)
        if event in ("started", "ran"):
            pending["started"] += n
            if event == "started":
                return
        pending["tasks"] += n
        pending["nodes"][node] += n
        pending["busy_ns"] += ns
        pending["hist"][min(bucket_of(ns // n), NUM_BUCKETS - 1)] += n
        if event == "failed":
            pending["failures"] += 1
            if len(pending["failed"]) < MAX_FAILED:
                pending["failed"].append(failure)


def _entry(key: str, board: Any, stage: str) -> dict[str, Any]:
    """The counts of ``stage`` of the run ``key`` waiting to be sent (under ``_LOCK``)."""
    run = _PENDING.get(key)
    if run is None:
        run = _PENDING[key] = (board, {})
        if not _FLUSHER:
            flusher = threading.Thread(target=_flush_forever, name="spdl_lab:ray-meters", daemon=True)
            _FLUSHER.append(flusher)
            flusher.start()
    pending = run[1].get(stage)
    if pending is None:
        pending = run[1][stage] = _blank()
        _WAITING.set()
    return pending


def _flush_forever() -> None:
    while True:
        _WAITING.wait()
        time.sleep(FLUSH_S)
        flush()


def flush(key: str | None = None) -> None:
    """Send this worker's counts (of the run ``key``, or of all) to their boards now."""
    with _LOCK:
        keys = list(_PENDING) if key is None else [key] if key in _PENDING else []
        sends = [(k, *_PENDING.pop(k)) for k in keys]
        if not _PENDING:
            _WAITING.clear()
    for k, board, stages in sends:  # each has a stage: _entry makes one with its run
        with contextlib.suppress(Exception):  # the run is over and its board gone
            board.add.remote(k, stages)


class MeterBoard:
    """Totals per run (its key) and stage, from every worker's deltas; a run's go when it closes."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, dict[str, Any]]] = {}
        self.closed: set[str] = set()  # runs dropped: a task cancelled at close may still send

    def add(self, key: str, deltas: dict[str, dict[str, Any]]) -> None:
        if key in self.closed:
            return
        totals = self.runs.setdefault(key, {})
        for stage, delta in deltas.items():
            total = totals.setdefault(stage, _blank())
            for name in _FIELDS:
                total[name] += delta[name]
            total["hist"] = [a + b for a, b in zip(total["hist"], delta["hist"])]
            total["nodes"].update(delta["nodes"])
            total["failed"] = (total["failed"] + delta["failed"])[:MAX_FAILED]

    def read(self, key: str) -> dict[str, dict[str, Any]]:
        return self.runs.get(key, {})

    def drop(self, key: str) -> None:
        self.runs.pop(key, None)
        self.closed.add(key)


#: The board runs share while the Ray session lasts, (the session, the actor): a new one is a new
#: worker process, which the run's first counts would wait for.
_BOARD: list[tuple[tuple[Any, ...], Any]] = []


def board(shared: bool) -> Any:
    """A ``MeterBoard`` actor: the session's ``shared`` one, else the run's own (the caller kills
    it). No CPU; on the driver's node, which lives as long as the driver (a worker node may go)."""
    context = ray.get_runtime_context()
    session = (context.get_job_id(), getattr(ray._private.worker.global_worker.node, "session_name", None))
    with _LOCK:
        if shared and _BOARD and _BOARD[0][0] == session and _answers(_BOARD[0][1]):
            return _BOARD[0][1]
        here = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
        actor = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=here)(MeterBoard).remote()
        if shared:
            _BOARD[:] = [(session, actor)]
        return actor


def _answers(actor: Any) -> bool:
    with contextlib.suppress(Exception):  # else killed, or its node gone: a new one
        ray.get(actor.__ray_ready__.remote(), timeout=5.0)
        return True
    return False


def reading_of(totals: dict[str, Any] | None, name: str, kind: str, concurrency: int) -> StageReading:
    """One stage's totals as the engine's ``StageReading`` (busy time of finished tasks only)."""
    t = totals or _blank()
    done = t["tasks"]
    return StageReading(name=name, kind=kind, tasks=done, failures=t["failures"],
                        in_flight=max(0, t["started"] - done), busy_ns=t["busy_ns"], concurrency=concurrency,
                        hist=list(t["hist"]), busy_done_ns=t["busy_ns"], nodes=dict(t["nodes"]))
