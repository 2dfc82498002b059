"""The sweep's workers behind one interface: ``_sweep_child._Worker`` as threads of this interpreter
(``ThreadWorkers``) or each in a fresh one with two pipes (``WorkerPool``)."""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle
import psutil

from .._runners.children import Child, ChildGone, exit_reason, receive, spawn
from .._telemetry.probes import cpu_seconds
from ..errors import PipelineSpecError, RunnerError
from ._sweep_child import _Worker

if TYPE_CHECKING:
    from ._sweep import SweepSettings

CHILD = Path(__file__).with_name("_sweep_child.py")  # the script each worker process runs


@dataclass(frozen=True)
class StageFeed:
    """A stage to sweep: its function and the inputs it loops over."""

    name: str
    fn: Callable[[Any], Any]
    inputs: Sequence[Any]


class PointFailed(Exception):
    """An executor cannot go on with a point: its status ("timeout" or "error") and why."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


@dataclass
class Reading:
    """Totals over the active workers at one moment (counts cumulative, times since the last read)."""

    at: float
    done: int
    failures: int
    cpu_s: float
    times_ns: list[int] = field(default_factory=list)
    ends_ns: list[int] = field(default_factory=list)  # completion times of those calls
    busy: int = 0  # workers inside the function when asked
    first_error: str | None = None

    def add(self, reply: tuple) -> None:
        """One worker's ``_Worker.counts()``."""
        _, done, failures, times_ns, ends_ns, first_error, busy = reply
        self.busy += busy
        self.done += done
        self.failures += failures
        self.times_ns += times_ns
        self.ends_ns += ends_ns
        self.first_error = self.first_error or first_error


class ThreadWorkers:
    """``n`` workers as daemon threads of this interpreter; c of them run at a time. Threads
    stuck in the function cannot be stopped: they are left behind and counted."""

    kind = "thread"
    named = "thread(s)"

    def __init__(self, feed: StageFeed, n: int, settings: SweepSettings) -> None:
        self.workers = [_Worker(feed.fn, feed.inputs, i * len(feed.inputs) // n) for i in range(n)]
        self.threads = [threading.Thread(target=w.loop, daemon=True, name=f"spdl_lab:diagnose-{feed.name}-{i}")
                        for i, w in enumerate(self.workers)]
        for t in self.threads:
            t.start()
        self.size = n
        self.first_error: str | None = None
        self._stop_timeout_s = settings.point_timeout_s

    def send(self, c: int, message: Any, first: int = 0) -> None:
        for worker in self.workers[first:first + c]:
            (worker.running.set if message[0] == "run" else worker.running.clear)()

    def read(self, c: int, timeout_s: float, first: int = 0) -> Reading:
        reading = Reading(time.perf_counter(), 0, 0, time.process_time())
        for worker in self.workers[first:first + c]:
            reading.add(worker.counts())
        self.first_error = self.first_error or reading.first_error
        return reading

    def close(self, kill: bool) -> int:
        """Stop every worker; returns how many threads are still in the function after the timeout."""
        for worker in self.workers:
            worker.stop()
        deadline = time.monotonic() + self._stop_timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


class WorkerPool:
    """``n`` worker processes, each with a control pipe (parent -> child) and a data pipe
    (child -> parent); all start before any is waited on, so their imports overlap."""

    kind = "process"
    named = "worker process(es)"

    def __init__(self, feed: StageFeed, n: int, settings: SweepSettings) -> None:
        if not (sample := list(itertools.islice(feed.inputs, settings.max_inputs))):
            raise PipelineSpecError(f"lab.diagnose: stage {feed.name!r} has no inputs to measure processes with")
        init = {"fn": _pickled(feed.name, "its function", feed.fn, "Create locks, open files and clients "
                               "inside the function instead of capturing them"),
                "inputs": _pickled(feed.name, "its inputs", sample, "Its inputs (what the stage before "
                                   "returns) must be picklable to reach worker processes"),
                "sys_path": list(sys.path)}
        self.stage, self.size = feed.name, n
        self.first_error: str | None = None
        self.children: list[Child] = []
        self.ps: list[psutil.Process] = []
        try:
            for _ in range(n):
                self.children.append(spawn(["-I", str(CHILD)]))
                self.ps.append(psutil.Process(self.children[-1].proc.pid))
            self.send(n, init)
            deadline = time.monotonic() + settings.start_timeout_s
            for i in range(n):
                if self._recv(i, deadline) is None:
                    raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process did not "
                                      f"start within {settings.start_timeout_s:g} s; pass start_timeout_s= "
                                      f"to wait longer")
        except BaseException as exc:
            self.close(kill=True)
            if isinstance(exc, PointFailed):  # a worker died
                raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process could not start: "
                                  f"{exc}") from exc.__cause__
            raise

    def send(self, c: int, message: Any, first: int = 0) -> None:
        for child in self.children[first:first + c]:
            with contextlib.suppress(OSError):  # that worker is gone; the next read says how
                child.ctrl.send(message)

    def read(self, c: int, timeout_s: float, first: int = 0) -> Reading | None:
        """Counts from the c workers from ``first`` on, or None if one has not answered within timeout_s."""
        chosen = range(first, first + c)
        at = time.perf_counter()
        # CPU at the same moment as ``at``: the workers go on running while they answer,
        # and a fast function's completion times take a while to ship (docs/measurements.md).
        cpus = [cpu_seconds(self.ps[i]) for i in chosen]
        cpu_s = math.nan if None in cpus else sum(cpus)  # NaN: gone; the replies below say how
        self.send(c, ("read",), first)
        deadline = time.monotonic() + timeout_s
        reading = Reading(at, 0, 0, cpu_s)
        for i in chosen:
            if (reply := self._recv(i, deadline)) is None:
                return None
            reading.add(reply)
        self.first_error = self.first_error or reading.first_error
        if math.isnan(cpu_s):
            raise PointFailed("error", "a worker process vanished")
        return reading

    def _recv(self, i: int, deadline: float) -> Any:
        try:
            return receive(self.children[i], deadline)
        except ChildGone as gone:  # its point is an "error"
            proc = self.children[i].proc
            why = f"a worker process (pid {proc.pid}) {exit_reason(proc)}"
            raise PointFailed("error", why) from gone.__cause__

    def close(self, kill: bool) -> int:
        """Stop every worker (killed after a timeout): none is left behind."""
        if not kill:
            self.send(len(self.children), ("stop",))  # all at once: each call in the function ends together
        for child in self.children:
            if kill:
                child.proc.kill()
            child.close(timeout=2.0)  # after a kill it only reaps
        return 0


def _pickled(stage: str, what: str, value: Any, hint: str) -> bytes:
    try:
        return cloudpickle.dumps(value)  # by value: __main__, notebook cells and lambdas travel too
    except Exception as exc:
        raise PipelineSpecError(
            f"lab.diagnose: stage {stage!r} ({what}) cannot be pickled to send it to worker processes "
            f"({type(exc).__name__}: {exc}). {hint}, or measure this stage with threads only."
        ) from exc
