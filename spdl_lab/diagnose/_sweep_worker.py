"""The parent's side of the process sweep's workers (``_sweep_child`` is the child's).

``WorkerPool`` starts each worker as a fresh interpreter running ``_sweep_child.py``
with two pipes: control (parent -> child: run, pause, read, stop) and data
(child -> parent: counts, completion times, crashes).
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from ..errors import RunnerError
from ..runners.children import ChildTraceback, exit_reason, spawn, stop_process
from ._point import PointFailed

__all__ = ["Reading", "WorkerDied", "WorkerPool"]

#: The script each worker runs.
CHILD = Path(__file__).with_name("_sweep_child.py")

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


class WorkerDied(PointFailed):
    """A worker process exited or closed its pipe: its point is an "error"; ``how`` says how."""

    def __init__(self, how: str) -> None:
        super().__init__("error", f"a {how}")
        self.how = how


class WorkerPool:
    """Worker processes, each with a control pipe (parent -> child) and a data pipe (child -> parent)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.procs: list[subprocess.Popen] = []
        self.ctrls: list[Connection] = []
        self.datas: list[Connection] = []
        self.ps: list[psutil.Process] = []
        self.first_error: str | None = None

    def start(self, n: int, init: dict[str, Any], timeout_s: float) -> None:
        for _ in range(n):  # all start before any is waited on: imports overlap
            child = spawn(["-I", str(CHILD)])
            self.procs.append(child.proc)
            self.datas.append(child.data)
            self.ctrls.append(child.ctrl)
            self.ps.append(psutil.Process(self.procs[-1].pid))
        self.send(n, init)
        deadline = time.monotonic() + timeout_s
        try:
            for i in range(n):
                if self._recv(i, deadline) is None:
                    raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process did not start "
                                      f"within {timeout_s:g} s; pass start_timeout_s= to wait longer")
        except WorkerDied as died:
            raise RunnerError(f"lab.diagnose: stage {self.stage!r}: a worker process could not start: "
                              f"{died.how}") from died.__cause__

    def send(self, c: int, message: Any, first: int = 0) -> None:
        """To the c workers from ``first`` on."""
        for ctrl in self.ctrls[first:first + c]:
            try:
                ctrl.send(message)
            except OSError:
                pass  # that worker is gone; the next read says how

    def read(self, c: int, timeout_s: float, first: int = 0) -> Reading | None:
        """Counts from the c workers from ``first`` on, or None if one has not answered within timeout_s."""
        chosen = range(first, first + c)
        at = time.perf_counter()
        # CPU at the same moment as ``at``: the workers go on running while they answer,
        # and a fast function's completion times take a while to ship (at millions of
        # calls per second, read afterwards, the CPU of 2 workers came to 147% of 2 cores).
        try:
            cpu_s = sum(t.user + t.system for t in (self.ps[i].cpu_times() for i in chosen))
        except psutil.Error:
            cpu_s = math.nan  # gone: the replies below say how, or the check after them
        self.send(c, ("read",), first)
        deadline = time.monotonic() + timeout_s
        reading = Reading(at, 0, 0, cpu_s)
        for i in chosen:
            reply = self._recv(i, deadline)
            if reply is None:
                return None
            _, done, failures, times_ns, ends_ns, first_error, busy = reply
            reading.busy += busy
            reading.done += done
            reading.failures += failures
            reading.times_ns += times_ns
            reading.ends_ns += ends_ns
            self.first_error = self.first_error or first_error
        if math.isnan(cpu_s):
            raise WorkerDied("worker process vanished")
        return reading

    def _recv(self, i: int, deadline: float) -> Any:
        data, proc = self.datas[i], self.procs[i]
        while True:
            try:
                if data.poll(max(0.0, min(0.1, deadline - time.monotonic()))):
                    # Unpickled only because it comes from a child we started ourselves.
                    message = data.recv()
                    if message[0] == "crash":
                        raise WorkerDied(_exit_reason(proc)) from ChildTraceback(message[1])
                    return message
            except (EOFError, OSError):
                raise WorkerDied(_exit_reason(proc)) from None
            if proc.poll() is not None:
                raise WorkerDied(_exit_reason(proc))
            if time.monotonic() >= deadline:
                return None

    def close(self, kill: bool) -> None:
        if not kill:
            self.send(len(self.procs), ("stop",))
        for proc in self.procs:
            if kill:
                proc.kill()
            stop_process(proc, timeout=2.0)  # after a kill it only reaps
        for conn in self.ctrls + self.datas:
            conn.close()


def _exit_reason(proc: subprocess.Popen) -> str:
    return f"worker process (pid {proc.pid}) {exit_reason(proc)}"
